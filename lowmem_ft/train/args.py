"""The recipe as TRL's `SFTConfig`: every trainer argument decided in one place, before the config is built.

Nothing edits the `SFTConfig` after it is built: the packing fallback (`batching`) is decided first, from the
model's config, and passed in. The optimizer names, the eval batch and the save cadence that keeps the best
checkpoint are decided here too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowmem_ft.recipe.schema import Recipe

log = logging.getLogger(__name__)

# recipe optimizer name → transformers TrainingArguments `optim` (OptimizerNames in training_args.py)
OPTIM_NAMES = {
    "adamw_torch": "adamw_torch",
    "adamw_8bit": "adamw_bnb_8bit",
    "paged_adamw_8bit": "paged_adamw_8bit",
    "paged_adamw_32bit": "paged_adamw_32bit",
    "adafactor": "adafactor",
}


@dataclass(frozen=True)
class Batching:
    """How samples are batched: packed (TRL best-fit-decreasing, padding-free) or length-grouped, and why."""

    packed: bool
    how: str = ""
    streaming: bool = False  # a stream is batched in its (shuffled) order: it has no lengths to group by

    def to_dict(self) -> dict[str, Any]:
        unpacked = "in stream order (shuffle buffer)" if self.streaming else "length-grouped"
        if not self.how:
            return {"packing": False, "batches": unpacked}
        batches = "packed (bfd, padding-free)" if self.packed else unpacked
        return {"packing": self.packed, "how": self.how, "batches": batches}


def batching(recipe: Recipe) -> Batching:
    """Pack only where the attention keeps samples apart (decided from the model's config, before any weight is
    read); otherwise fall back to length-grouped batches, with a warning."""
    from lowmem_ft.data.prepare import packing_support
    from lowmem_ft.train.model import load_config

    streaming = recipe.data.streaming
    if not recipe.data.packing:
        return Batching(False, streaming=streaming)
    config = load_config(recipe)
    auto_map = getattr(config, "auto_map", None) or {}
    remote = recipe.model.trust_remote_code and "AutoModelForCausalLM" in auto_map
    # the module the model class will come from: the repository's own code, or transformers'
    module = f"remote code {auto_map['AutoModelForCausalLM']}" if remote else type(config).__module__
    ok, why = packing_support(recipe.model.attn_implementation, module)
    if not ok:
        log.warning("data.packing: %s; training unpacked with length-grouped batches instead", why)
    return Batching(ok, why, streaming)


def has_eval(recipe: Recipe) -> bool:
    d = recipe.data
    return bool(d.eval_path or d.eval_split) or d.eval_fraction > 0


def eval_batch_size(recipe: Recipe) -> int:
    """Samples per evaluation forward: the recipe's `memory.eval_batch_size` (under `--vram` the planner chooses it
    from the eval forward's peak), or the micro batch when it is 0."""
    return recipe.memory.eval_batch_size or recipe.memory.micro_batch_size


def save_steps(recipe: Recipe) -> int:
    """Checkpoints follow the eval cadence when there is eval data: transformers records a best step only when
    checkpoint-<step> exists (Trainer._save_checkpoint), so the best checkpoint can only be kept that way."""
    t = recipe.training
    if has_eval(recipe) and t.save_steps != t.eval_steps:
        log.info("saving a checkpoint at every evaluation (every %d steps) to keep the best one", t.eval_steps)
        return t.eval_steps
    return t.save_steps


def sft_config(recipe: Recipe, checkpoints: Path, run_name: str, *, report_to: list[str], packed: bool):
    """TRL `SFTConfig` from the recipe: memory knobs, optimizer, cadence and loss masking."""
    import torch
    from trl import SFTConfig

    m, o, t = recipe.memory, recipe.optimizer, recipe.training
    cuda = torch.cuda.is_available()
    bf16 = cuda and recipe.model.compute_dtype == "bfloat16" and torch.cuda.is_bf16_supported()
    fp16 = cuda and recipe.model.compute_dtype == "float16"
    evaluate = has_eval(recipe)
    return SFTConfig(
        output_dir=str(checkpoints),
        per_device_train_batch_size=m.micro_batch_size,
        per_device_eval_batch_size=eval_batch_size(recipe),
        gradient_accumulation_steps=m.gradient_accumulation,
        # Checkpointing is set on the model by `prepare_for_training` (same build path as the estimator harness);
        # the trainer must not wrap it again. `activation_checkpointing` is transformers 5's name: TRL's default of
        # the old `gradient_checkpointing=True` alias would print a FutureWarning on every run.
        activation_checkpointing=False,
        max_length=m.max_seq_len,
        # lowmem_ft.data has tokenized, masked (labels), fitted every sample to max_length and dropped those left
        # without loss tokens already (and packs them, `lowmem_ft.data.prepare.pack`): TRL's second pass over them
        # (SFTTrainer._prepare_dataset: its "Truncating" and "Dropping fully masked examples" maps) would change
        # nothing, so it is skipped.
        dataset_kwargs={"skip_prepare_dataset": True},
        truncation_mode="keep_start",
        packing=packed,
        packing_strategy="bfd",  # keeps sample boundaries; TRL turns padding_free on for it
        # a stream has no lengths to group by (its order is a seeded shuffle buffer, lowmem_ft.data.prepare)
        train_sampling_strategy="random" if packed or recipe.data.streaming else "group_by_length",
        completion_only_loss=False,
        assistant_only_loss=False,
        optim=OPTIM_NAMES[o.name],
        learning_rate=o.lr,
        weight_decay=o.weight_decay,
        lr_scheduler_type=o.schedule,
        warmup_steps=o.warmup_ratio,  # transformers 5: a float in [0, 1) is a ratio of total steps
        max_grad_norm=o.max_grad_norm,
        num_train_epochs=t.epochs,
        max_steps=t.max_steps,
        seed=t.seed,
        data_seed=t.seed,
        logging_steps=t.logging_steps,
        logging_first_step=True,
        save_strategy="steps",
        save_steps=save_steps(recipe),
        save_total_limit=t.save_total_limit,
        ddp_timeout=t.rank_timeout_s,  # the process group's timeout: a rank waiting for a hung one fails after it
        eval_strategy="steps" if evaluate else "no",
        eval_steps=t.eval_steps if evaluate else None,
        load_best_model_at_end=evaluate,
        metric_for_best_model="eval_loss" if evaluate else None,
        greater_is_better=False if evaluate else None,
        bf16=bf16,
        fp16=fp16,
        use_cpu=not cuda,
        report_to=report_to,
        run_name=run_name,
        dataloader_num_workers=0,
        # every LoRA weight is used in every forward; True (the Trainer's default for a PeftModel) costs DDP an
        # extra traversal of the autograd graph per step
        ddp_find_unused_parameters=False,
        dataset_num_proc=None,
        disable_tqdm=False,
    )
