"""From the recipe's data keys to the datasets `SFTTrainer` trains on, with the account of what was done to them.

sources, checked (sources) → read + validate each (readers, formats) → tokenize, cached (tokenize) → mix by weight
(mix) → eval split → fit into the token budget (budget) → TRL. The eval split is cut from the tokenized data before
the budget, so train and eval are fitted the same way. The summary is what `run.json` keeps under "data" and
`data_report.json` keeps in full.

A stream (`data.streaming`) takes the same steps lazily, as training reads it: its length profile and budget
account come from its first samples (`tokenize.STREAM_HEAD`, said so in the summary), it is shuffled through a
seeded buffer (the trainer cannot sample an IterableDataset), and evaluation data is read whole.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowmem_ft.data import tokenize
from lowmem_ft.data.budget import apply_budget, check_budget, describe, fit_stream
from lowmem_ft.data.formats import CHAT_FORMATS
from lowmem_ft.data.mix import mix_datasets, mix_record, mix_streams
from lowmem_ft.data.profile import LengthProfile, lengths_of, profile_of
from lowmem_ft.data.readers import log_skipped
from lowmem_ft.data.sources import DataSource, check_source, eval_source_of, sources_of
from lowmem_ft.data.tokenize import Tokenized, tokenize_source
from lowmem_ft.errors import UserError
from lowmem_ft.recipe.schema import METHOD_INPUTS

log = logging.getLogger(__name__)

# Attention implementations that keep packed samples apart when given reset position_ids and no attention mask
# (TRL's padding-free collator output). transformers 5.24 masking_utils.py: `_preprocess_mask_arguments` calls
# `find_packed_sequence_indices(position_ids)` when attention_mask is None and builds a block-diagonal causal mask
# for sdpa / eager / flex_attention; flash_attention_2/3 take the `cu_seq_lens_*` the collator computes (varlen
# kernels). Anything else (hub kernels, remote modeling code) is not known to, so packing falls back.
# The detection only runs without a KV cache: TRL's SFTTrainer.compute_loss passes use_cache=False; a forward with
# the model's default use_cache=True would let packed samples attend to each other (tests/data/test_prepare.py).
PACKING_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")


def packing_support(attn_implementation: str, model_module: str | None = None) -> tuple[bool, str]:
    """(packing keeps samples apart?, why) for an attention implementation and the model class's module."""
    if model_module is not None and not model_module.startswith("transformers."):
        return False, f"the model's own code ({model_module}) is not known to honour reset position ids"
    if attn_implementation not in PACKING_ATTENTION:
        return False, f"attention {attn_implementation!r} is not known to honour reset position ids"
    if attn_implementation.startswith("flash_attention"):
        return True, "flash-attention varlen kernels over cu_seq_lens (no padding, no mask)"
    return True, f"{attn_implementation} with a block-diagonal causal mask built from reset position ids"


STREAM_SHUFFLE_BUFFER = 1000  # samples; datasets' default for IterableDataset.shuffle


def _loss_on(formats: list[str], train_on_prompt: bool) -> str:
    def one(fmt: str) -> str:
        if train_on_prompt or fmt == "text":
            return "all tokens"
        if fmt == "chat_prompt_completion":
            return "completion turns"
        return "assistant turns" if fmt in CHAT_FORMATS else "completion"

    return ", ".join(dict.fromkeys(one(f) for f in formats))


@dataclass
class TrainingData:
    """The training sources, tokenized, and (for data.mix) mixed: what the profile and the run both read."""

    parts: list[Tokenized]  # one per source, in recipe order
    dataset: Any  # Dataset; an IterableDataset when streaming
    sampled: Any  # the Dataset the length profile reads: `dataset` itself, or a stream's first samples
    mix: dict[str, Any] | None = None
    streaming: bool = False

    @property
    def formats(self) -> list[str]:
        return list(dict.fromkeys(p.format for p in self.parts))

    @property
    def format(self) -> str:
        return self.formats[0] if len(self.formats) == 1 else "mixed: " + ", ".join(self.formats)

    @property
    def label(self) -> str:
        return self.parts[0].source.label if len(self.parts) == 1 else "the mix"

    def profile(self) -> LengthProfile:
        return LengthProfile.from_lengths(lengths_of(self.sampled), sampled=len(self.sampled) if self.streaming else 0)


