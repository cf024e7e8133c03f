"""Reading an offline W&B run file (`wandb/offline-run-*/run-*.wandb`) without the network, for tests and checks.

wandb 0.31 writes it from its Go core and ships no Python reader (the old `wandb.sdk.internal.datastore` is gone;
`wandb sync` only uploads). The format is LevelDB's log: a 7-byte file header (":W&B", magic 0xBEE1, version), then
32 KiB blocks of chunks, each with a 7-byte header (crc32, length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4); a
block's tail shorter than a header is padding. Each reassembled record is a `wandb_internal_pb2.Record`.
"""

from __future__ import annotations

import glob
import json
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK = 32768
HEADER = 7


def records(path: str | Path):
    """The `Record` protobufs of one run file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B run file")
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if kind == 0:  # zero padding up to the block's end
            pos += left
            continue
        if pos + HEADER + length > len(data):  # a chunk still being written
            return
        chunk, pos = data[pos + HEADER : pos + HEADER + length], pos + HEADER + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def _items(updates) -> dict[str, Any]:
    """key → value of history / config / summary items (a key with '/' may come as `nested_key`)."""
    return {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in updates}


@dataclass
class OfflineRun:
    """What an offline run holds: its config, every history row, the final summary, and its files directory."""

    path: Path
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    name: str = ""

    @property
    def files(self) -> Path:
        return self.path.parent / "files"

    def chart(self, key: str) -> dict[str, Any]:
        """The table behind a logged `wandb.plot` chart (W&B stores it as `<key>_table`): {"columns", "data"}."""
        path_key = f"{key}_table/path"
        row = next(h for h in self.history if path_key in h)
        return json.loads((self.files / row[path_key]).read_text(encoding="utf-8"))


def complete(path: str | Path) -> bool:
    """Whether the run file ends with its exit record. `wandb.finish()` returns when wandb-core has handled the exit,
    but the core may still hold records in its write buffer: a run file read at once can lack them (measured:
    in 3 of 6 runs of tests/train/observe/test_monitor.py's W&B test on main at f99b936, wandb 0.31, 2 cores)."""
    return any(r.WhichOneof("record_type") == "exit" for r in records(path))


def read(path: str | Path, wait: float = 10.0) -> OfflineRun:
    """An offline run's contents, once its file is complete (polling up to `wait` seconds)."""
    deadline = time.monotonic() + wait
    while not complete(path) and time.monotonic() < deadline:
        time.sleep(0.1)
    run = OfflineRun(Path(path))
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            run.history.append(_items(record.history.item))
        elif kind == "config":
            run.config |= _items(record.config.update)
        elif kind == "summary":
            run.summary |= _items(record.summary.update)
        elif kind == "run":
            run.name = record.run.display_name or run.name
            run.config |= _items(record.run.config.update)
    return run


def find(directory: str | Path, wait: float = 10.0) -> OfflineRun:
    """The one offline run under `directory` (a run directory, or whatever WANDB_DIR pointed at)."""
    (path,) = glob.glob(str(Path(directory) / "wandb" / "offline-run-*" / "run-*.wandb"))
    return read(path, wait)
