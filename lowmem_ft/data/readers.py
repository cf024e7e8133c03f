"""Reading a `DataSource` row by row, and turning its rows into the records TRL's SFTTrainer takes.

JSON Lines and JSON files are read here; Parquet, Arrow, CSV / TSV, `save_to_disk` directories and Hub data sets
through `datasets` (`load_dataset` with its parquet / arrow / csv builders or the Hub id, `load_from_disk`).

Why JSON is read here rather than by datasets' json builder: that builder infers one Arrow schema over the file, so
a key missing from one record comes back as null, a field whose type changes between records is re-encoded as a
JSON string, and files that look like agent traces are converted (datasets 5.2, packaged_modules/json/json.py); its
errors name no line. Our validator (`formats.convert`) must see each record as written to name `file:line` and the
field and to skip only the bad line. A JSONL error names the file's physical line (blank lines count, as in an
editor). Sources with a schema (Parquet, CSV, saved and Hub data sets) lose nothing through datasets; there a struct
field absent from one row is null, so nulls inside nested values are dropped before validation (they mean
"missing"), and errors name the row, counting from 0 as `dataset[17]` does: `data.parquet row 17: ...`. Local
Parquet / CSV files are iterated with `streaming=True`, so they are not copied into datasets' Arrow cache: the
tokenized result is what we cache (`lowmem_ft.data.tokenize`).

CSV cells are read as strings (a CSV has no types: an answer "42" is text) and empty cells as "", not NaN; a UTF-8
byte-order mark is accepted in every kind of file. `data.columns` renames a row's columns to our field names before
the format is detected; columns no format reads are reported, never dropped silently.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import itertools
import json
import logging
import lzma
import os
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lowmem_ft.data import preference, prompts
from lowmem_ft.data.formats import BadLine, LoadedData, convert, detect_format
from lowmem_ft.data.preference import PREFERENCE_FORMATS
from lowmem_ft.data.sources import (
    COMPRESSIONS,
    FORMAT_FIELDS,
    OPTIONAL_FIELDS,
    DataSource,
    by_magic,
    file_kind,
    open_binary,
    resolve_source,
)
from lowmem_ft.errors import UserError

log = logging.getLogger(__name__)

BOM = codecs.BOM_UTF8


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# What reading a file can raise: the OS's errors, and a compressed stream's (cut short: EOFError; damaged: zlib's,
# lzma's; gzip's and bz2's are OSErrors)
READ_ERRORS = (OSError, EOFError, zlib.error, lzma.LZMAError)


def _read_error(path: str, exc: Exception) -> UserError:
    why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return UserError(f"cannot read data file {path} ({why}); check that it is readable and whole")


# ---- rows: (where, a dict or the BadLine that stands for an unreadable record) --------------------------------


def iter_rows(source: DataSource, decode_media: bool = True) -> Iterator[tuple[str, Any]]:
    """Every row of `source` in order, each with the place an error about it names. `decode_media=False`: a data
    set's `Image` (audio, video) values come as datasets stores them, `{"bytes": ..., "path": ...}`, not decoded
    (image chats read their images themselves, `lowmem_ft.vision.images`)."""
    if source.kind == "hub":
        yield from _dataset_rows(_media(load_hub(source), decode_media), source.label)
    elif source.kind == "saved":
        yield from _dataset_rows(_media(load_saved(source), decode_media), source.label)
    else:
        for name in source.files:
            kind = file_kind(name)
            if kind == "jsonl":
                yield from _jsonl_rows(name)
            elif kind == "json":
                yield from _json_rows(name)
            else:
                yield from _dataset_rows(_media(open_table(name, kind), decode_media), name)


def _media(dataset, decode: bool):
    """The data set with its media features decoded (as loaded) or not (`IterableDataset.decode(False)`)."""
    if decode:
        return dataset
    if not hasattr(dataset, "decode"):  # a map-style Dataset: iterated as a stream of its own shards
        dataset = dataset.to_iterable_dataset()
    return dataset.decode(False)


def _parse_object(text: str, what: str) -> dict | BadLine:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        return BadLine(f"invalid JSON ({exc.msg} at column {exc.colno})")
    except RecursionError:
        return BadLine(f"JSON nested deeper than Python's JSON reader allows (about {sys.getrecursionlimit()} levels)")
    if not isinstance(record, dict):
        return BadLine(f"each {what} must be a JSON object, got {type(record).__name__}")
    return record


def _jsonl_rows(path: str) -> Iterator[tuple[str, Any]]:
    with open_binary(path) as handle:
        lines = enumerate(handle, start=1)  # decompressed: the lines of the text inside
        lineno = 0
        while True:
            try:
                lineno, raw = next(lines)
            except StopIteration:
                if lineno == 0:
                    raise UserError(f"{path}:1: the file is empty; it must hold one JSON sample per line") from None
                return
            except READ_ERRORS as exc:
                raise _read_error(path, exc) from None
            if lineno == 1 and raw.startswith(BOM):
                raw = raw[len(BOM) :]
            where = f"{path}:{lineno}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield where, BadLine(f"not UTF-8 (byte {exc.start}); re-encode the file as UTF-8")
                continue
            if text.strip():
                yield where, _parse_object(text, "line")


def _json_rows(path: str) -> Iterator[tuple[str, Any]]:
    """A JSON array of records; a .json file holding JSON Lines is read as JSONL (line-numbered)."""
    with open_binary(path) as handle:
        try:
            data = handle.read().removeprefix(BOM)
        except READ_ERRORS as exc:
            raise _read_error(path, exc) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 (byte {exc.start}); re-encode the file as UTF-8") from None
    body = text.strip()
    if not body:
        raise UserError(f"{path}: the file is empty; it must hold a JSON array of samples or one sample per line")
    if not body.startswith("["):
        if "\n" in body and isinstance(_parse_object(body, "file"), dict):
            raise UserError(
                f"{path} holds one JSON object; training data is an array of records ([{{...}}, ...]) or one "
                "record per line (JSON Lines)"
            )
        yield from _jsonl_rows(path)
        return
    try:
        items = json.loads(body)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}:{exc.lineno}: invalid JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise UserError(
            f"{path}: JSON nested deeper than Python's JSON reader allows (about {sys.getrecursionlimit()} levels)"
        ) from None
    for i, item in enumerate(items):
        ok = isinstance(item, dict)
        yield (
            f"{path} row {i}",
            item if ok else BadLine(f"each record must be a JSON object, got {type(item).__name__}"),
        )


def _without_nulls(value: Any) -> Any:
    """Arrow fills a struct field that a row lacks with null: inside nested values, null means missing."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _dataset_rows(dataset, label: str) -> Iterator[tuple[str, Any]]:
    """Rows of a `datasets` Dataset / IterableDataset; a read failure names the row and is one line."""
    import pyarrow as pa
    from datasets.exceptions import DatasetsError

    rows = iter(dataset)
    for i in itertools.count():
        try:
            row = next(rows)
        except StopIteration:
            return
        except (ValueError, OSError, DatasetsError, pa.ArrowException) as exc:
            raise UserError(f"{label} row {i}: cannot read it ({_first_line(exc)})") from None
        yield f"{label} row {i}", {k: _without_nulls(v) for k, v in row.items()}


