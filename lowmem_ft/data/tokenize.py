"""Tokenizing TRL records into `input_ids` + `labels`, batched through `datasets`, cached by content.

We tokenize ourselves (rather than letting `SFTTrainer` do it) for three reasons: the length profile and the
token budget must see exactly the tokens training sees; TRL has no `drop` / `chunk` truncation and drops
fully-masked samples without saying so; and TRL maps one example at a time, while a batched map hands whole
batches to the fast tokenizer. The output is what TRL's `_prepare_dataset` accepts as already processed
(`input_ids` + `labels`, see trl/trainer/sft_trainer.py): it skips its own tokenization and label building, and
its collator uses the labels as they are.

The masking follows TRL: text → loss on every token (EOS appended); prompt/completion → the completion starts
where the tokenized prompt and prompt+completion diverge (`trl.data_utils.common_prefix_length`), EOS appended to
the completion; chat → the chat template (`data.chat_template`, else the tokenizer's, else ChatML) with the loss on
what the assistant says, found by `lowmem_ft.data.chat` for any template (its generation markers, TRL's training
version, or turn by turn) — less the turns of weight 0 and, in TRL's conversational prompt/completion, the prompt's.
`train_on_prompt` keeps every label.

The cache key is a hash of what the source holds (`readers.content_id`: the file bytes, a saved or Hub data set's
fingerprint), how it is read (kind, split, subset, columns, format), the tokenizer (its serialized
vocabulary/normalizer/post-processor and chat template) and the options that change tokens or labels, so a second
run on the same data and tokenizer loads the tokenized dataset from disk instead of tokenizing again. An entry is
written under a temporary name and renamed when whole, and its meta.json holds a digest of its dataset files, checked
before they are opened: a file cut short or with changed bytes (a crash, a bad disk) is tokenized again, never read —
pyarrow memory-maps the file and trusts its offsets, so a damaged one can crash the process or load wrong ids. A stream
(`data.streaming`) is tokenized lazily as training reads it and is not cached; its first `STREAM_HEAD` samples are
tokenized up front, for the format and the length profile.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowmem_ft.cache import cache_root
from lowmem_ft.console import first_time
from lowmem_ft.data.chat import (
    ChatTemplate,
    Renderer,
    SampleError,
    chat_template_for,
    encode_with_offsets,
    labels_for,
    samples,
    set_template,
)
from lowmem_ft.data.formats import CHAT_FORMATS
from lowmem_ft.data.readers import RecordReader, content_id, read_records, record_stream
from lowmem_ft.data.sources import DataSource, resolve_source
from lowmem_ft.errors import UserError

log = logging.getLogger(__name__)

# bump when the tokenization below changes what it produces (3: keyed by source; chat masking for any template;
# 4: tool-call arguments given as JSON strings rendered as objects, dropped tool calls refused, an opening assistant
# turn cut after its generation prompt; 5: per-turn weight, reasoning and content parts reach the template, TRL's
# conversational prompt/completion, alpaca system/history and a chat record's system column read; a template's
# `strftime_now` renders chat.TEMPLATE_DATE, not the day; 6: dropped messages found by probes, so data cached with a
# tool call dropped unseen is checked again; 7: entries carry the digest of their files, checked before loading)
CACHE_VERSION = 7
BATCH_SIZE = 1000
STREAM_HEAD = 1000  # samples of a stream tokenized up front: its format and its length profile


@dataclass
class Tokenized:
    """A tokenized data source: `dataset` has `input_ids` and `labels` (-100 where no loss), untruncated."""

    dataset: Any  # datasets.Dataset; an IterableDataset for a stream
    format: str
    skipped: list[str] = field(default_factory=list)
    chat_template: str | None = None  # where the template came from and how assistant tokens were found
    cache_dir: Path | None = None
    from_cache: bool = False
    source: DataSource | None = None
    unused_columns: list[str] = field(default_factory=list)  # the data's columns no format field reads
    head: Any = None  # a stream's first STREAM_HEAD samples, tokenized (a Dataset); None when not a stream
    split_conversations: int = 0  # chat: conversations trained as one sample per assistant turn

    @property
    def sampled(self) -> Any:
        """What the length profile is computed from: all of the data, or a stream's head."""
        return self.dataset if self.head is None else self.head


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False, chat_template: str | None = None):
    """The model's tokenizer (pad token = EOS when it has none, as TRL does), with `data.chat_template` applied."""
    from transformers import AutoTokenizer

    from lowmem_ft import native

    conversion = native.checkpoint_conversion(name_or_path)
    try:
        if conversion is not None:  # rebuilt from the checkpoint's files: its tokenizer code is never run
            tokenizer = native.load_tokenizer(name_or_path, conversion)
        else:
            with native.remote_code_errors(name_or_path, trust_remote_code, "tokenizer code"):
                tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise UserError(
            f"cannot load the tokenizer of {name_or_path!r} ({str(exc).splitlines()[0]}); pass --model a local "
            "model directory or a Hub id that is reachable"
        ) from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if chat_template:
        set_template(tokenizer, chat_template)
    return tokenizer