def load_training_data(recipe, tokenizer, sources: list[DataSource] | None = None) -> TrainingData:
    """Every training source of `recipe` read, validated and tokenized (cached), mixed by weight for data.mix."""
    d = recipe.data
    sources = sources or sources_of(recipe)
    opts = {"train_on_prompt": d.train_on_prompt, "skip_bad_lines": d.skip_bad_lines}
    parts = [tokenize_source(source, tokenizer, **opts) for source in sources]
    if not d.mix:
        return TrainingData(parts, parts[0].dataset, parts[0].sampled, None, d.streaming)
    weights, seed = [s.weight for s in sources], recipe.training.seed
    datasets = [p.dataset for p in parts]
    if d.streaming:
        dataset, sampled, counts = mix_streams(datasets, weights, d.mix_strategy, seed, tokenize.STREAM_HEAD)
        sizes = [None] * len(parts)
    else:
        dataset, counts = mix_datasets(datasets, weights, d.mix_strategy, seed)
        sampled, sizes = dataset, [len(ds) for ds in datasets]
    labels = [s.label for s in sources]
    mix = mix_record(labels, sizes, weights, counts, d.mix_strategy, seed, d.streaming)
    log.info("data.mix: %s", ", ".join(f"{r['source']} {r['samples']}" for r in mix["sources"]))
    return TrainingData(parts, dataset, sampled, mix, d.streaming)


def held_out_split(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, eval) indices: a seeded random `fraction` of n samples held out; the same seed, the same split.

    Random rather than the file's tail, since data files are often sorted (by source, length or date); both
    parts keep the file's order.
    """
    n_eval = max(1, int(n * fraction))
    if n_eval >= n:
        raise UserError(
            f"data.eval_fraction={fraction:g} of {n} records leaves nothing to train on; lower it or pass --eval-data FILE"
        )
    held = set(random.Random(seed).sample(range(n), n_eval))
    return [i for i in range(n) if i not in held], sorted(held)


def prepare_datasets(recipe, tokenizer) -> tuple[Any, Any, dict[str, Any]]:
    """Train dataset, eval dataset (or None) and the data summary for the run directory."""
    d, max_len = recipe.data, recipe.memory.max_seq_len
    check_budget(max_len, d.truncate, d.overlap)
    data = load_training_data(recipe, tokenizer, check_source(recipe))
    _log_parts(data)
    profile = data.profile()
    train_ds, eval_ds, eval_part, eval_source = _split_eval(recipe, data, tokenizer)
    fmt = next((f for f in data.formats if f != "text"), "text")  # chunking is for plain text only
    if data.streaming:
        _, report = apply_budget(data.sampled, max_len, d.truncate, d.overlap, fmt)
        report["counted_on"] = f"the first {len(data.sampled)} samples of the stream"
        train_ds = fit_stream(train_ds, max_len, d.truncate, d.overlap, fmt)
        train_ds = train_ds.shuffle(seed=recipe.training.seed, buffer_size=STREAM_SHUFFLE_BUFFER)
    else:
        train_ds, report = apply_budget(train_ds, max_len, d.truncate, d.overlap, fmt)
    log.info("data%s: %s", " (first samples of the stream)" if data.streaming else "", describe(report))
    eval_report = None
    if eval_ds is not None:
        eval_ds, eval_report = apply_budget(eval_ds, max_len, d.truncate, d.overlap, fmt)
    summary = _summary(recipe, data, profile, report, eval_part, eval_report)
    summary["eval_source"] = eval_source
    return train_ds, eval_ds, summary


def pack(dataset, max_len: int):
    """Pack fitted samples into rows of at most `max_len` tokens, as TRL's SFTTrainer would (its `pack_dataset`,
    best-fit decreasing: sample boundaries kept, a `seq_lengths` column for the padding-free collator). Done here
    because the trainer is told the data is prepared (`skip_prepare_dataset`), which skips TRL's packing too."""
    from trl import pack_dataset

    kwargs = {"desc": f"Packing samples into rows of {max_len} tokens"} if hasattr(dataset, "num_rows") else {}
    return pack_dataset(dataset.select_columns(["input_ids", "labels"]), max_len, "bfd", kwargs)


def _log_parts(data: TrainingData) -> None:
    for part in data.parts:
        for line in part.skipped:
            log_skipped(line)
        if part.unused_columns:
            log.info("%s: columns not used: %s", part.source.label, ", ".join(part.unused_columns))
        if part.source.ignored:
            log.info("%s: not data files, not read: %s", part.source.label, ", ".join(part.source.ignored))


def _split_eval(recipe, data: TrainingData, tokenizer) -> tuple[Any, Any, Tokenized | None, str | None]:
    """(train data, eval data or None, the tokenized eval source, where eval data came from), before the budget."""
    d = recipe.data
    source = eval_source_of(recipe)
    if source is not None:
        part = tokenize_source(source, tokenizer, train_on_prompt=d.train_on_prompt, skip_bad_lines=d.skip_bad_lines)
        return data.dataset, part.dataset, part, source.label
    if d.eval_fraction > 0:
        seed = recipe.training.seed
        keep, held = held_out_split(len(data.dataset), d.eval_fraction, seed)
        where = f"held out {d.eval_fraction:g} of {data.label} (seed {seed})"
        return data.dataset.select(keep), data.dataset.select(held), None, where
    return data.dataset, None, None, None


