"""Preference training on TRL's own trainers, with the monitor, guard and OOM recovery SFT runs have.

DPO runs on TRL 1.16's `DPOTrainer` (`trl.trainer.dpo_trainer`: its loss variants are `loss_type`'s names), fed the
pairs `lowmem_ft.data.preference` has tokenized and fitted (`prompt_ids`, `chosen_ids`, `rejected_ids`), so TRL's
own tokenization is skipped (`_prepare_dataset`) and its collator never meets a pair longer than max_seq_len.

ORPO and SimPO run on TRL 1.16's experimental `ORPOTrainer` and `CPOTrainer` (`loss_type="simpo"`, no NLL term),
fed the columns their `tokenize_row` would make (`concatenated_columns`); KTO on `KTOTrainer`, fed `prompt_ids` /
`completion_ids` / `label` with TRL's KL completions (each batch's completions rotated by one).

The one idea: a DPO micro batch of B pairs is 2·B rows — TRL's `DataCollatorForPreference` stacks the B chosen
rows, then the B rejected rows — and the loss is a mean over pairs. So an OOM split cuts whole pairs: a piece of
pairs [a, b) is rows a..b and B+a..B+b, with its share (b − a) / B of the micro batch's loss, and the pieces' losses
add up to the micro batch's exactly (the DPO losses are per-pair terms averaged over the batch).

The reference: with a LoRA adapter, the base model with the adapter disabled — TRL copies a `PeftModel`'s adapter
into a frozen "ref" adapter (dpo_trainer.py `__init__`), which for a freshly initialised adapter (lora_B = 0) is the
base model itself, so the copy is removed and `use_adapter(model, None)` disables the adapter instead. An adapter
trained further (`adapter.name_or_path`) keeps the copy: its starting point is the reference. A full fine-tune needs
a reference copy or precomputed reference log-probabilities; `reference` says which (`lowmem_ft.memory.preference`
plans it).

TRL's `disable_dropout` (default True) sets every dropout to 0, LoRA's included: DPO's reference and policy passes
must agree on the same weights, and the memory model counts no dropout masks for these runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch
from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer

from lowmem_ft.train.methods import MethodData
from lowmem_ft.train.observe.progress import SFT_SHOWN
from lowmem_ft.train.resilience.trainer import MemorySafe

log = logging.getLogger(__name__)

PreferenceName = Literal["sft", "dpo", "orpo", "simpo", "kto"]  # training.method of a preference run
Reference = Literal["auto", "adapter_disabled", "copy", "precomputed"]
# TRL 1.16 dpo_config.py `loss_type`'s documented values
DPO_LOSS_TYPES = (
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot", "aot_unpaired",
    "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm",
)  # fmt: skip


@dataclass(frozen=True)
class PreferenceSettings:
    """What a preference run needs beyond an SFT recipe (declared as recipe keys under preference.)."""

    method: PreferenceName = "dpo"
    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    prompt_truncation: Literal["keep_end", "keep_start", "drop"] = "keep_end"
    max_prompt_len: int = 0
    reference: Reference = "auto"
    simpo_gamma: float = 0.5


def dpo_config(sft_args, settings: PreferenceSettings, *, precompute: bool = False) -> DPOConfig:
    """TRL's `DPOConfig` with every `TrainingArguments` field the SFT config decided (`lowmem_ft.train.args`), and the
    method's own: loss, beta, and the length the pairs are already fitted to."""
    from transformers import TrainingArguments

    shared = {f.name: getattr(sft_args, f.name) for f in fields(TrainingArguments) if f.init}
    # the SFT config's length grouping reads `input_ids` lengths a preference dataset does not have
    shared["train_sampling_strategy"] = "random"
    shared.pop("group_by_length", None)
    return DPOConfig(
        **shared,
        max_length=sft_args.max_length,
        truncation_mode="keep_start",  # a no-op: every pair fits already (lowmem_ft.data.preference.fit_pair)
        loss_type=[settings.loss_type],
        beta=settings.beta,
        label_smoothing=settings.label_smoothing,
        precompute_ref_log_probs=precompute,
        dataset_num_proc=None,
    )


