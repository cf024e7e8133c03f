"""Running a fine-tune, read as the recipe it runs: `setup()` builds, `fit()` trains, `finalize()` saves.

Like torchtune's recipes, setup is a list of steps in an order whose comments say why. What each step needs lives
in a library module: the device (`device`), W&B (`tracking`), the trainer arguments (`args`), data
(`lowmem_ft.data.prepare`), model (`model`), memory policy and observation (`guard`, `monitor`), the OOM-safe
trainer (`trainer`), and every file of the run directory (`lowmem_ft.rundir.RunDir`).
"""

from __future__ import annotations

import logging
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowmem_ft.errors import UserError
from lowmem_ft.memory.target import Target
from lowmem_ft.planning import Choice
from lowmem_ft.recipe.schema import Recipe
from lowmem_ft.rundir import RunDir

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    run_dir: Path
    metrics: dict[str, Any]
    log_history: list[dict[str, Any]] = field(default_factory=list)
    model: Any = None  # the trained model (PeftModel for LoRA), for in-process callers and tests
    is_main: bool = True  # rank 0 of a launched run (the process that wrote the run directory)


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "peft", "trl", "bitsandbytes", "accelerate", "datasets"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "missing"
    return out


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


class FineTune:
    """One fine-tune of `recipe` into `run`; `choice` says how the recipe was chosen (and the plan's figures).

    `resume`: continue from the run's last checkpoint (`--resume`, or a relaunch of `train --gpus` ranks).
    `callbacks`: extra trainer callbacks (tests inject faults this way).
    """

    def __init__(
        self, recipe: Recipe, run: RunDir, choice: Choice, *, resume: bool = False, callbacks: list | None = None
    ):
        self.recipe, self.run, self.choice = recipe, run, choice
        self.checkpoint = run.last_checkpoint() if resume else None
        if resume and self.checkpoint is None:
            raise UserError(f"--resume {run.path}: no checkpoint saved yet; start the run again without --resume")
        self.callbacks = list(callbacks or [])

    # -- setup -------------------------------------------------------------------------------------------------------
    def setup(self) -> FineTune:
        # The device first: the allocator reads its configuration once, and under `train --gpus` every CUDA call
        # before this rank's GPU is current would open a context on GPU 0.
        self._setup_device()
        # W&B's environment before the trainer: transformers' WandbCallback reads it when the trainer is built.
        self._setup_tracking()
        # Trainer arguments before the model: under DeepSpeed ZeRO-3 they register the config that makes
        # `from_pretrained` build the model already partitioned (transformers integrations/deepspeed.py).
        self._setup_args()
        # Data before the model: tokenizing fails fast on bad lines, before any weight is read.
        self._setup_data()
        self._setup_model()
        # Guard and monitor are bound to the trainer that runs the steps they look after.
        self._setup_trainer()
        # The run directory last: it records what setup decided (data summary, parameter counts).
        self._write_run_files()
        return self

    def _setup_device(self) -> None:
        from lowmem_ft.train.device import cap_process_memory, configure_allocator

        self.allocator = configure_allocator()
        t = self.choice.target
        vram = cap_process_memory(t.vram_gb if t is not None else None)
        # the memory this run answers to: the plan's target, else (CUDA, no --vram) the whole card
        self.target = t or (Target(vram, self.recipe.memory.safety_margin_gb) if vram is not None else None)

    def _setup_tracking(self) -> None:
        from lowmem_ft.train import tracking

        self.tracking = tracking.configure(self.recipe, self.run.path)

    def _setup_args(self) -> None:
        from lowmem_ft.train.args import batching, sft_config

        self.batching = batching(self.recipe)
        self.args = sft_config(
            self.recipe,
            self.run.checkpoints,
            self.run.name,
            report_to=self.tracking.report_to,
            packed=self.batching.packed,
        )
        # transformers' process-zero check: under `train --gpus`, only rank 0 writes the run directory
        self.is_main = self.args.process_index == 0

    def _setup_data(self) -> None:
        from lowmem_ft.data.prepare import prepare_datasets
        from lowmem_ft.train.model import load_tokenizer

        self.tokenizer = load_tokenizer(self.recipe)
        self.train_ds, self.eval_ds, self.data_summary = prepare_datasets(self.recipe, self.tokenizer)
        self.data_summary["batching"] = self.batching.to_dict()

    def _setup_model(self) -> None:
        from transformers import set_seed

        from lowmem_ft.train.model import build_model

        # Seed before the build: adapter initialisation draws from the global RNG, and the Trainer seeds only later.
        set_seed(self.recipe.training.seed)
        self.model = build_model(self.recipe)

    def _setup_trainer(self) -> None:
        from lowmem_ft.train.args import eval_batch_size
        from lowmem_ft.train.exact import ExactMemory
        from lowmem_ft.train.guard import MemoryGuard
        from lowmem_ft.train.losses import install_loss_head
        from lowmem_ft.train.monitor import MemoryMonitor
        from lowmem_ft.train.tracking import PlanConfig
        from lowmem_ft.train.trainer import MemorySafeSFTTrainer

        m = self.recipe.memory
        # On the CPU the monitor counts live tensor bytes exactly and compares them with the memory model's CPU form
        # of this run's setup (the plan's figure, in run.json, is the CUDA one) — with or without --vram.
        exact = (
            ExactMemory.for_recipe(
                self.recipe, eval_batch_size(self.recipe), self.args.world_size, config=self.model.config
            )
            if self.args.device.type == "cpu"
            else None
        )
        # under `train --gpus` each rank writes its own device's file (memory.jsonl on rank 0, memory.rank{R}.jsonl)
        self.monitor = MemoryMonitor(
            self.run.memory_file(self.args.process_index),
            predicted_peak_gb=self.choice.predicted_peak_gb,
            target=self.target,
            exact=exact,
            use_wandb=self.tracking.enabled,
            rank=self.args.process_index,
            world_size=self.args.world_size,
        )
        self.guard = MemoryGuard(
            m.micro_batch_size,
            m.gradient_accumulation,
            m.gradient_checkpointing,
            eval_batch_size(self.recipe),
            recorder=self.monitor,
            target=self.target,
        )
        self.monitor.watch(self.guard.watch)
        figures = {"predicted_peak_gb": self.choice.predicted_peak_gb}
        figures |= self.target.to_dict() if self.target is not None else {}
        self.trainer = MemorySafeSFTTrainer(
            model=self.model,
            args=self.args,
            train_dataset=self.train_ds,
            eval_dataset=self.eval_ds,
            processing_class=self.tokenizer,
            guard=self.guard,
            monitor=self.monitor,
            # the guard first: its on_train_begin restores the step-down the monitor's start record then shows
            callbacks=[self.guard, self.monitor, PlanConfig(figures), *self.callbacks],
        )
        _keep_adapters_fp32(self.trainer.model, self.recipe)
        if m.chunked_loss:
            # After the trainer, which patches in TRL's own fused LM head (the `chunked_loss: false` loss): ours
            # answers the same loss call instead.
            install_loss_head(self.trainer.model, chunked=True)

    def _write_run_files(self) -> None:
        from lowmem_ft.train.model import trainable_summary

        if not self.is_main:
            return
        info: dict[str, Any] = {
            "name": self.run.name,
            "model": self.recipe.model.name_or_path,
            "data": self.data_summary,
            "choice": self.choice.to_dict(),
            "allocator": self.allocator,
            "resumed_from": str(self.checkpoint) if self.checkpoint else None,
            "versions": _versions(),
            **trainable_summary(self.model),
        }
        if self.eval_ds is not None:
            info["eval"] = {
                "records": len(self.eval_ds),
                "batch_size": self.args.per_device_eval_batch_size,
                "batch_size_from": self.choice.reasons.get("eval_batch_size")
                or ("recipe" if self.recipe.memory.eval_batch_size else "micro_batch_size"),
                "eval_steps": self.args.eval_steps,
                "save_steps": self.args.save_steps,
                "best_by": "eval_loss",
            }
        self.run.write_recipe(self.recipe)
        self.run.write_info(info)
        self.run.write_data_report(self.data_summary)
        record = self.choice.plan_record(self.recipe)
        if record is not None:  # the plan --vram chose (or checked); the report compares the measured curve with it
            self.run.write_plan(record)

    # -- fit ---------------------------------------------------------------------------------------------------------
    def fit(self):
        import torch

        from lowmem_ft.report import write_report

        started = time.time()
        try:
            self.output = self.trainer.train(resume_from_checkpoint=str(self.checkpoint) if self.checkpoint else None)
        except torch.OutOfMemoryError as exc:  # outside a micro batch (optimizer step, save): no safe step down
            step = self.trainer.state.global_step + 1
            raise self.guard.outside_step(step, exc, self.monitor.reader()) from None
        finally:
            self.monitor.close()
            if self.is_main:
                _, memory_summary = write_report(self.run.path)
                print(memory_summary)
        self.elapsed = time.time() - started
        return self.output

    # -- finalize ------------------------------------------------------------------------------------------------------
    def finalize(self) -> RunResult:
        from lowmem_ft.train import tracking

        trainer = self.trainer
        if trainer.is_fsdp_enabled:
            # checkpoints stay sharded (resumable); the adapter is gathered whole (peft's FSDP example does the same)
            trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
        # every rank joins (FSDP/ZeRO gather), rank 0 writes the weights and the tokenizer
        trainer.save_model(str(self.run.weights(self.recipe.adapter.kind == "full")))
        history = trainer.state.log_history
        metrics = self._metrics(history)
        if self.is_main:
            self.run.write_metrics(metrics, history)
        tracking.finish(self.tracking)
        return RunResult(self.run.path, metrics, history, model=trainer.model, is_main=self.is_main)

    def _metrics(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """Final metrics: the trainer's, first/last loss, and with eval data the best evaluation and what was kept."""
        losses = [h["loss"] for h in history if "loss" in h]
        metrics = {
            **self.output.metrics,
            "global_step": self.trainer.state.global_step,
            "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None,
            "wall_seconds": round(self.elapsed, 2),
            "wandb_mode": self.tracking.mode,
        }
        evals = [h for h in history if "eval_loss" in h]
        if evals:
            best = min(evals, key=lambda h: h["eval_loss"])
            # what load_best_model_at_end loaded, hence what finalize saved to adapter/ (or model/)
            best_dir = self.trainer.state.best_model_checkpoint
            metrics |= {
                "last_eval_loss": evals[-1]["eval_loss"],
                "last_eval_perplexity": evals[-1]["eval_perplexity"],
                "best_eval_loss": best["eval_loss"],
                "best_eval_perplexity": best["eval_perplexity"],
                "best_step": best["step"],
                "best_checkpoint": best_dir,
                "saved_weights": f"best checkpoint ({Path(best_dir).name})" if best_dir else "last step",
            }
        return metrics


def train(
    recipe: Recipe,
    run: RunDir | str | Path,
    *,
    choice: Choice | None = None,
    resume: bool = False,
    callbacks: list | None = None,
) -> RunResult:
    """Fine-tune per `recipe` into the run directory `run` (already created): setup, fit, finalize."""
    run = run if isinstance(run, RunDir) else RunDir(run)
    job = FineTune(recipe, run, choice or Choice("recipe", "given"), resume=resume, callbacks=callbacks)
    job.setup()
    job.fit()
    return job.finalize()
