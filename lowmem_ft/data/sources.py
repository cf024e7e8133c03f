"""Where training data comes from: one `DataSource` per data set, resolved from the recipe's `data` section.

A source is a local file (JSONL, JSON, Parquet, CSV, TSV, or Arrow as `datasets` writes its shards), a directory of
such files, a directory written by `datasets`' `save_to_disk`, or a Hugging Face Hub data set id (`org/name`).
Resolving one reads no data: it decides the kind, checks that the path exists and can be read and that `split` /
`subset` / `columns` make sense for it, and for a directory lists the split's files the way `datasets.load_dataset`
does (its file-name conventions: `train.jsonl`, `test-00000-of-00002.parquet`, a `train/` folder, ...).
`check_source(recipe)` does this for every source of a recipe, so a bad `--data` stops a run with one line before a
model or tokenizer is loaded.
Reading is `lowmem_ft.data.readers`; mixing several sources is `lowmem_ft.data.mix`.

Compressed files (`train.jsonl.gz`, `.bz2`, `.xz`, `.zst`, `.lz4`, or a `.jsonl` whose bytes are compressed) are read
as they are, decompressed as a stream by `datasets`' own single-file compression filesystems (`xopen` with its
`gzip://` / `bz2://` / `zstd://` … protocols, datasets 5.2 filesystems/compression.py): the kind is the suffix
under the compression one, and JSONL errors still name the line of the decompressed text.

A string is a Hub id only if it is not an existing local path and looks like `org/name` (no data-file suffix, and
`org` is not a local directory): a mistyped local path is reported as missing, not looked up on the Hub.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lowmem_ft.data.formats import FORMATS
from lowmem_ft.errors import ConfigError, UserError

FILE_KINDS = {
    ".jsonl": "jsonl",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".tsv": "tsv",
    ".arrow": "arrow",
}
# Single-file compressions datasets reads (filesystems/__init__.py COMPRESSION_FILESYSTEMS: suffix → protocol), and
# their magic numbers (utils/file_utils.py MAGIC_NUMBER_TO_COMPRESSION_PROTOCOL) for a file whose suffix hides them.
COMPRESSIONS = {
    ".gz": "gzip",
    ".gzip": "gzip",
    ".bz2": "bz2",
    ".xz": "xz",
    ".lz4": "lz4",
    ".zst": "zstd",
    ".zstd": "zstd",
}
MAGIC = {
    b"\x1f\x8b": "gzip",
    b"BZh": "bz2",
    b"\xfd7zXZ\x00": "xz",
    b"\x04\x22\x4d\x18": "lz4",
    b"\x28\xb5\x2f\xfd": "zstd",
}
CODEC_PACKAGES = {"zstd": "zstandard", "lz4": "lz4"}  # the others are in Python's standard library
# The fields each format reads (formats.convert); data.columns maps these names onto a data set's own.
FORMAT_FIELDS = {
    "text": ("text",),
    "prompt_completion": ("prompt", "completion"),
    "chat_prompt_completion": ("prompt", "completion", "tools", "system"),
    "messages": ("messages", "tools", "system"),
    "sharegpt": ("conversations", "tools", "system"),
    "alpaca": ("instruction", "input", "output", "system", "history"),
    # preference shapes (lowmem_ft.data.preference), chosen by training.method rather than detected
    "preference": ("prompt", "chosen", "rejected", "system", "tools"),
    "kto": ("prompt", "completion", "label", "system", "tools"),
}
FIELDS = tuple(dict.fromkeys(f for fields in FORMAT_FIELDS.values() for f in fields))
# alpaca's input and history, a chat record's tool schemas and system prompt may be absent
OPTIONAL_FIELDS = ("input", "tools", "system", "history")
MIX_KEYS = ("path", "weight", "split", "subset", "columns", "format")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


@dataclass(frozen=True)
class DataSource:
    """One data set to read: `kind` is jsonl, json, parquet, csv, tsv, arrow, dir, saved or hub."""

    path: str  # as given: a local path or a Hub id
    kind: str
    split: str = "train"
    subset: str = ""
    columns: tuple[tuple[str, str], ...] = ()  # (our field, the data set's column)
    format: str = "auto"
    streaming: bool = False
    weight: float = 1.0
    files: tuple[str, ...] = ()  # the data files read (a directory's split; a file itself)
    ignored: tuple[str, ...] = ()  # files in a directory that are not data files (reported, not read)
    key: str = "data"  # the recipe keys that describe it, for messages: data, data.mix[1]

    @property
    def column_map(self) -> dict[str, str]:
        return dict(self.columns)

    @property
    def label(self) -> str:
        """How messages name it: the path, with the split and subset where there is a choice of them."""
        if self.kind == "hub":
            return f"{self.path} [{self.subset + '/' if self.subset else ''}{self.split}]"
        if self.kind in ("dir", "saved") and self.split != "train":
            return f"{self.path} [{self.split}]"
        return self.path

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["columns"] = self.column_map
        out.pop("key")
        out["files"] = list(self.files) if self.kind == "dir" else []
        out["ignored"] = list(self.ignored)
        return out


def file_kind(path: str | Path) -> str | None:
    """jsonl, json, parquet, csv, tsv or arrow from the file's suffix, under a compression suffix (`x.jsonl.gz`: jsonl)."""
    name = Path(path)
    if name.suffix.lower() in COMPRESSIONS:
        name = Path(name.stem)
    return FILE_KINDS.get(name.suffix.lower())