def pair_pieces(inputs: dict[str, Any], pairs_per_piece: int) -> list[dict[str, Any]]:
    """A DPO micro batch (2·B rows: chosen, then rejected) cut into pieces of whole pairs, in order."""
    rows = inputs["input_ids"].shape[0]
    pairs = rows // 2
    if pairs_per_piece >= pairs:
        return [inputs]
    out = []
    for a in range(0, pairs, pairs_per_piece):
        b = min(pairs, a + pairs_per_piece)
        piece = {}
        for key, value in inputs.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                piece[key] = value
            elif value.shape[0] == rows:
                piece[key] = torch.cat([value[a:b], value[pairs + a : pairs + b]])
            elif value.shape[0] == pairs:  # precomputed reference log-probs: one per pair
                piece[key] = value[a:b]
            else:
                raise ValueError(f"cannot cut {key} of {value.shape[0]} rows into pairs of a {rows}-row batch")
        out.append(piece)
    return out


def pair_lengths(dataset) -> list[int]:
    """Each row's longest sequence: the prompt with its longer answer (what the collator pads to)."""
    columns = set(dataset.column_names)
    if "prompt_ids" in columns:
        answers = [c for c in ("chosen_ids", "rejected_ids", "completion_ids") if c in columns]
        return [len(r["prompt_ids"]) + max(len(r[c]) for c in answers) for r in dataset]
    return [max(len(r["chosen_input_ids"]), len(r["rejected_input_ids"])) for r in dataset]


class _HeaviestPairsFirst:
    """The SFT trainer's epoch order (seeded per epoch, the heaviest micro batch first: `lowmem_ft.train.resilience.order`)
    over pairs, weighed by their longer row; an order TRL fixes (KTO's sequential batches) is kept."""

    def _get_train_sampler(self, train_dataset=None):
        from torch.utils.data import RandomSampler

        from lowmem_ft.train.resilience.order import HeaviestFirstSampler

        sampler = super(MemorySafe, self)._get_train_sampler(train_dataset)  # TRL's, not MemorySafe's (input_ids)
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        if type(sampler) is not RandomSampler:
            return sampler
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        return HeaviestFirstSampler(pair_lengths(dataset), self.args.per_device_train_batch_size, seed)