def tokenizer_fingerprint(tokenizer) -> str:
    """A stable hash of everything in the tokenizer that changes token ids."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:  # slow tokenizer: datasets' pickle-based hasher
        from datasets.fingerprint import Hasher

        h.update(Hasher.hash(tokenizer).encode())
    template = tokenizer.chat_template
    h.update(json.dumps([type(tokenizer).__name__, template, tokenizer.eos_token, tokenizer.bos_token]).encode())
    return h.hexdigest()


def cache_key(source: DataSource, content: str, tokenizer, train_on_prompt: bool, skip_bad_lines: bool) -> str:
    """Key of a tokenized source: its content id, how it is read, the tokenizer and the options."""
    how = [source.kind, source.split, source.subset, list(source.columns), source.format]
    h = hashlib.sha256(content.encode())
    h.update(
        json.dumps([CACHE_VERSION, how, train_on_prompt, skip_bad_lines, tokenizer_fingerprint(tokenizer)]).encode()
    )
    return h.hexdigest()[:24]


# ---- batched tokenizers, one per record shape; each returns {"input_ids", "labels"} lists -------------------


def _text_batch(batch: dict, tokenizer, eos: str) -> dict:
    texts = [t if t.endswith(eos) else t + eos for t in batch["text"]]
    ids = tokenizer(texts)["input_ids"]
    return {"input_ids": ids, "labels": [list(x) for x in ids]}


def _prompt_completion_batch(batch: dict, tokenizer, eos: str, train_on_prompt: bool) -> dict:
    from trl.data_utils import common_prefix_length

    completions = [c if c.endswith(eos) else c + eos for c in batch["completion"]]
    prompt_ids = tokenizer(batch["prompt"])["input_ids"]
    full_ids = tokenizer([p + c for p, c in zip(batch["prompt"], completions, strict=True)])["input_ids"]
    labels = []
    for p, ids in zip(prompt_ids, full_ids, strict=True):
        n = 0 if train_on_prompt else common_prefix_length(p, ids)
        labels.append([-100] * n + ids[n:])
    return {"input_ids": full_ids, "labels": labels}


def _chat_batch(batch: dict, indices: list[int], tokenizer, template: ChatTemplate, where: str) -> dict:
    render = Renderer(tokenizer, template)
    texts, spans, sources = [], [], []
    for index, raw in zip(indices, batch["conversation"], strict=True):
        try:
            for text, sample_spans in samples(json.loads(raw), render):
                texts.append(text)
                spans.append(sample_spans)
                sources.append(index)
        except SampleError as exc:
            fix = exc.fix or "fix the sample or set data.chat_template to a template that renders it"
            if exc.masking:
                fix = "set data.chat_template to a template that renders it, or data.train_on_prompt=true"
            raise UserError(f"{where}: sample {index + 1}: {exc}; {fix}") from None
    enc = encode_with_offsets(tokenizer, texts)
    labels = [
        labels_for(ids, offsets, text, sample_spans, template.masking)
        for ids, offsets, text, sample_spans in zip(enc["input_ids"], enc["offset_mapping"], texts, spans, strict=True)
    ]
    return {"input_ids": enc["input_ids"], "labels": labels, "source": sources}


def _batch_fn(fmt: str, tokenizer, train_on_prompt: bool, template: ChatTemplate | None, where: str):
    """The batched tokenizer for a record shape and its keyword arguments. Chat rows are `conversation` JSON strings
    (see `_rows`) and the map passes their indices, which error messages and split conversations name."""
    eos = tokenizer.eos_token or ""
    if fmt in CHAT_FORMATS:
        return _chat_batch, {"tokenizer": tokenizer, "template": template, "where": where}
    if fmt == "text":
        return _text_batch, {"tokenizer": tokenizer, "eos": eos}
    if fmt == "prompt_completion":
        return _prompt_completion_batch, {"tokenizer": tokenizer, "eos": eos, "train_on_prompt": train_on_prompt}
    raise ValueError(f"unknown format {fmt!r}")


def chat_row(record: dict) -> dict:
    """A chat record as the row `_chat_batch` reads: a JSON string, not nested columns — Arrow would unify
    tool-call arguments across rows (adding None keys)."""
    return {"conversation": json.dumps(record)}


def tokenize_records(
    records: list[dict],
    fmt: str,
    tokenizer,
    train_on_prompt: bool,
    template: ChatTemplate | None = None,
    where: str = "data",
):
    """TRL records (one format) → `datasets.Dataset` of `input_ids` + `labels`, through a batched map.

    Chat records may become several rows (one per assistant turn, see `lowmem_ft.data.chat`); the dataset then has a
    `source` column with each row's record index. `where` names the data in error messages."""
    from datasets import Dataset

    chat = fmt in CHAT_FORMATS
    if chat and template is None:
        template = chat_template_for(tokenizer, train_on_prompt, set_template(tokenizer, None))
    ds = Dataset.from_list([chat_row(r) for r in records] if chat else records)
    fn, kwargs = _batch_fn(fmt, tokenizer, train_on_prompt, template, where)
    ds = ds.map(
        fn,
        batched=True,
        batch_size=BATCH_SIZE,
        with_indices=chat,
        fn_kwargs=kwargs,
        remove_columns=ds.column_names,
        load_from_cache_file=False,  # our own cache below is keyed by content; datasets' is keyed by arrow files
        desc=f"Tokenizing {fmt}",
    )
    if "source" in ds.column_names and len(ds) == len(records):
        ds = ds.remove_columns("source")  # one row per record: nothing to say
    return ds