def compression(path: str | Path, head: bytes = b"") -> str | None:
    """The datasets protocol that decompresses the file: from its suffix, else from its first bytes `head`."""
    return COMPRESSIONS.get(Path(path).suffix.lower()) or by_magic(head)


def by_magic(head: bytes) -> str | None:
    """The compression whose magic number starts `head`, or None."""
    return next((protocol for magic, protocol in MAGIC.items() if head.startswith(magic)), None)


def open_binary(path: str | Path, decompress: bool = True):
    """Open a data file for reading, decompressed (`decompress`) when it is compressed; a file we may not read is a
    one-line error, not a traceback."""
    try:
        handle = open(path, "rb")  # noqa: SIM115 (the caller closes it)
        protocol = compression(path, handle.peek(8)[:8]) if decompress else None
    except OSError as exc:
        raise UserError(f"cannot read data file {path} ({exc.strerror or exc}); check that it is readable") from None
    if protocol is None:
        return handle
    handle.close()
    return _decompressed(path, protocol)


def _decompressed(path: str | Path, protocol: str):
    """The decompressed bytes of `path` through datasets' compression filesystem for `protocol`."""
    from datasets.utils.file_utils import xopen

    local = Path(path).resolve()
    inner = local.stem if local.suffix.lower() in COMPRESSIONS else local.name
    try:
        return xopen(f"{protocol}://{inner}::{local}", "rb")
    except (ImportError, ValueError) as exc:  # fsspec: "Compression type zstd not supported" without its package
        package = CODEC_PACKAGES.get(protocol, protocol)
        raise UserError(
            f"{path} is {protocol}-compressed, and reading it needs the {package} package ({exc}): pip install "
            f"{package}, or decompress the file"
        ) from None
    except OSError as exc:
        raise UserError(f"cannot read data file {path} ({exc.strerror or exc}); check that it is readable") from None


def looks_like_hub_id(path: str) -> bool:
    if not _HUB_ID.fullmatch(path) or file_kind(path) is not None:
        return False
    return not Path(path.split("/")[0]).is_dir()  # data/train: a missing local folder, not org/name


def resolve_source(
    path: str,
    *,
    split: str = "train",
    subset: str = "",
    columns: dict[str, str] | None = None,
    fmt: str = "auto",
    streaming: bool = False,
    weight: float = 1.0,
    key: str = "data",
    path_key: str = "path",
    split_key: str = "split",
) -> DataSource:
    """The source `path` names, checked without reading its data; a one-line `UserError` when it cannot be used."""
    if not path:
        raise UserError(f"{key}.{path_key} is empty; pass --data FILE, DIRECTORY or a Hub id org/name")
    if fmt not in FORMATS:
        raise UserError(f"unknown data format {fmt!r}; use one of auto, {', '.join(FORMATS[1:])}")
    base = {
        "path": path,
        "split": split or "train",
        "subset": subset,
        "columns": _check_columns(columns or {}, key),
        "format": fmt,
        "streaming": streaming,
        "weight": weight,
        "key": key,
    }
    local = Path(path).expanduser()
    if local.is_dir():
        return _directory(local, base, split_key)
    if local.exists():
        if not local.is_file():
            raise UserError(f"{path} is not a regular file; pass a data file, a directory of them or a Hub id")
        kind = file_kind(local)
        if kind is None:
            suffix = "".join(local.suffixes[-2:]) if local.suffix.lower() in COMPRESSIONS else local.suffix
            raise UserError(
                f"{path}: unsupported file type {suffix or '(no suffix)'!r}; data files are {', '.join(FILE_KINDS)} "
                f"(also compressed: {', '.join(COMPRESSIONS)})"
            )
        if kind in ("parquet", "arrow") and local.suffix.lower() in COMPRESSIONS:
            name = {"parquet": "Parquet", "arrow": "Arrow"}[kind]
            raise UserError(f"{path}: {name} is compressed inside the file already; decompress it to .{kind}")
        _one_split(path, base, split_key, "is one file, which is the whole 'train' split")
        open_binary(local).close()
        return DataSource(kind=kind, files=(str(local),), **base)
    if looks_like_hub_id(path):
        return DataSource(kind="hub", **base)
    raise UserError(
        f"data {path} does not exist; pass --data a data file ({', '.join(FILE_KINDS)}), a directory of them, "
        "a save_to_disk directory or a Hub id org/name"
    )