class MemorySafeDPOTrainer(_HeaviestPairsFirst, MemorySafe, DPOTrainer):
    """`DPOTrainer` with `MemorySafe`'s monitor samples and OOM recovery; pieces are whole pairs."""

    def __init__(self, *args, keep_ref_adapter: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        _use_base_as_reference(self, keep_ref_adapter)

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        if "prompt_ids" in next(iter(dataset)):  # tokenized and fitted by lowmem_ft.data.preference
            return dataset
        return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

    def _pieces(self, inputs, num_items_in_batch):
        pairs = inputs["input_ids"].shape[0] // 2
        # the guard's sub-batch is in rows of the recipe's micro batch (pairs): the same number of pairs per piece
        per_piece = max(1, min(pairs, self.guard.sub_batch))
        parts = pair_pieces(inputs, per_piece)
        weights = [p["input_ids"].shape[0] / (2 * pairs) for p in parts] if len(parts) > 1 else [1.0]
        spans, start = [], 0
        for part in parts:  # where each piece's pairs lie (dropout is off in DPO: only the bookkeeping needs it)
            size = part["input_ids"].shape[0] // 2
            spans.append((start, size))
            start += size
        return parts, weights, (0, pairs, spans)


class MemorySafeKTOTrainer(_HeaviestPairsFirst, MemorySafe, KTOTrainer):
    """`KTOTrainer` with `MemorySafe`'s monitor samples and OOM recovery. KTO's KL term is estimated from the micro
    batch's own completions paired with other prompts of the same batch (TRL rotates them by one), so a piece of a
    batch would estimate it from fewer, different pairs: an OOM is not split here (the guard's later steps —
    checkpointing — still apply), and the batch's rows are never reordered (TRL requires sequential sampling)."""

    def __init__(self, *args, keep_ref_adapter: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        _use_base_as_reference(self, keep_ref_adapter)

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        if "prompt_ids" not in next(iter(dataset)):
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)
        if args.loss_type == "apo_zero_unpaired":  # TRL's one loss without the KL term (kto_trainer.py)
            return dataset

        def rotate(batch):  # TRL's KL completions: each batch's completions rotated by one
            batch["KL_completion_ids"] = [batch["completion_ids"][-1]] + batch["completion_ids"][:-1]
            return batch

        return dataset.map(rotate, batched=True, batch_size=args.per_device_train_batch_size)

    def _pieces(self, inputs, num_items_in_batch):
        rows = inputs["input_ids"].shape[0]
        return [inputs], [1.0], (0, rows, [(0, rows)])


def _use_base_as_reference(trainer, keep_ref_adapter: bool) -> None:
    """Drop TRL's frozen copy of a fresh adapter: the reference is then the base model with the adapter disabled."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    if not keep_ref_adapter and "ref" in getattr(model, "peft_config", {}):
        model.delete_adapter("ref")
        model.set_adapter("default")


def concatenated_columns(row: dict[str, list[int]]) -> dict[str, list[int]]:
    """A fitted pair (`prompt_ids`, `chosen_ids`, `rejected_ids`) as the columns TRL's experimental ORPO / CPO
    trainers' `tokenize_row` makes (orpo_trainer.py): each side's prompt + answer, its attention mask, its labels
    (-100 over the prompt), and the prompt alone."""
    prompt = row["prompt_ids"]
    out = {"prompt_input_ids": prompt, "prompt_attention_mask": [1] * len(prompt)}
    for side in ("chosen", "rejected"):
        ids = prompt + row[f"{side}_ids"]
        out[f"{side}_input_ids"] = ids
        out[f"{side}_attention_mask"] = [1] * len(ids)
        out[f"{side}_labels"] = [-100] * len(prompt) + row[f"{side}_ids"]
    return out


class _OddsRatioFamily(_HeaviestPairsFirst, MemorySafe):
    """What TRL's experimental ORPO and CPO (SimPO) trainers share here: pre-tokenized rows pass `tokenize_row`
    unchanged, metrics live in `_stored_metrics`, and a micro batch's tensors are per pair (B rows each of chosen,
    rejected, prompt), so pieces are consecutive pairs, each with its share of the pairs."""

    def tokenize_row(self, feature, model=None):
        if "chosen_input_ids" in feature:  # tokenized and fitted by lowmem_ft.data.preference
            return feature
        return super().tokenize_row(feature, model)

    def _pieces(self, inputs, num_items_in_batch):
        pairs = inputs["chosen_input_ids"].shape[0]
        step = max(1, min(pairs, self.guard.sub_batch))
        parts = [
            {k: v[a : a + step] if isinstance(v, torch.Tensor | list) and len(v) == pairs else v
             for k, v in inputs.items()}
            for a in range(0, pairs, step)
        ]  # fmt: skip
        sizes = [p["chosen_input_ids"].shape[0] for p in parts]
        weights = [n / pairs for n in sizes] if len(parts) > 1 else [1.0]
        spans = [(sum(sizes[:k]), n) for k, n in enumerate(sizes)]
        return parts, weights, (0, pairs, spans)

    def _metric_state(self):
        return {k: len(v) for k, v in self._stored_metrics["train"].items()}

    def _restore_metrics(self, saved) -> None:
        for key, values in self._stored_metrics["train"].items():
            del values[saved.get(key, 0) :]


def _experimental_config(config_class, sft_args, **method):
    from transformers import TrainingArguments

    shared = {f.name: getattr(sft_args, f.name) for f in fields(TrainingArguments) if f.init}
    shared["train_sampling_strategy"] = "random"
    shared["remove_unused_columns"] = False  # DPODataCollatorWithPadding reads the pair's columns
    return config_class(**shared, max_length=sft_args.max_length, **method)


def settings_of(recipe) -> PreferenceSettings:
    """The preference settings of a recipe: training.method and the preference section's keys."""
    given = recipe.preference
    values = {f.name: getattr(given, f.name) for f in fields(PreferenceSettings) if hasattr(given, f.name)}
    return PreferenceSettings(**{**values, "method": recipe.training.method})