# ---- sources read through datasets ----------------------------------------------------------------------------


def _csv_options(path: str, kind: str) -> dict[str, Any]:
    """Every column a string, empty cells "", a BOM accepted: the header names the columns (as pandas names them)."""
    import csv
    import io

    from datasets import Features, Value

    sep = "\t" if kind == "tsv" else ","
    with open_binary(path) as handle:
        try:
            header = next(csv.reader(io.TextIOWrapper(handle, encoding="utf-8-sig", newline=""), delimiter=sep), None)
        except UnicodeDecodeError as exc:
            raise UserError(f"{path}: not UTF-8 (byte {exc.start}); re-encode the file as UTF-8") from None
        except READ_ERRORS as exc:
            raise _read_error(path, exc) from None
    if not header:
        raise UserError(f"{path}: the file is empty; a {kind.upper()} file starts with a header row naming its columns")
    names = [name or f"Unnamed: {i}" for i, name in enumerate(header)]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UserError(f"{path}: the header names the column(s) {', '.join(map(repr, twice))} more than once")
    features = Features({name: Value("string") for name in names})
    return {"features": features, "encoding": "utf-8-sig", "na_filter": False, "sep": sep}


def open_table(path: str, kind: str):
    """A local Parquet / Arrow / CSV / TSV file as an IterableDataset (read in batches, not copied into datasets' cache)."""
    from datasets import load_dataset

    options = _csv_options(path, kind) if kind in ("csv", "tsv") else {}
    with open_binary(path, decompress=False) as handle:
        hidden = by_magic(handle.peek(8)[:8])
    if hidden is not None and Path(path).suffix.lower() not in COMPRESSIONS:
        # datasets' builders decompress by suffix only (utils/file_utils.py _get_extraction_protocol)
        suffix = next(k for k, v in COMPRESSIONS.items() if v == hidden)
        raise UserError(f"{path} is {hidden}-compressed under a .{kind} name; rename it {Path(path).name}{suffix}")
    builder = kind if kind in ("parquet", "arrow") else "csv"
    try:
        return load_dataset(builder, data_files=[str(path)], split="train", streaming=True, **options)
    except (ValueError, OSError) as exc:
        raise UserError(f"cannot read {path} as {kind} ({_first_line(exc)})") from None