def _check_columns(columns: dict[str, str], key: str) -> tuple[tuple[str, str], ...]:
    unknown = [ours for ours in columns if ours not in FIELDS]
    if unknown:
        raise UserError(
            f"{key}.columns maps {', '.join(map(repr, unknown))}, which no format reads; map our field names "
            f"({', '.join(FIELDS)}) to the data set's columns, e.g. {{prompt: question, completion: answer}}"
        )
    return tuple((ours, str(theirs)) for ours, theirs in columns.items())


def _no_subset(path: str | Path, base: dict) -> None:
    if base["subset"]:
        raise UserError(
            f"{base['key']}.subset names a configuration of a Hub data set; {path} has none, leave it unset"
        )


def _one_split(path: str | Path, base: dict, split_key: str, what: str) -> None:
    key = base["key"]
    if base["split"] != "train":
        raise UserError(f"{key}.{split_key}={base['split']!r}: {path} {what}; leave {key}.{split_key} unset")
    _no_subset(path, base)


def _directory(path: Path, base: dict, split_key: str) -> DataSource:
    """A `save_to_disk` directory, or a directory of data files read split by split as `load_dataset` reads it."""
    import datasets.config as dc

    key, split = base["key"], base["split"]
    if (path / dc.DATASETDICT_JSON_FILENAME).is_file():
        _no_subset(path, base)
        try:
            splits = json.loads((path / dc.DATASETDICT_JSON_FILENAME).read_text(encoding="utf-8"))["splits"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserError(
                f"{path}/{dc.DATASETDICT_JSON_FILENAME} is not a readable save_to_disk index ({exc}); save the data "
                "set again with save_to_disk"
            ) from None
        if split not in splits:
            raise UserError(
                f"{key}.{split_key}={split!r}: the saved data set {path} has the splits {', '.join(splits)}; "
                f"set {key}.{split_key} to one of them"
            )
        return DataSource(kind="saved", **base)
    if (path / dc.DATASET_STATE_JSON_FILENAME).is_file():
        _one_split(path, base, split_key, "is one saved split (a Dataset, not a DatasetDict)")
        return DataSource(kind="saved", **base)
    by_split, ignored = data_files(path)
    if not by_split:
        raise UserError(
            f"{path} holds no data files ({', '.join(FILE_KINDS)}) and is not a save_to_disk data set "
            f"(no {dc.DATASETDICT_JSON_FILENAME} or {dc.DATASET_STATE_JSON_FILENAME}); pass a data file or a "
            "directory of them"
        )
    _no_subset(path, base)
    if split not in by_split:
        raise UserError(
            f"{key}.{split_key}={split!r}: {path} has the splits {', '.join(by_split)} (named as load_dataset names "
            f"them, from the file names); set {key}.{split_key} to one of them"
        )
    for name in by_split[split]:
        open_binary(name).close()
    return DataSource(kind="dir", files=tuple(by_split[split]), ignored=tuple(ignored), **base)


def data_files(path: Path) -> tuple[dict[str, list[str]], list[str]]:
    """({split: the directory's data files for it}, files that are not data files), by datasets' conventions."""
    from datasets.data_files import DataFilesDict, get_data_patterns
    from datasets.exceptions import DatasetsError

    try:
        patterns = get_data_patterns(str(path))
    except (DatasetsError, FileNotFoundError):  # EmptyDatasetError: nothing in it at all
        return {}, []
    found = DataFilesDict.from_patterns(patterns, base_path=str(path))
    by_split: dict[str, list[str]] = {}
    ignored: list[str] = []
    for split, names in found.items():
        for name in sorted(names):
            if file_kind(name) is not None:
                by_split.setdefault(str(split), []).append(name)
            else:
                ignored.append(name)
    return by_split, ignored


def sources_of(recipe) -> list[DataSource]:
    """The training sources of a recipe: `data.path`, or each entry of `data.mix`."""
    d = recipe.data
    if d.mix and d.path:
        raise UserError(
            f"data.path ({d.path}) and data.mix are both set; train on one data set (--data) or on a mix, not both"
        )
    if not d.mix:
        if not d.path:
            raise UserError("no training data given; pass --data FILE, DIRECTORY or a Hub id org/name")
        return [
            resolve_source(
                d.path, split=d.split, subset=d.subset, columns=d.columns, fmt=d.format, streaming=d.streaming
            )
        ]
    entries = mix_entries(d)
    return [
        resolve_source(
            e["path"],
            split=e["split"],
            subset=e["subset"],
            columns=e["columns"],
            fmt=e["format"],
            streaming=d.streaming,
            weight=e["weight"],
            key=f"data.mix[{i}]",
        )
        for i, e in enumerate(entries)
    ]


def mix_entries(d) -> list[dict[str, Any]]:
    """`data.mix` checked entry by entry (every problem reported at once); unset keys take the section's values."""
    problems: list[str] = []
    out = []
    for i, entry in enumerate(d.mix):
        where = f"data.mix[{i}]"
        if not isinstance(entry, dict):
            problems.append(f"{where} must be a mapping like {{path: FILE, weight: 1}}, got {entry!r}")
            continue
        problems += [f"{where}: unknown key '{k}'; keys are {', '.join(MIX_KEYS)}" for k in entry if k not in MIX_KEYS]
        e = {"split": d.split, "subset": d.subset, "columns": d.columns, "format": d.format, "weight": 1.0, **entry}
        if not isinstance(e.get("path"), str) or not e["path"]:
            problems.append(f"{where}.path must name a data set, got {e.get('path')!r}")
        w = e["weight"]
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not w > 0:
            problems.append(f"{where}.weight must be a positive number, got {w!r}")
        for k in ("split", "subset"):
            if not isinstance(e[k], str):
                problems.append(f"{where}.{k} must be a string, got {e[k]!r}")
        if not isinstance(e["columns"], dict) or not all(isinstance(v, str) for v in e["columns"].values()):
            problems.append(f"{where}.columns must map our field names to column names, got {e['columns']!r}")
        if e["format"] not in FORMATS:
            problems.append(f"{where}.format must be one of {', '.join(FORMATS)}, got {e['format']!r}")
        out.append(e)
    if problems:
        raise ConfigError(problems, source="data.mix")
    return out


def eval_source_of(recipe) -> DataSource | None:
    """The evaluation source: `data.eval_path` (read like `path`), or `data.eval_split` of `data.path`; else None."""
    d = recipe.data
    opts = {"columns": d.columns, "fmt": d.format, "key": "data", "split_key": "eval_split"}
    if d.eval_path:
        hub = not Path(d.eval_path).expanduser().exists() and looks_like_hub_id(d.eval_path)
        return resolve_source(
            d.eval_path, split=d.eval_split or "train", subset=d.subset if hub else "", path_key="eval_path", **opts
        )
    if not d.eval_split:
        return None
    if d.mix:
        raise UserError(
            "data.eval_split picks the evaluation split of data.path; with data.mix name the evaluation data set in "
            "data.eval_path"
        )
    return resolve_source(d.path, split=d.eval_split, subset=d.subset, **opts)


def check_source(recipe) -> list[DataSource]:
    """Every data source of `recipe` resolved, or a one-line `UserError` naming the one that is missing or unusable.

    Cheap (reads no data, loads no model): `train` and `plan` call it before the length profile.
    """
    sources = sources_of(recipe)
    d = recipe.data
    if d.streaming and recipe.training.max_steps <= 0:
        raise UserError(
            "data.streaming: a stream has no length, so the number of steps is unknown; set training.max_steps "
            "(e.g. --set training.max_steps=1000)"
        )
    if d.streaming and d.eval_fraction > 0:
        raise UserError(
            "data.eval_fraction holds out part of the data, which needs all of it in memory; with data.streaming "
            "name the evaluation data in data.eval_path or data.eval_split"
        )
    if d.eval_fraction > 0 and (d.eval_path or d.eval_split):
        given = "data.eval_path" if d.eval_path else "data.eval_split"
        raise UserError(
            f"data.eval_fraction={d.eval_fraction:g} and {given} both name evaluation data; set one of them "
            "(data.eval_fraction holds out part of the training data)"
        )
    eval_source_of(recipe)
    return sources
