"""Running a fine-tune: recipe → data → model → TRL SFTTrainer → run directory.

The run directory (`runs/<name>/`) is the contract with every later command (`report`, `generate`, `merge`,
`--resume`): `recipe.yaml` (fully resolved), `run.json` (what was asked and chosen), `adapter/` (adapter +
tokenizer; `model/` for full fine-tunes), `checkpoints/` (resumable), `metrics.json`, `log_history.jsonl`, and `memory.jsonl` + `memory.png` (the monitor).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowmem_ft.data import load_jsonl
from lowmem_ft.errors import UserError
from lowmem_ft.recipe.load import dump, resolve
from lowmem_ft.recipe.schema import Recipe
from lowmem_ft.report import write_report

log = logging.getLogger(__name__)

# recipe optimizer name → transformers TrainingArguments `optim` (OptimizerNames in training_args.py)
OPTIM_NAMES = {
    "adamw_torch": "adamw_torch",
    "adamw_8bit": "adamw_bnb_8bit",
    "paged_adamw_8bit": "paged_adamw_8bit",
    "paged_adamw_32bit": "paged_adamw_32bit",
    "adafactor": "adafactor",
}


@dataclass
class RunResult:
    run_dir: Path
    metrics: dict[str, Any]
    log_history: list[dict[str, Any]] = field(default_factory=list)


def default_run_name(recipe: Recipe) -> str:
    base = Path(recipe.model.name_or_path.rstrip("/")).name or "model"
    return f"{base}-{time.strftime('%Y%m%d-%H%M%S')}"


def last_checkpoint(run_dir: Path) -> Path | None:
    checkpoints = sorted(
        (p for p in (run_dir / "checkpoints").glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
        key=lambda p: int(p.name.split("-")[-1]),
    )
    return checkpoints[-1] if checkpoints else None


def load_run_recipe(run_dir: str | Path, overrides: list[str] | None = None) -> Recipe:
    """The resolved recipe a run directory was trained with, plus any new `--set` overrides."""
    path = Path(run_dir) / "recipe.yaml"
    if not path.is_file():
        raise UserError(f"{run_dir} is not a lowmem-ft run directory (no recipe.yaml); pass runs/<name>")
    return resolve(path, overrides)


def wandb_mode(recipe: Recipe) -> str:
    """online / offline / disabled: an explicit WANDB_MODE wins, then the recipe; auto = online when logged in."""
    env = os.environ.get("WANDB_MODE")
    if env:
        return "disabled" if env in ("disabled", "dryrun_disabled") else env
    mode = recipe.logging.wandb_mode
    if mode != "auto":
        return mode
    try:
        import wandb

        logged_in = bool(os.environ.get("WANDB_API_KEY") or wandb.api.api_key)
    except Exception:  # wandb unavailable or unconfigured: no login
        logged_in = False
    return "online" if logged_in else "offline"


def sft_config(recipe: Recipe, run_dir: Path, has_eval: bool, report_to: list[str]):
    """TRL `SFTConfig` from the recipe: memory knobs, optimizer, cadence and loss masking."""
    import torch
    from trl import SFTConfig

    m, o, t, d = recipe.memory, recipe.optimizer, recipe.training, recipe.data
    cuda = torch.cuda.is_available()
    bf16 = cuda and recipe.model.compute_dtype == "bfloat16" and torch.cuda.is_bf16_supported()
    fp16 = cuda and recipe.model.compute_dtype == "float16"
    return SFTConfig(
        output_dir=str(run_dir / "checkpoints"),
        per_device_train_batch_size=m.micro_batch_size,
        per_device_eval_batch_size=m.micro_batch_size,
        gradient_accumulation_steps=m.gradient_accumulation,
        # Checkpointing is set on the model by `prepare_for_training` (same build path as the estimator
        # harness); the trainer must not wrap it again.
        gradient_checkpointing=False,
        max_length=m.max_seq_len,
        truncation_mode=d.truncate if d.truncate in ("keep_start", "keep_end") else "keep_start",
        packing=d.packing,
        completion_only_loss=False
        if d.train_on_prompt
        else None,  # None: TRL masks the prompt of prompt/completion data
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
        save_steps=t.save_steps,
        save_total_limit=t.save_total_limit,
        eval_strategy="steps" if has_eval else "no",
        eval_steps=t.eval_steps if has_eval else None,
        bf16=bf16,
        fp16=fp16,
        use_cpu=not cuda,
        report_to=report_to,
        run_name=run_dir.name,
        dataloader_num_workers=0,
        dataset_num_proc=None,
        disable_tqdm=False,
    )


def _datasets(recipe: Recipe):
    """Train (and eval) `datasets.Dataset`s of TRL records, and a summary for run.json."""
    from datasets import Dataset

    d = recipe.data
    if d.truncate in ("drop", "chunk"):
        raise UserError(f"data.truncate={d.truncate} is not supported yet; use keep_start or keep_end")
    train = load_jsonl(d.path, d.format, d.skip_bad_lines)
    summary: dict[str, Any] = {
        "path": d.path,
        "format": train.format,
        "records": len(train.records),
        "skipped_lines": train.skipped,
    }
    for line in train.skipped:
        log.warning("skipped %s", line)
    records = train.records
    eval_records: list[dict] = []
    if d.eval_path:
        eval_records = load_jsonl(d.eval_path, d.format, d.skip_bad_lines).records
    elif d.eval_fraction > 0:
        n_eval = max(1, int(len(records) * d.eval_fraction))
        eval_records, records = records[-n_eval:], records[:-n_eval]
    summary["train_records"] = len(records)
    summary["eval_records"] = len(eval_records)
    if train.format in ("messages", "sharegpt", "alpaca") and not d.train_on_prompt:
        summary["loss_on"] = "assistant turns"
    elif train.format == "prompt_completion" and not d.train_on_prompt:
        summary["loss_on"] = "completion"
    else:
        summary["loss_on"] = "all tokens"
    train_ds = Dataset.from_list(records)
    eval_ds = Dataset.from_list(eval_records) if eval_records else None
    return train_ds, eval_ds, summary, train.format


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "peft", "trl", "bitsandbytes", "accelerate", "datasets"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "missing"
    return out


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")


def prepare_run_dir(recipe: Recipe, name: str | None, resume: bool) -> Path:
    run_dir = Path(recipe.training.output_dir) / (name or default_run_name(recipe))
    if run_dir.exists() and not resume and any(run_dir.iterdir()):
        raise UserError(
            f"run directory {run_dir} already exists; pick another --name or continue it with --resume {run_dir}"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def make_trainer(
    recipe: Recipe,
    choice: dict[str, Any],
    run_dir: Path,
    budget_gb: float | None,
    use_wandb: bool,
    callbacks: list | None = None,
):
    """`MemorySafeSFTTrainer` bound to its guard and monitor; call the result with the SFTTrainer arguments."""
    from functools import partial

    from lowmem_ft.train.guard import OOMGuard
    from lowmem_ft.train.monitor import MemoryMonitor
    from lowmem_ft.train.trainer import MemorySafeSFTTrainer

    m = recipe.memory
    guard = OOMGuard(m.micro_batch_size, m.gradient_accumulation, checkpointing=m.gradient_checkpointing)
    margin = choice.get("safety_margin_gb")
    monitor = MemoryMonitor(
        run_dir,
        predicted_peak_gb=choice.get("predicted_peak_gb"),
        budget_gb=budget_gb,
        margin_gb=m.safety_margin_gb if margin is None else margin,
        guard=guard,
        use_wandb=use_wandb,
    )
    return partial(MemorySafeSFTTrainer, guard=guard, monitor=monitor, callbacks=[monitor, *(callbacks or [])])


def train(
    recipe: Recipe,
    run_dir: Path,
    *,
    resume: bool = False,
    choice: dict[str, Any] | None = None,
    callbacks: list | None = None,
) -> RunResult:
    """Fine-tune per `recipe` into `run_dir` (already created); `choice` records how the recipe was chosen."""
    import torch
    from transformers import set_seed

    from lowmem_ft.train.guard import cap_process_memory, configure_allocator, out_of_memory_outside_step
    from lowmem_ft.train.model import build_model, load_tokenizer, trainable_summary

    allocator = configure_allocator()  # before the first CUDA allocation

    (run_dir / "recipe.yaml").write_text(
        dump(recipe, header=f"resolved recipe of run {run_dir.name}"), encoding="utf-8"
    )
    train_ds, eval_ds, data_summary, fmt = _datasets(recipe)
    tokenizer = load_tokenizer(recipe)

    mode = wandb_mode(recipe)
    report_to = [] if mode == "disabled" else ["wandb"]
    if report_to:
        os.environ["WANDB_MODE"] = mode
        os.environ.setdefault("WANDB_PROJECT", recipe.logging.wandb_project)
        os.environ.setdefault("WANDB_DIR", str(run_dir.resolve()))

    if resume and (run_dir / "run.json").is_file():  # keep the plan (prediction, budget) of the original run
        choice = {**json.loads((run_dir / "run.json").read_text()).get("choice", {}), **(choice or {})}
    choice = choice or {}
    budget_gb = cap_process_memory(choice.get("vram_gb"))
    # Seed before the build: adapter initialisation draws from the global RNG, and the Trainer seeds only later.
    set_seed(recipe.training.seed)
    model = build_model(recipe)
    args = sft_config(recipe, run_dir, has_eval=eval_ds is not None, report_to=report_to)
    if fmt in ("messages", "sharegpt", "alpaca"):
        args.assistant_only_loss = not recipe.data.train_on_prompt
    checkpoint = last_checkpoint(run_dir) if resume else None
    if resume and checkpoint is None:
        raise UserError(
            f"--resume: {run_dir} has no checkpoint yet (checkpoints/checkpoint-N); start it again without --resume"
        )

    run_info = {
        "name": run_dir.name,
        "model": recipe.model.name_or_path,
        "data": data_summary,
        "choice": choice,
        "allocator": allocator,
        "resumed_from": str(checkpoint) if checkpoint else None,
        "versions": _versions(),
        **trainable_summary(model),
    }
    write_json(run_dir / "run.json", run_info)

    trainer = make_trainer(recipe, choice, run_dir, budget_gb, bool(report_to), callbacks)(
        model=model,
        args=args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        processing_class=tokenizer,
    )
    started = time.time()
    try:
        output = trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    except torch.OutOfMemoryError as exc:  # outside a micro batch (optimizer step, save): no safe step down
        raise out_of_memory_outside_step(trainer, exc) from None
    finally:
        trainer.monitor.close()
        _, memory_summary = write_report(run_dir)
        print(memory_summary)
    elapsed = time.time() - started

    out_dir = run_dir / ("model" if recipe.adapter.kind == "full" else "adapter")
    trainer.model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)

    history = trainer.state.log_history
    losses = [h["loss"] for h in history if "loss" in h]
    metrics = {
        **output.metrics,
        "global_step": trainer.state.global_step,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "wall_seconds": round(elapsed, 2),
        "wandb_mode": mode,
    }
    eval_losses = [h["eval_loss"] for h in history if "eval_loss" in h]
    if eval_losses:
        metrics["last_eval_loss"] = eval_losses[-1]
    write_json(run_dir / "metrics.json", metrics)
    with (run_dir / "log_history.jsonl").open("w", encoding="utf-8") as handle:
        for row in history:
            handle.write(json.dumps(row) + "\n")
    if report_to:
        import wandb

        if wandb.run is not None:
            wandb.finish()
    return RunResult(run_dir=run_dir, metrics=metrics, log_history=history)