def load_saved(source: DataSource):
    """A `save_to_disk` directory's split (memory-mapped; an IterableDataset when streaming)."""
    from datasets import DatasetDict, load_from_disk

    try:
        ds = load_from_disk(source.path)
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(
            f"cannot load the saved data set {source.path} ({_first_line(exc)}); pass a directory written by "
            "save_to_disk"
        ) from None
    if isinstance(ds, DatasetDict):
        ds = ds[source.split]
    return ds.to_iterable_dataset() if source.streaming else ds


@functools.lru_cache(maxsize=8)  # the profile and the run read the same Hub data set: load (and check) it once
def load_hub(source: DataSource):
    """A Hub data set's split through `load_dataset` (downloaded and cached by datasets, or streamed)."""
    from datasets import load_dataset
    from datasets.exceptions import DatasetNotFoundError, DatasetsError
    from huggingface_hub.constants import is_offline_mode

    name = source.path
    try:
        return load_dataset(name, name=source.subset or None, split=source.split, streaming=source.streaming)
    except ConnectionError:
        why = "offline mode is on, HF_HUB_OFFLINE=1" if is_offline_mode() else "no network"
        raise UserError(
            f"data {name} is not a local path, so it is read as a Hugging Face Hub data set id, and the Hub is "
            f"unreachable ({why}) with no copy in the datasets cache; download it where there is network "
            "(load_dataset(...).save_to_disk(DIR)) and pass --data DIR"
        ) from None
    except DatasetNotFoundError:
        raise UserError(
            f"data {name}: no such data set on the Hugging Face Hub (or it is private or gated: log in with "
            "`hf auth login`) and no such local path"
        ) from None
    except ValueError as exc:
        msg = _first_line(exc)
        key = "subset" if "onfig" in msg else "split" if "split" in msg.lower() else None
        where = f"data.{key}: " if key else ""
        raise UserError(f"{where}cannot load {source.label} from the Hub ({msg})") from None
    except (OSError, DatasetsError) as exc:
        raise UserError(f"cannot load {source.label} from the Hub ({_first_line(exc)})") from None


def content_id(source: DataSource) -> str | None:
    """What the source holds, for the tokenization cache (None for a stream, which is not cached).

    Files: a hash of their bytes (and, in a directory, their names). A saved or Hub data set: the fingerprint datasets
    keeps for it, which changes with its content (for the Hub, with the revision downloaded).
    """
    if source.streaming:
        return None
    if source.kind == "hub":
        return "hub:" + load_hub(source)._fingerprint
    if source.kind == "saved":
        return "saved:" + load_saved(source)._fingerprint
    h = hashlib.sha256()
    for name in source.files:
        if source.kind == "dir":
            h.update(os.path.relpath(name, source.path).encode() + b"\0")
        with open_binary(name, decompress=False) as handle:  # the bytes on disk: compressed ones hash faster
            try:
                for block in iter(lambda handle=handle: handle.read(1 << 20), b""):
                    h.update(block)
            except OSError as exc:
                raise _read_error(name, exc) from None
    return "files:" + h.hexdigest()


# ---- records: rows renamed (data.columns), validated and converted (formats.convert) ---------------------------


def rename(row: dict[str, Any], columns: dict[str, str], key: str) -> dict[str, Any]:
    """The row with the data set's column names replaced by ours (`columns`: ours → theirs)."""
    if not columns:
        return row
    out = {k: v for k, v in row.items() if k not in columns.values() and k not in columns}
    for ours, theirs in columns.items():
        if theirs in row:
            out[ours] = row[theirs]
        elif ours not in OPTIONAL_FIELDS:
            raise BadLine(f"missing field '{theirs}' ({key}.columns.{ours})")
    return out


def log_skipped(line: str) -> None:
    """Warn about a skipped row once per command: a stream is read again on each pass (and its head once more
    before training), and each pass meets the same bad rows."""
    from lowmem_ft.console import first_time

    if first_time("skipped", line):
        log.warning("skipped %s", line)


