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
    model: Any = None  # the trained model (PeftModel for LoRA), for in-process callers and tests
    is_main: bool = True  # rank 0 of a launched run (the process that wrote the run directory)


def default_run_name(recipe: Recipe) -> str:
    base = Path(recipe.model.name_or_path.rstrip("/")).name or "model"
    return f"{base}-{time.strftime('%Y%m%d-%H%M%S')}"


def last_checkpoint(run_dir: Path) -> Path | None:
    checkpoints = sorted(
        (p for p in (run_dir / "checkpoints").glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
        key=lambda p: int(p.name.split("-")[-1]),
    )
    return checkpoints[-1] if checkpoints else None


def load_run_recipe(run_dir: str | Path, overrides: list[str] | dict | None = None) -> Recipe:
    """The resolved recipe a run directory was trained with, plus any new `--set` overrides."""
    path = Path(run_dir) / "recipe.yaml"
    if not path.is_file():
        raise UserError(f"{run_dir}: not a run directory (no recipe.yaml); pass runs/<name>")
    return resolve(path, overrides)


def wandb_mode(recipe: Recipe) -> str:
    """online / offline / disabled: an explicit WANDB_MODE wins, then the recipe; auto = online when logged in."""
    env = os.environ.get("WANDB_MODE")
    if env:
        return "disabled" if env in ("disabled", "dryrun_disabled") else env
    mode = recipe.logging.wandb_mode
    if mode != "auto":
        return mode
    return "online" if wandb_logged_in() else "offline"


def wandb_logged_in() -> bool:
    """An API key in WANDB_API_KEY or in ~/.netrc for the W&B host (where `wandb login` writes it)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        # wandb's own netrc reader; `wandb.api.api_key` reads the same but is deprecated (and warns) in wandb 0.2x
        from wandb.sdk.lib.wbauth import read_netrc_auth

        return bool(read_netrc_auth(host=os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")))
    except Exception:  # wandb unavailable, moved, or a malformed netrc: no usable login
        return False


def eval_batch_size(recipe: Recipe) -> int:
    """Samples per evaluation forward: the recipe's `memory.eval_batch_size` (under `--vram` the planner sets it from
    the eval forward's peak, `memory.planner._choose_eval_batch`), or the micro batch when it is 0."""
    return recipe.memory.eval_batch_size or recipe.memory.micro_batch_size


def sft_config(recipe: Recipe, run_dir: Path, has_eval: bool, report_to: list[str]):
    """TRL `SFTConfig` from the recipe: memory knobs, optimizer, cadence and loss masking."""
    import torch
    from trl import SFTConfig

    m, o, t, d = recipe.memory, recipe.optimizer, recipe.training, recipe.data
    cuda = torch.cuda.is_available()
    bf16 = cuda and recipe.model.compute_dtype == "bfloat16" and torch.cuda.is_bf16_supported()
    fp16 = cuda and recipe.model.compute_dtype == "float16"
    save_steps = t.save_steps
    if has_eval and save_steps != t.eval_steps:
        # The best checkpoint can only be kept if one is saved at every evaluation: transformers records a best
        # step only when checkpoint-<step> exists (Trainer._save_checkpoint), so saves follow the eval cadence.
        log.info("saving a checkpoint at every evaluation (every %d steps) to keep the best one", t.eval_steps)
        save_steps = t.eval_steps
    return SFTConfig(
        output_dir=str(run_dir / "checkpoints"),
        per_device_train_batch_size=m.micro_batch_size,
        per_device_eval_batch_size=eval_batch_size(recipe),
        gradient_accumulation_steps=m.gradient_accumulation,
        # Checkpointing is set on the model by `prepare_for_training` (same build path as the estimator
        # harness); the trainer must not wrap it again.
        gradient_checkpointing=False,
        max_length=m.max_seq_len,
        # lowmem_ft.data has tokenized, masked (labels) and fitted every sample to max_length already, so TRL's
        # truncation is a no-op and its completion/assistant masking is not needed.
        truncation_mode="keep_start",
        packing=d.packing,
        packing_strategy="bfd",  # keeps sample boundaries; TRL turns padding_free on for it
        train_sampling_strategy="random" if d.packing else "group_by_length",
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
        save_steps=save_steps,
        save_total_limit=t.save_total_limit,
        eval_strategy="steps" if has_eval else "no",
        eval_steps=t.eval_steps if has_eval else None,
        load_best_model_at_end=has_eval,
        metric_for_best_model="eval_loss" if has_eval else None,
        greater_is_better=False if has_eval else None,
        bf16=bf16,
        fp16=fp16,
        use_cpu=not cuda,
        report_to=report_to,
        run_name=run_dir.name,
        dataloader_num_workers=0,
        # every LoRA weight is used in every forward; True (the Trainer's default for a PeftModel) costs DDP an
        # extra traversal of the autograd graph per step
        ddp_find_unused_parameters=False,
        dataset_num_proc=None,
        disable_tqdm=False,
    )


def _datasets(recipe: Recipe, tokenizer):
    """Train (and eval) datasets, tokenized and fitted to the token budget, and the data summary for run.json."""
    from lowmem_ft.data.prepare import prepare_datasets

    return prepare_datasets(recipe, tokenizer)


def _packing(recipe: Recipe, model, args) -> dict[str, Any]:
    """Pack only where the attention keeps samples apart; otherwise fall back to length-grouped batches."""
    from lowmem_ft.data.prepare import packing_support

    if not recipe.data.packing:
        return {"packing": False, "batches": "length-grouped"}
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    ok, why = packing_support(base.config._attn_implementation, type(base).__module__)
    if not ok:
        log.warning("data.packing: %s; training unpacked with length-grouped batches instead", why)
        args.packing, args.padding_free, args.train_sampling_strategy = False, False, "group_by_length"
    return {"packing": ok, "how": why, "batches": "packed (bfd, padding-free)" if ok else "length-grouped"}


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


def _keep_adapters_fp32(model, recipe: Recipe) -> None:
    """Undo TRL's bf16 cast of trainable weights on quantized models (SFTTrainer.__init__, "When using QLoRA").

    lowmem-ft keeps LoRA weights in fp32, as peft's autocast_adapter_dtype makes them: updates of size lr × grad
    can fall below bf16's resolution, and the memory model counts adapters at 4 bytes per parameter.
    """
    import torch

    if recipe.adapter.kind != "lora":
        return
    for param in model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()


def is_main_process() -> bool:
    """Rank 0, or the only process: torchrun sets RANK for `accelerate launch` children."""
    return int(os.environ.get("RANK", "0")) == 0


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
        # under `train --gpus` each rank writes its own device's file (memory.jsonl on rank 0, memory.rank{R}.jsonl)
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

    from lowmem_ft.train.guard import (
        cap_process_memory,
        configure_allocator,
        out_of_memory_outside_step,
        restore_step_down,
    )
    from lowmem_ft.train.losses import install_loss_head
    from lowmem_ft.train.model import build_model, load_tokenizer, trainable_summary
    from lowmem_ft.train.trainer import enable_checkpointing

    allocator = configure_allocator()  # before the first CUDA allocation
    main = is_main_process()  # under `train --gpus`, only rank 0 writes the run directory
    if main:
        (run_dir / "recipe.yaml").write_text(
            dump(recipe, header=f"resolved recipe of run {run_dir.name}"), encoding="utf-8"
        )
    tokenizer = load_tokenizer(recipe)
    train_ds, eval_ds, data_summary = _datasets(recipe, tokenizer)

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
    # The training arguments come first: under DeepSpeed ZeRO-3 they register the config that makes
    # `from_pretrained` build the model already partitioned (transformers integrations/deepspeed.py).
    args = sft_config(recipe, run_dir, has_eval=eval_ds is not None, report_to=report_to)
    # Seed before the build: adapter initialisation draws from the global RNG, and the Trainer seeds only later.
    set_seed(recipe.training.seed)
    model = build_model(recipe)
    data_summary["batching"] = _packing(recipe, model, args)
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
    if eval_ds is not None:
        run_info["eval"] = {
            "records": len(eval_ds),
            "batch_size": args.per_device_eval_batch_size,
            "batch_size_from": choice.get("reasons", {}).get("eval_batch_size")
            or ("recipe" if recipe.memory.eval_batch_size else "micro_batch_size"),
            "eval_steps": args.eval_steps,
            "save_steps": args.save_steps,
            "best_by": "eval_loss",
        }
    if main:
        write_json(run_dir / "run.json", run_info)
        write_json(run_dir / "data_report.json", data_summary)
    # the plan --vram chose (or checked); the monitor compares the measured curve with it
    if main and choice and "predicted_peak_gb" in choice:
        write_json(run_dir / "plan.json", choice)

    trainer = make_trainer(recipe, choice, run_dir, budget_gb, bool(report_to), callbacks)(
        model=model,
        args=args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        processing_class=tokenizer,
    )
    _keep_adapters_fp32(trainer.model, recipe)
    if resume and (restored := restore_step_down(trainer.guard, run_dir)) is not None:
        if restored["gradient_checkpointing"] and not recipe.memory.gradient_checkpointing:
            enable_checkpointing(trainer.model)
        log.info("resuming with the step-down the run had reached after an OOM: %s", restored)
    if recipe.memory.chunked_loss:
        # After the trainer, which patches in TRL's own fused LM head (the `chunked_loss: false` loss): ours answers
        # the same loss call instead.
        install_loss_head(trainer.model, chunked=True)
    started = time.time()
    try:
        output = trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    except torch.OutOfMemoryError as exc:  # outside a micro batch (optimizer step, save): no safe step down
        raise out_of_memory_outside_step(trainer, exc) from None
    finally:
        trainer.monitor.close()
        if main:
            _, memory_summary = write_report(run_dir)
            print(memory_summary)
    elapsed = time.time() - started

    out_dir = run_dir / ("model" if recipe.adapter.kind == "full" else "adapter")
    if trainer.is_fsdp_enabled:
        # checkpoints stay sharded (resumable); the adapter is gathered whole (peft's FSDP example does the same)
        trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    # every rank joins (FSDP/ZeRO gather), rank 0 writes the weights and the tokenizer
    trainer.save_model(str(out_dir))

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
    evals = [h for h in history if "eval_loss" in h]
    if evals:
        metrics["last_eval_loss"] = evals[-1]["eval_loss"]
        metrics["last_eval_perplexity"] = evals[-1]["eval_perplexity"]
        best = min(evals, key=lambda h: h["eval_loss"])
        metrics["best_eval_loss"] = best["eval_loss"]
        metrics["best_eval_perplexity"] = best["eval_perplexity"]
        metrics["best_step"] = best["step"]
        # What load_best_model_at_end loaded, hence what was saved to adapter/ (or model/) above.
        best_dir = trainer.state.best_model_checkpoint
        metrics["best_checkpoint"] = best_dir
        metrics["saved_weights"] = f"best checkpoint ({Path(best_dir).name})" if best_dir else "last step"
    if main:
        write_json(run_dir / "metrics.json", metrics)
        with (run_dir / "log_history.jsonl").open("w", encoding="utf-8") as handle:
            for row in history:
                handle.write(json.dumps(row) + "\n")
    if report_to:
        import wandb

        if wandb.run is not None:
            wandb.finish()
    return RunResult(run_dir=run_dir, metrics=metrics, log_history=history, model=trainer.model, is_main=main)