def _summary(recipe, data: TrainingData, profile, report, eval_part, eval_report) -> dict[str, Any]:
    d = recipe.data
    return {
        "path": d.path,
        "sources": [_part_summary(p, data.streaming) for p in data.parts],
        "mix": data.mix,
        "streaming": (
            {"profile_and_budget_from": len(data.sampled), "shuffle_buffer": STREAM_SHUFFLE_BUFFER}
            if data.streaming
            else False
        ),
        "format": data.format,
        "chat_template": next((p.chat_template for p in data.parts if p.chat_template), None),
        "records": None if data.streaming else len(data.dataset),
        "skipped_lines": [line for p in data.parts for line in p.skipped],
        "eval_skipped_lines": eval_part.skipped if eval_part else [],
        "train_records": None if data.streaming else report["samples_in"],
        "eval_records": eval_report["samples_in"] if eval_report else 0,
        "loss_on": _loss_on(data.formats, d.train_on_prompt),
        "tokenized_from_cache": all(p.from_cache for p in data.parts),
        "profile": profile.to_dict(),
        "budget": report,
        "eval_budget": eval_report,
    }


def _part_summary(part: Tokenized, streaming: bool) -> dict[str, Any]:
    return {
        **part.source.to_dict(),
        "format": part.format,
        "records": None if streaming else len(part.dataset),
        "skipped": len(part.skipped),
        "unused_columns": part.unused_columns,
        "tokenized_from_cache": part.from_cache,
    }


def length_profile(
    recipe=None,
    *,
    path: str | Path | None = None,
    tokenizer=None,
    fmt: str | None = None,
    train_on_prompt: bool | None = None,
    skip_bad_lines: bool | None = None,
) -> LengthProfile:
    """The length profile of the recipe's training data (or of `path`), tokenized as training tokenizes it.

    Either `length_profile(recipe)` (its data sources, mixed as data.mix mixes them, the model's tokenizer, the
    recipe's data options) or `length_profile(path=..., tokenizer=...)`; explicit arguments override the recipe's.
    A stream's profile is of its first samples (`sampled`).
    """
    from dataclasses import replace

    from lowmem_ft.data.tokenize import load_tokenizer, tokenize_file

    if recipe is None:
        if path is None or tokenizer is None:
            raise TypeError("length_profile needs a recipe, or path= and tokenizer=")
        tok = tokenize_file(
            path,
            tokenizer,
            fmt=fmt or "auto",
            train_on_prompt=bool(train_on_prompt),
            skip_bad_lines=bool(skip_bad_lines),
        )
        return profile_of(tok)
    given = {
        "path": path and str(path),
        "format": fmt,
        "train_on_prompt": train_on_prompt,
        "skip_bad_lines": skip_bad_lines,
    }
    data = replace(recipe.data, **{k: v for k, v in given.items() if v is not None})
    m = recipe.model
    tokenizer = tokenizer or load_tokenizer(m.name_or_path, m.trust_remote_code, recipe.data.chat_template or None)
    reads = METHOD_INPUTS[recipe.training.method].data_format
    if reads == "prompts":
        return prompt_profile(replace(recipe, data=data), tokenizer)
    if reads is not None:  # pairs or KTO's samples
        return preference_profile(replace(recipe, data=data), tokenizer)
    return load_training_data(replace(recipe, data=data), tokenizer).profile()


def prompt_profile(recipe, tokenizer) -> LengthProfile:
    """The length profile of GRPO's prompts, tokenized as TRL tokenizes them (`lowmem_ft.data.prompts`), before
    grpo.max_prompt_length cuts any: the planner's P is the longest within that limit."""
    from lowmem_ft.data.prompts import prompt_ids
    from lowmem_ft.data.readers import RecordReader

    source = check_source(recipe)[0]
    records = list(RecordReader(source, recipe.data.skip_bad_lines, fmt="prompts"))
    if not records:
        raise UserError(f"{source.label}: no usable prompts")
    return LengthProfile.from_lengths([len(prompt_ids(tokenizer, r["prompt"])) for r in records])


def preference_profile(recipe, tokenizer) -> LengthProfile:
    """The length profile of preference data: each pair's longer row (prompt + the longer answer), tokenized as the
    run tokenizes it (`lowmem_ft.data.preference`), before any fitting — what max_seq_len is sized from."""
    from lowmem_ft.data.preference import PairFit, tokenize_pairs
    from lowmem_ft.data.readers import RecordReader

    fmt = METHOD_INPUTS[recipe.training.method].data_format
    source = check_source(recipe)[0]
    records = list(RecordReader(source, recipe.data.skip_bad_lines, fmt=fmt))
    if not records:
        raise UserError(f"{source.label}: no usable {fmt} records")
    ds, _, _ = tokenize_pairs(records, fmt, tokenizer, PairFit(2**30), where=source.label,
                              skip_bad=recipe.data.skip_bad_lines)  # fmt: skip
    answers = [k for k in ("chosen_ids", "rejected_ids", "completion_ids") if k in ds.column_names]
    lengths = [len(row["prompt_ids"]) + max(len(row[k]) for k in answers) for row in ds]
    return LengthProfile.from_lengths(lengths)