def reference_for(recipe) -> str:
    """The reference a preference run uses (`lowmem_ft.memory.preference.reference_kind`)."""
    from lowmem_ft.memory.preference import reference_kind

    return reference_kind(recipe.training.method, recipe.adapter.kind, recipe.preference.reference)


def method_config(sft_args, recipe):
    """The TRL config of the recipe's method, from the SFT config `lowmem_ft.train.args` decided."""
    settings = settings_of(recipe)
    if settings.method == "dpo":
        return dpo_config(sft_args, settings, precompute=reference_for(recipe) == "precomputed")
    if settings.method == "orpo":
        from trl.experimental.orpo import ORPOConfig

        # ORPO's β is the odds-ratio weight λ (orpo_config.py: "the λ/alpha hyperparameter in the paper")
        return _experimental_config(ORPOConfig, sft_args, beta=settings.beta)
    if settings.method == "simpo":
        from trl.experimental.cpo import CPOConfig

        # SimPO = CPO with loss_type "simpo" and no NLL term (cpo_config.py); β 2.0 and γ/β 0.5 as the paper's base
        return _experimental_config(CPOConfig, sft_args, loss_type="simpo", cpo_alpha=0.0, beta=settings.beta,
                                    simpo_gamma=settings.simpo_gamma)  # fmt: skip
    if settings.method == "kto":
        from transformers import TrainingArguments

        shared = {f.name: getattr(sft_args, f.name) for f in fields(TrainingArguments) if f.init}
        shared["train_sampling_strategy"] = "sequential"  # TRL: the KL pairs are built within fixed batches
        return KTOConfig(**shared, max_length=sft_args.max_length, beta=settings.beta, dataset_num_proc=None,
                         precompute_ref_log_probs=reference_for(recipe) == "precomputed")  # fmt: skip
    raise NotImplementedError(f"training.method={settings.method} is not wired yet")


def prepare_data(recipe, tokenizer):
    """Train / eval datasets and the data summary of a preference run (`lowmem_ft.data.preference`)."""
    from lowmem_ft.data.preference import PairFit

    settings = settings_of(recipe)
    fit = PairFit(recipe.memory.max_seq_len, settings.prompt_truncation, settings.max_prompt_len)
    fmt = "kto" if settings.method == "kto" else "preference"
    train_ds, eval_ds, summary = prepare_preference_datasets(recipe, tokenizer, fmt, fit)
    if settings.method in ("orpo", "simpo"):  # TRL's experimental trainers read each side whole
        train_ds = train_ds.map(concatenated_columns, remove_columns=train_ds.column_names)
        if eval_ds is not None:
            eval_ds = eval_ds.map(concatenated_columns, remove_columns=eval_ds.column_names)
    return train_ds, eval_ds, summary


def trainer_for(recipe) -> tuple[type, dict[str, Any]]:
    """The trainer class of the recipe's method and its own keyword arguments."""
    settings = settings_of(recipe)
    if settings.method == "dpo":
        # an adapter trained further keeps TRL's frozen copy of it as the reference (see the module docstring)
        return MemorySafeDPOTrainer, {"keep_ref_adapter": bool(recipe.adapter.name_or_path)}
    if settings.method == "orpo":
        from trl.experimental.orpo import ORPOTrainer

        return type("MemorySafeORPOTrainer", (_OddsRatioFamily, ORPOTrainer), {}), {}
    if settings.method == "simpo":
        from trl.experimental.cpo import CPOTrainer

        return type("MemorySafeSimPOTrainer", (_OddsRatioFamily, CPOTrainer), {}), {}
    if settings.method == "kto":
        return MemorySafeKTOTrainer, {"keep_ref_adapter": bool(recipe.adapter.name_or_path)}
    raise NotImplementedError(f"training.method={settings.method} is not wired yet")