class RecordReader:
    """The rows of one source as TRL records of one format; a bad row stops the run, or is skipped and listed."""

    def __init__(self, source: DataSource, skip_bad_lines: bool = False, fmt: str | None = None, log_skips=False):
        self.source = source
        self.skip_bad_lines = skip_bad_lines
        self.format = fmt or (None if source.format == "auto" else source.format)
        self.log_skips = log_skips  # a stream logs each skip as it happens (there is no list to report later)
        self.skipped: list[str] = []
        self.keys: dict[str, None] = {}  # every column seen, in order of appearance
        self.turn_keys: dict[str, None] = {}  # chat turns' keys no format reads, as messages[].KEY

    def __iter__(self) -> Iterator[dict[str, Any]]:
        columns, checked = self.source.column_map, False
        for where, row in iter_rows(self.source):
            try:
                if isinstance(row, BadLine):
                    raise row
                if not checked:
                    self._check_columns(row, where)
                    checked = True
                self.keys.update(dict.fromkeys(row))
                record = rename(row, columns, self.source.key)
                if self.format is None:
                    self.format = self._detect(record, where)
                if self.format in PREFERENCE_FORMATS:  # chosen by training.method, never detected
                    yield preference.convert(record, self.format, self.turn_keys)
                elif self.format == "prompts":  # GRPO's prompts (training.method grpo), every other column kept
                    yield prompts.convert(record)
                else:
                    yield convert(record, self.format, self.turn_keys)
            except BadLine as exc:
                if not self.skip_bad_lines:
                    raise UserError(f"{where}: {exc} (or pass --skip-bad-lines)") from None
                self.skipped.append(f"{where}: {exc}")
                if self.log_skips:
                    log_skipped(f"{where}: {exc}")

    def _check_columns(self, row: dict[str, Any], where: str) -> None:
        missing = [(ours, theirs) for ours, theirs in self.source.columns if theirs not in row]
        if missing:
            ours, theirs = missing[0]
            raise UserError(
                f"{self.source.key}.columns maps {ours} to '{theirs}', which {where} does not have; its columns are "
                f"{', '.join(row) or '(none)'}"
            )

    def _detect(self, record: dict[str, Any], where: str) -> str:
        try:
            return detect_format(record, self.source.key)
        except BadLine as exc:
            if self.skip_bad_lines:
                raise
            if ".columns" in str(exc):  # the message already says which columns to map
                raise UserError(f"{where}: {exc}") from None
            raise UserError(
                f"{where}: {exc}; or map the data set's columns onto ours with {self.source.key}.columns, "
                "e.g. {prompt: question, completion: answer}"
            ) from None

    def unused_columns(self) -> list[str]:
        """Columns seen that the format does not read (after data.columns), in order of appearance, then the chat
        turns' keys that are not read (`messages[].name`)."""
        columns = self.source.column_map
        used = {columns.get(f, f) for f in FORMAT_FIELDS.get(self.format or "", ())}
        return [k for k in self.keys if k not in used] + list(self.turn_keys)


def read_records(source: DataSource, skip_bad_lines: bool = False) -> LoadedData:
    """Every record of `source`, validated and converted for TRL (a bad one stops the run unless skipped)."""
    reader = RecordReader(source, skip_bad_lines)
    records = list(reader)
    if not records:
        unit = "lines" if source.kind == "jsonl" else "rows"
        why = f" ({len(reader.skipped)} bad {unit} skipped)" if reader.skipped else " (no rows, only blank lines)"
        raise UserError(f"{source.label}: no usable records{why}; it must hold training samples")
    return LoadedData(records, reader.format, reader.skipped, reader.unused_columns())


def record_stream(source: DataSource, fmt: str, skip_bad_lines: bool = False, row=None):
    """The source's records as an IterableDataset, read lazily (a bad record stops training unless skipped);
    `row` turns each record into the row the tokenizer reads (chat: one JSON column)."""
    from datasets import IterableDataset

    def records():
        reader = RecordReader(source, skip_bad_lines, fmt=fmt, log_skips=True)
        yield from (map(row, reader) if row is not None else reader)

    return IterableDataset.from_generator(records)


def load_file(path: str | Path, fmt: str = "auto", skip_bad_lines: bool = False) -> LoadedData:
    """Read and validate one data file (JSONL, or any kind `lowmem_ft.data.sources` resolves); every record is
    converted for TRL or the run stops at the first bad line."""
    return read_records(resolve_source(str(path), fmt=fmt), skip_bad_lines)