def _split(ds) -> tuple[Any, int]:
    """(dataset without the `source` column, conversations trained as several samples)."""
    if "source" not in ds.column_names:
        return ds, 0
    from collections import Counter

    rows = Counter(ds["source"])
    return ds.remove_columns("source"), sum(1 for n in rows.values() if n > 1)


def _template(fmt: str, tokenizer, train_on_prompt: bool) -> ChatTemplate | None:
    """How chat data is rendered and masked with this tokenizer (its `data.chat_template` is already set), or None."""
    if fmt not in CHAT_FORMATS:
        return None
    return chat_template_for(tokenizer, train_on_prompt, set_template(tokenizer, None))


def tokenize_file(
    path: str | Path,
    tokenizer,
    *,
    fmt: str = "auto",
    train_on_prompt: bool = False,
    skip_bad_lines: bool = False,
    use_cache: bool = True,
) -> Tokenized:
    """Read, validate and tokenize one data file (or directory, saved or Hub data set), or load it from the cache."""
    source = resolve_source(str(path), fmt=fmt)
    return tokenize_source(
        source, tokenizer, train_on_prompt=train_on_prompt, skip_bad_lines=skip_bad_lines, use_cache=use_cache
    )


def tokenize_source(
    source: DataSource, tokenizer, *, train_on_prompt: bool = False, skip_bad_lines: bool = False, use_cache=True
) -> Tokenized:
    """Read, validate and tokenize one source, or load it from the content-keyed cache; a stream is tokenized lazily."""
    from datasets import load_from_disk

    if source.streaming:
        return tokenize_stream(source, tokenizer, train_on_prompt=train_on_prompt, skip_bad_lines=skip_bad_lines)
    key = cache_key(source, content_id(source), tokenizer, train_on_prompt, skip_bad_lines)
    cache_dir = cache_root() / "tokenized" / key
    if use_cache and (cached := _from_cache(cache_dir, source, tokenizer)) is not None:
        return cached
    loaded = read_records(source, skip_bad_lines)
    template = _template(loaded.format, tokenizer, train_on_prompt)
    ds = tokenize_records(loaded.records, loaded.format, tokenizer, train_on_prompt, template, source.label)
    ds, split = _split(ds)
    chat = template.source if template is not None else None
    if split:
        chat = (
            f"{chat}; {split} conversations trained one sample per assistant turn (the template rewrites earlier turns)"
        )
        _say_split(source, split)
    result = Tokenized(ds, loaded.format, loaded.skipped, chat, None, False, source, loaded.unused_columns)
    result.split_conversations = split
    if not use_cache:
        return result
    tmp = cache_dir.with_name(cache_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    ds.save_to_disk(str(tmp / "dataset"))
    meta = {
        "source": source.to_dict(),
        "format": loaded.format,
        "skipped": loaded.skipped,
        "chat_template": chat,
        "unused_columns": loaded.unused_columns,
        "split": split,
    }
    meta["files"] = saved_files(tmp / "dataset")
    meta["digest"] = files_digest(tmp / "dataset", meta["files"])
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
    try:
        tmp.rename(cache_dir)  # atomic: a half-written entry is never read
    except OSError:  # another process (a rank of `train --gpus`) got there first with the same content
        shutil.rmtree(tmp, ignore_errors=True)
        result.cache_dir = cache_dir
        return result
    result.dataset, result.cache_dir = load_from_disk(str(cache_dir / "dataset")), cache_dir
    return result


def _say_split(source: DataSource, split: int) -> None:
    if split and first_time("split conversations", source.label):
        log.warning("%s: %d conversations trained as one sample per assistant turn: the chat template renders earlier "
                    "turns differently once later ones follow (e.g. it drops their reasoning)", source.label, split)  # fmt: skip


def saved_files(directory: Path) -> list[str]:
    """The files `save_to_disk` wrote, by name: later maps of the loaded dataset add their own cache-*.arrow files
    beside them, which are not part of the entry."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())


def files_digest(directory: Path, names: list[str]) -> str:
    """sha256 over the named files of a directory (names and bytes, in order): what a cache entry must still hold."""
    h = hashlib.sha256()
    for name in names:
        h.update(name.encode() + b"\0")
        with (directory / name).open("rb") as handle:
            for block in iter(lambda handle=handle: handle.read(1 << 20), b""):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()


class DamagedEntry(ValueError):
    """A cache entry whose files are not the ones written."""


def _from_cache(cache_dir: Path, source: DataSource, tokenizer) -> Tokenized | None:
    from datasets import load_from_disk

    meta_path = cache_dir / "meta.json"
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if not isinstance(meta, dict) or not isinstance(meta.get("digest"), str) or not meta.get("files"):
            raise DamagedEntry("meta.json is not the record written")
        if files_digest(cache_dir / "dataset", meta["files"]) != meta["digest"]:  # before opening: module docstring
            raise DamagedEntry("its files changed since they were written")
        ds = load_from_disk(str(cache_dir / "dataset"))
        if first_time("from cache", str(cache_dir)):  # the plan and the run each read it
            log.info("tokenized %s loaded from cache %s", source.label, cache_dir)
        if meta["format"] in CHAT_FORMATS:
            set_template(tokenizer, None)  # the saved tokenizer must carry the template trained with
        _say_split(source, meta.get("split", 0))  # said whether the data is tokenized now or was before
        return Tokenized(
            ds, meta["format"], meta["skipped"], meta["chat_template"], cache_dir, True, source, meta["unused_columns"],
            split_conversations=meta.get("split", 0),
        )  # fmt: skip
    except (OSError, KeyError, TypeError, ValueError) as exc:  # a broken cache entry is rebuilt, not fatal
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        log.warning("tokenization cache entry %s is damaged (%s); tokenizing again", cache_dir, why)
        shutil.rmtree(cache_dir, ignore_errors=True)
        return None


TOKEN_COLUMNS = ("input_ids", "labels")


def tokenize_stream(source: DataSource, tokenizer, *, train_on_prompt: bool = False, skip_bad_lines: bool = False):
    """A stream tokenized as training reads it (an IterableDataset), with its first STREAM_HEAD samples tokenized now.

    The head fixes the format (detected from the first record, as for a file) and gives the length profile.
    """
    import itertools

    from datasets import Features, List, Value

    reader = RecordReader(source, skip_bad_lines)
    head_records = list(itertools.islice(reader, STREAM_HEAD))
    if not head_records:
        why = f" ({len(reader.skipped)} bad rows skipped)" if reader.skipped else ""
        raise UserError(f"{source.label}: no usable records{why}; it must hold training samples")
    fmt = reader.format
    template = _template(fmt, tokenizer, train_on_prompt)
    head, _ = _split(tokenize_records(head_records, fmt, tokenizer, train_on_prompt, template, source.label))
    fn, kwargs = _batch_fn(fmt, tokenizer, train_on_prompt, template, source.label)
    features = Features({name: List(Value("int64")) for name in TOKEN_COLUMNS})
    chat = fmt in CHAT_FORMATS
    stream = (
        record_stream(source, fmt, skip_bad_lines, row=chat_row if chat else None)
        .map(fn, batched=True, batch_size=BATCH_SIZE, with_indices=chat, fn_kwargs=kwargs)
        .select_columns(list(TOKEN_COLUMNS))  # the record's own columns (text, messages, ...) are not trained on
        .cast(features)  # known features: a stream can be interleaved with others (data.mix)
    )
    where = template.source if template is not None else None
    return Tokenized(stream, fmt, reader.skipped, where, None, False, source, reader.unused_columns(), head=head)