class Preference:
    """DPO, ORPO, SimPO or KTO as a `lowmem_ft.train.methods.Method`: pairs (KTO: labelled completions) batched as
    SFT samples are, trained on TRL's trainer of the method, which computes its own loss."""

    shown = SFT_SHOWN  # TRL's token accuracy, as for SFT
    logged = ("rewards/*", "log_odds*", "kl")  # TRL's names: rewards/margins, log_odds_ratio, KTO's kl
    traced = False  # the tracer runs SFT steps; a reference pass is not traced yet
    takes_rewards = False
    # installed when the recipe sets memory.chunked_loss; the planner never turns it on for these runs, whose
    # trainers compute their own loss (TRL's fused head, full logits: `lowmem_ft.memory.preference.method_setup`)
    chunked_loss = True

    def __init__(self, name: str):
        self.name = name

    def batching(self, recipe):
        from lowmem_ft.train.args import batching

        return batching(recipe)

    def batch_text(self, recipe, world_size: int) -> str:
        return ""  # sequences per step, as the banner says by default

    def config(self, sft_args, recipe):
        return method_config(sft_args, recipe)

    def prepare_data(self, recipe, tokenizer, reward_fns: list) -> MethodData:
        return MethodData(*prepare_data(recipe, tokenizer))

    def trainer(self, recipe) -> tuple[type, dict[str, Any]]:
        return trainer_for(recipe)


METHODS = {name: Preference(name) for name in ("dpo", "orpo", "simpo", "kto")}


def prepare_preference_datasets(recipe, tokenizer, fmt: str, fit) -> tuple[Any, Any, dict[str, Any]]:
    """Train dataset, eval dataset (or None) and the data summary of a preference run: every source read as `fmt`
    (`preference` or `kto`), tokenized and fitted (`tokenize_pairs`); eval data from data.eval_path / eval_split, or
    held out of the training pairs (data.eval_fraction, seeded as for SFT)."""
    from lowmem_ft.data.preference import describe_fit, tokenize_pairs
    from lowmem_ft.data.prepare import held_out_split
    from lowmem_ft.data.readers import RecordReader, log_skipped
    from lowmem_ft.data.sources import check_source, eval_source_of
    from lowmem_ft.errors import UserError

    d = recipe.data
    if d.mix or d.streaming:
        raise UserError(
            f"data.{'mix' if d.mix else 'streaming'} is not supported for preference training yet; give one --data "
            "source that fits in memory"
        )

    def read(source):
        reader = RecordReader(source, d.skip_bad_lines, fmt=fmt)
        records = list(reader)
        if not records:
            raise UserError(f"{source.label}: no usable {fmt} records ({len(reader.skipped)} bad rows skipped)")
        ds, report, skipped = tokenize_pairs(
            records, fmt, tokenizer, fit, where=source.label, skip_bad=d.skip_bad_lines
        )
        for line in [*reader.skipped, *skipped]:
            log_skipped(line)
        return ds, report, [*reader.skipped, *skipped], reader.unused_columns()

    source = check_source(recipe)[0]
    train_ds, report, skipped, unused = read(source)
    eval_ds, eval_where = None, None
    eval_source = eval_source_of(recipe)
    if eval_source is not None:
        eval_ds, _, _, _ = read(eval_source)
        eval_where = eval_source.label
    elif d.eval_fraction > 0:
        keep, held = held_out_split(len(train_ds), d.eval_fraction, recipe.training.seed)
        train_ds, eval_ds = train_ds.select(keep), train_ds.select(held)
        eval_where = f"held out {d.eval_fraction:g} of {source.label} (seed {recipe.training.seed})"
    log.info("data: %s", describe_fit(report, fit.max_len))
    if unused:
        log.info("%s: columns not used: %s", source.label, ", ".join(unused))
    summary = {
        "path": d.path,
        "format": fmt,
        "records": report.samples_in,
        "train_records": len(train_ds),
        "eval_records": len(eval_ds) if eval_ds is not None else 0,
        "eval_source": eval_where,
        "skipped_lines": skipped,
        "unused_columns": unused,
        "loss_on": "answers (chosen and rejected)" if fmt == "preference" else "completions",
        "fit": report.to_dict(),
        "prompt_truncation": fit.prompt_rule,
    }
    return train_ds, eval_ds, summary
