"""Running a fine-tune, read as the recipe it runs: `build()` builds, `fit()` trains, `finalize()` saves.

Like torchtune's recipes, building is a list of steps in an order whose comments say why. What each step needs lives
in a library module: the device (`device`), W&B (`tracking`), the trainer arguments (`args`), data
(`lowmem_ft.data.prepare`), model (`model`), memory policy and observation (`guard`, `monitor`), the OOM-safe
trainer (`trainer`), and every file of the run directory (`lowmem_ft.rundir.RunDir`).

Around the three steps, `FineTune.recorded` keeps the run's record: the run directory locked, run.json's status
(running → completed, interrupted or failed with the one-line reason), SIGINT/SIGTERM answered by a checkpoint
after the step in progress (`interrupt`), and every way a run can end said in one line — what was kept and how to
go on (`--resume`, or the same command again when nothing was kept).
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowmem_ft.choosing import Choice
from lowmem_ft.errors import Interrupted, UserError
from lowmem_ft.memory.target import Target
from lowmem_ft.recipe.schema import Recipe
from lowmem_ft.rundir import RunDir, RunStatus
from lowmem_ft.train.distributed.ranks import lost_peer, set_timeout
from lowmem_ft.train.methods.rewards import RewardFailed, reward_flags

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


def _forget_bnb_overrides(model) -> None:
    """Drop this model's embeddings from bitsandbytes' process-wide `GlobalOptimManager`: transformers' Trainer
    registers every nn.Embedding there (32-bit optimizer states, trainer.py `create_optimizer`) and nothing
    unregisters them, so each finished run's embedding would stay alive in a process that goes on (generate after
    train, tests, the GPU check)."""
    import sys

    optim = sys.modules.get("bitsandbytes.optim")
    if optim is None:
        return
    mine = {id(m) for m in model.modules()}
    manager = optim.GlobalOptimManager.get_instance()
    manager.module_weight_config_triple = [t for t in manager.module_weight_config_triple if id(t[0]) not in mine]


def launched_rank() -> int:
    """This process's rank before the trainer exists: torchrun's `RANK` (0 for a single process)."""
    return int(os.environ.get("RANK", "0"))


class FineTune:
    """One fine-tune of `recipe` into `run`; `choice` says how the recipe was chosen (and the plan's figures).

    `resume`: continue from the run's newest complete checkpoint (`--resume`, or a relaunch of `train --gpus` ranks).
    `callbacks`: extra trainer callbacks (tests inject faults this way).
    `reward_fns`: a GRPO run's reward functions from files, as the command line named them (never the recipe's).

    The process that writes the run directory (rank 0) locks it first (`RunDir.lock`; a run on it already is a
    one-line error) and removes what an interrupted save left.
    """

    def __init__(
        self,
        recipe: Recipe,
        run: RunDir,
        choice: Choice,
        *,
        resume: bool = False,
        callbacks: list | None = None,
        reward_fns: list | None = None,
    ):
        from lowmem_ft.train.resilience.interrupt import StopOnSignal

        self.recipe, self.run, self.choice = recipe, run, choice
        self.reward_fns = list(reward_fns or [])  # GRPO: the command line's --reward-fn (`rewards.RewardSpec`)
        self.rank, self.world_size = launched_rank(), int(os.environ.get("WORLD_SIZE", "1"))
        self.is_main = self.rank == 0  # the trainer's process_index agrees (`_setup_args`)
        if self.is_main:
            run.lock()
            run.clear_staging()
        self.checkpoint, self.resume_step = self._resume_point() if resume else (None, None)
        self.callbacks = list(callbacks or [])
        self.stop = StopOnSignal()
        self.status: RunStatus | None = None

    def _resume_point(self) -> tuple[Path, int]:
        """The newest complete checkpoint and its step, said with what was skipped and how the run before ended; a
        UserError when there is none."""
        run = self.run
        point = run.resumable()
        before = run.read_status()
        if before is not None:  # running: it had no time to record its end (killed, or the machine went down)
            ended = "stopped without recording how" if before.state == "running" else before.describe()
            log.info("%s: the run before this one %s", run.path, ended)
        (log.warning if point.skipped else log.info)("%s", point.describe())
        return point.checkpoint, point.step

    # -- build -------------------------------------------------------------------------------------------------------
    def build(self) -> FineTune:
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
        # Monitor and guard after the model (the exact CPU count's prediction reads its config), before the trainer
        # that runs the steps they look after and takes them as callbacks.
        self._setup_memory()
        self._setup_trainer()
        # The run directory last: it records what building decided (data summary, parameter counts).
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
        from lowmem_ft.train.observe import tracking

        self.tracking = tracking.configure(self.recipe, self.run.path)

    def _setup_args(self) -> None:
        from lowmem_ft.train.args import Batching, batching, sft_config

        self.grpo = self.recipe.training.method == "grpo"
        self.batching = batching(self.recipe) if not self.grpo else Batching(False)
        self.args = sft_config(
            self.recipe,
            self.run.checkpoints,
            self.run.name,
            trackers=self.tracking.active,
            packed=self.batching.packed,
        )
        if self.grpo:
            from lowmem_ft.train.methods.grpo import grpo_config

            self.args = grpo_config(self.args, self.recipe)
        elif self.recipe.training.method != "sft":
            from lowmem_ft.train.methods.preference import method_config

            self.args = method_config(self.args, self.recipe)
        # transformers' process-zero check: under `train --gpus`, only rank 0 writes the run directory
        self.is_main = self.args.process_index == 0
        set_timeout(self.recipe.training.rank_timeout_s)  # a hung rank fails the others after it, CPU ranks too

    def _setup_data(self) -> None:
        from lowmem_ft.data.prepare import pack, prepare_datasets
        from lowmem_ft.train.model import load_tokenizer
        from lowmem_ft.vision.setup import vision_of

        self.tokenizer = load_tokenizer(self.recipe)
        self.vision = vision_of(self.recipe) if self.recipe.training.method == "sft" else None
        if self.vision is not None:  # image chats (lowmem_ft.vision): its own reading and collator
            self.train_ds, self.eval_ds, self.data_summary = self.vision.prepare(self.recipe, self.tokenizer)
            self.args.remove_unused_columns = False  # the collator reads the image files column
        elif self.grpo:
            from lowmem_ft.train.methods.grpo import prepare_data, reward_functions

            self.train_ds, self.eval_ds, self.data_summary = prepare_data(self.recipe, self.tokenizer)
            # before any weight is read: a missing reward or a column a reward needs is one line now
            self.rewards = reward_functions(self.recipe, self.reward_fns, self.data_summary["columns"])
        elif self.recipe.training.method != "sft":
            from lowmem_ft.train.methods.preference import prepare_data

            self.train_ds, self.eval_ds, self.data_summary = prepare_data(self.recipe, self.tokenizer)
        else:
            self.train_ds, self.eval_ds, self.data_summary = prepare_datasets(self.recipe, self.tokenizer)
        self.data_summary["batching"] = self.batching.to_dict()
        if self.batching.packed:  # TRL's own preparation is skipped (`args.sft_config`), its packing with it
            self.train_ds = pack(self.train_ds, self.recipe.memory.max_seq_len)
            if self.eval_ds is not None:
                self.eval_ds = pack(self.eval_ds, self.recipe.memory.max_seq_len)

    def _setup_model(self) -> None:
        from transformers import set_seed

        from lowmem_ft.train import init_conversion

        # Seed before the build: adapter initialisation draws from the global RNG, and the Trainer seeds only later.
        set_seed(self.recipe.training.seed)
        if init_conversion.rewrites_base(self.recipe) and (self.args.fsdp or self.args.deepspeed):
            raise UserError(
                f"adapter.init {self.recipe.adapter.init} rewrites the base weights, which FSDP / DeepSpeed shard "
                "across devices; train it on one GPU or with DDP, or set adapter.init=default"
            )
        self.model = init_conversion.build(
            self.recipe, self.run.initial_adapter, resuming=self.checkpoint is not None, is_main=self.is_main
        )

    def _setup_memory(self) -> None:
        """The monitor (observes, records; exact live bytes on the CPU) and the guard (decides step-downs)."""
        from lowmem_ft.train.args import eval_batch_size
        from lowmem_ft.train.measure.exact import ExactMemory
        from lowmem_ft.train.observe.monitor import MemoryMonitor
        from lowmem_ft.train.resilience.guard import MemoryGuard

        m = self.recipe.memory
        if self.resume_step is not None:  # the steps after the checkpoint are redone: their samples would repeat
            dropped = self.run.trim_memory_log(self.resume_step, self.args.process_index)
            if dropped:
                log.info("memory log: dropped %d record(s) of steps after %d, which this run redoes", dropped,
                         self.resume_step)  # fmt: skip
        # On the CPU the monitor counts live tensor bytes exactly and compares them with the memory model's CPU form
        # of this run's setup (the plan's figure, in run.json, is the CUDA one) — with or without --vram.
        longest = self.data_summary.get("prompt_fit", {}).get("longest", 0)  # GRPO: the plan's P
        exact = (
            ExactMemory.for_recipe(
                self.recipe,
                eval_batch_size(self.recipe),
                self.args.world_size,
                config=self.model.config,
                prompt_len=longest,
            )  # fmt: skip
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

    def _setup_trainer(self) -> None:
        from lowmem_ft.train.losses import install_loss_head
        from lowmem_ft.train.observe import progress, tracking
        from lowmem_ft.train.observe.totals import RunTotals
        from lowmem_ft.train.resilience.early import ProveEarly
        from lowmem_ft.train.resilience.trainer import MemorySafeSFTTrainer

        m = self.recipe.memory
        self.totals = RunTotals()  # the whole run's loss across resumes, kept in every checkpoint
        figures = {"predicted_peak_gb": self.choice.predicted_peak_gb}
        figures |= self.target.to_dict() if self.target is not None else {}
        trainer_class, extra, shown = MemorySafeSFTTrainer, {}, progress.SFT_SHOWN
        if self.grpo:
            from lowmem_ft.train.methods.grpo import GRPO_SHOWN, MemorySafeGRPOTrainer

            trainer_class, extra = MemorySafeGRPOTrainer, {"reward_funcs": self.rewards}
            shown = GRPO_SHOWN
        elif self.recipe.training.method != "sft":
            from lowmem_ft.train.methods.preference import trainer_for

            trainer_class, extra = trainer_for(self.recipe)
        if self.vision is not None:  # the batch's images → pixel values, at the run's resolution cap
            extra["data_collator"] = self.vision.collator(self.recipe, self.tokenizer)
            if self.monitor.exact is not None:  # the pixel values the trainer holds are the run's too
                self.monitor.exact.pixels_held = extra["data_collator"].pixels_held
        self.trainer = trainer_class(
            **extra,
            model=self.model,
            args=self.args,
            train_dataset=self.train_ds,
            eval_dataset=self.eval_ds,
            processing_class=self.tokenizer,
            guard=self.guard,
            monitor=self.monitor,
            run=self.run,
            loraplus_lr_ratio=self.recipe.optimizer.loraplus_lr_ratio if self.recipe.adapter.kind == "lora" else 0,
            # the guard first: its on_train_begin restores the step-down the monitor's start record then shows
            callbacks=[self.guard, self.monitor, self.stop, self.totals, *self.callbacks],
        )
        reference = getattr(self.trainer, "ref_model", None)
        if reference is not None and self.monitor.exact is not None:  # a full fine-tune's DPO reference copy
            self.monitor.exact.extra_roots.append(reference)
        self.totals.bind(self.trainer)
        config = tracking.run_config(self.recipe, self.choice)
        tracking.attach(self.trainer, self.tracking, self.run, config, figures)
        # the evaluation's heaviest batch and a trial save after step 1, after the monitor that records their memory
        self.early = ProveEarly(self.trainer)
        self.trainer.add_callback(self.early)
        # the banner after the trackers' callbacks (W&B's run exists when it prints), before the bar starts drawing
        self.trainer.add_callback(self._banner())
        progress.install(self.trainer, self.monitor, self.target, shown)
        _keep_adapters_fp32(self.trainer.model, self.recipe)
        if m.chunked_loss and not self.grpo:  # GRPO's loss is TRL's own (`memory.grpo.method_setup`)
            # After the trainer, which patches in TRL's own fused LM head (the `chunked_loss: false` loss): ours
            # answers the same loss call instead.
            install_loss_head(self.trainer.model, chunked=True, chunk_tokens=m.loss_chunk_tokens or None)

    def _banner(self):
        """The plan on the console when training begins (`banner`): what the planner chose and where the run is."""
        from lowmem_ft.train.model import trainable_summary
        from lowmem_ft.train.observe.banner import PlanBanner, RunView, machine_ram_gb

        plan = self.choice.plan
        host = plan.host_gb if plan is not None else (self.run.read_plan() or {}).get("host_gb")
        counts = trainable_summary(self.model)
        view = RunView(
            self.recipe.training.method, self.recipe, self.choice, counts["trainable_params"], counts["total_params"],
            world_size=self.args.world_size, host_gb=host, machine_ram_gb=machine_ram_gb(),
            run_dir=str(self.run.path), images=self.vision.banner(self.data_summary) if self.vision else "",
        )  # fmt: skip
        return PlanBanner(view, tensorboard_dir=str(self.run.tensorboard))

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

        started, trained = time.time(), False
        try:
            self.output = self.trainer.train(resume_from_checkpoint=str(self.checkpoint) if self.checkpoint else None)
            trained = True
        except torch.OutOfMemoryError as exc:  # outside a micro batch (optimizer step, save): no safe step down
            step = self.trainer.state.global_step + 1
            raise self.guard.outside_step(step, exc, self.monitor.reader()) from None
        finally:
            # what fails here after a failed fit (a full disk fails every write) is not news: the run's end says why
            said = log.warning if trained else log.debug
            try:
                self.monitor.close()  # flushes: fails on a full disk, which the run's end then reports
            except OSError as exc:
                said("memory log %s: %s", self.monitor.path, exc)
            if self.is_main:
                self._report(said)
        self.elapsed = time.time() - started
        return self.output

    def _report(self, said=log.warning) -> None:
        """The memory report at the end of `fit`, which runs in a `finally` and so must never hide why fit ended:
        nothing when no memory was recorded (fit failed before the first step), and a report that fails is logged."""
        from lowmem_ft.report import write_report

        if not self.run.memory_file().is_file():
            return
        try:
            _, memory_summary = write_report(self.run.path)
        except Exception as exc:  # noqa: BLE001 — raising here would replace the exception fit is ending with
            said("memory report not written: %s: %s", type(exc).__name__, exc)
            return
        print(memory_summary)

    # -- finalize ------------------------------------------------------------------------------------------------------
    def finalize(self) -> RunResult:
        from lowmem_ft.train.observe import tracking

        trainer = self.trainer
        if self.stop.stopped_at is not None:  # stopped on a signal: the checkpoint holds the run, no final weights
            raise self._interrupted()
        if trainer.is_fsdp_enabled:
            # checkpoints stay sharded (resumable); the adapter is gathered whole (peft's FSDP example does the same)
            trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
        self._save_weights()
        history = trainer.state.log_history
        metrics = self._metrics(history)
        if self.is_main:
            self.run.write_metrics(metrics, history)
            self._write_card()
        tracking.finish(self.tracking, self.run if self.is_main else None)
        _forget_bnb_overrides(self.trainer.model)
        return RunResult(self.run.path, metrics, history, model=self.trainer.model, is_main=self.is_main)

    def _save_weights(self) -> None:
        """adapter/ (or model/), written beside it and renamed when complete: every rank joins (FSDP/ZeRO gather),
        rank 0 writes the weights and the tokenizer."""
        from lowmem_ft.train import init_conversion
        from lowmem_ft.train.distributed.ranks import barrier
        from lowmem_ft.train.resilience.checkpoints import rename_into_place

        final = self.run.weights(self.recipe.adapter.kind == "full")
        staged = self.run.staged(final)
        self.trainer.save_model(str(staged))
        if self.is_main and init_conversion.rewrites_base(self.recipe):  # PiSSA / OLoRA → LoRA on the original base
            init_conversion.save_converted(self.model, staged, self.run.initial_adapter)
        if self.is_main and self.vision is not None:  # the processor at the cap it trained at, beside the weights
            self.vision.save_preprocessor(self.recipe, staged)
        barrier()
        if self.is_main:
            rename_into_place(staged, final, aside=staged.with_name(f"{staged.name}.replaced"))

    def _interrupted(self):
        """Metrics and log history of the steps done, and the interruption to raise (`recorded` adds what was kept)."""
        from lowmem_ft.train.observe import tracking

        history = self.trainer.state.log_history
        step = self.trainer.state.global_step
        metrics = self._metrics(history) | {"interrupted": self.stop.name, "stopped_after_step": step}
        if self.is_main:
            self.run.write_metrics(metrics, history)
        tracking.finish(self.tracking, self.run if self.is_main else None)
        _forget_bnb_overrides(self.trainer.model)
        return Interrupted(f"interrupted by {self.stop.name}: stopped after step {step}", self.stop.stopped_by)

    def _write_card(self) -> None:
        """The model card of the saved weights (replacing peft's placeholder): what `--push-to-hub` uploads. The
        weights are saved already, so a card that cannot be written is a warning, not a failed run."""
        from lowmem_ft.hub import write_card

        weights = self.run.weights(self.recipe.adapter.kind == "full")
        try:
            write_card(self.run, weights)
        except Exception as exc:  # anything in the run's records the card cannot render
            log.warning("model card not written to %s (%s: %s)", weights, type(exc).__name__, exc)

    def _metrics(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """Final metrics of the whole run, across resumes: the mean training loss and time (`totals`), the trainer's
        rates of the last call, first/last loss, throughput, and with eval data the best evaluation and what was
        kept."""
        from lowmem_ft.train.observe import progress, tracking

        logged = [h for h in history if "loss" in h]
        # transformers' train_loss and train_runtime cover this call only: after --resume, the resumed steps
        whole = self.totals.whole_run(self.output.metrics)
        metrics = {
            **self.output.metrics,
            "train_loss": whole.mean_loss,
            "train_loss_steps": whole.steps,
            "train_runtime": round(whole.seconds, 4),
            "global_step": self.trainer.state.global_step,
            "first_loss": logged[0]["loss"] if logged else None,
            "last_loss": logged[-1]["loss"] if logged else None,
            "first_loss_step": logged[0].get("step") if logged else None,
            "last_loss_step": logged[-1].get("step") if logged else None,
            # the preference methods' own figures at the last logged step (TRL's names: rewards/margins, ...)
            "method_metrics": {
                k: v
                for k, v in (logged[-1] if logged else {}).items()
                if k.startswith(("rewards/", "log_odds", "completions/mean_length", "clip_ratio/region"))
                or k in ("kl", "reward", "reward_std")
            },
            # GRPO: the mean reward at the first and the last logged step (the done line's trend)
            "reward_trend": [logged[0]["reward"], logged[-1]["reward"]] if logged and "reward" in logged[0] else None,
            "unscored_completions": getattr(self.trainer, "unscored_rows", None),  # GRPO: rows no reward scored
            "wall_seconds": round(self.elapsed, 2),
            "tokens_per_second": progress.tokens_per_second(self.output.metrics, history),
            "early_checks": self.early.costs,  # what showing the eval's and the save's memory at step 1 cost
            "wandb_mode": tracking.current_mode(self.tracking),  # offline after an unreachable server
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

    # -- the run's record ----------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def recorded(self) -> Iterator[None]:
        """Around build, fit and finalize: run.json's status (running → completed / interrupted / failed), the
        signal handlers, and every ending as one line; the run directory unlocked at the end."""
        self.stop.install()
        if self.is_main:
            self.run.reserve()  # room to record the end on a disk that fills meanwhile
        # under --gpus every rank records its own status (rank 0 in run.json): the launcher reads them all to say
        # which rank ended the launch and how (`lowmem_ft.train.distributed.launch.settle`)
        self.status = RunStatus.running()
        if self.world_size > 1:
            self.status.rank = self.rank
        self._record(self.status)
        try:
            yield
        except BaseException as exc:
            ending = self._ending(exc)
            if ending is exc:
                raise
            raise ending from None
        else:
            self._end("completed", step=self.trainer.state.global_step)
        finally:
            self.stop.uninstall()
            if self.is_main:
                self.run.release_reserve()
            self.run.unlock()

    def _record(self, status: RunStatus) -> None:
        try:
            self.run.write_rank_status(self.rank, status)
        except OSError as exc:  # a full disk: the run's end is said on the console all the same
            log.warning("could not record the run's status (%s) in %s: %s", status.state, self.run.info_file, exc)

    def _end(self, state: str, **info: Any) -> None:
        if self.status is None:
            return
        if state != "completed":  # what --resume would continue from
            kept = self.run.last_checkpoint()
            info["checkpoint"] = str(kept) if kept is not None else None
        self._record(self.status.ended(state, **info))

    def _ending(self, exc: BaseException) -> BaseException:
        """Record how the run ended and return the error to raise: one line (with what was kept and how to go on)
        for everything but a bug."""
        from lowmem_ft.train.resilience.checkpoints import DiskFull, is_disk_full

        trainer = getattr(self, "trainer", None)
        step = trainer.state.global_step if trainer is not None else None
        if isinstance(exc, KeyboardInterrupt):  # a second Ctrl-C: abort at once
            exc = Interrupted(f"aborted by a second SIGINT during step {(step or 0) + 1}", signal.SIGINT)
        if isinstance(exc, Interrupted):
            exc = Interrupted(f"{exc}; {self.run.continuation(reward_flags(self.reward_fns))}", exc.signum)
            self._end("interrupted", step=step, reason=str(exc), signal=signal.Signals(exc.signum).name)
            return exc
        if not isinstance(exc, DiskFull) and is_disk_full(exc):
            exc = self._disk_full(exc)
        if self.world_size > 1 and lost_peer(exc):  # another rank died or hung: the launcher names which
            exc = UserError(f"rank {self.rank} lost the other ranks at a collective ({_first_line(exc)})")
        if isinstance(exc, RewardFailed):  # at a step: the run stops, its last checkpoint kept, and says how to go on
            exc = RewardFailed(f"{exc}; {self.run.continuation(reward_flags(self.reward_fns))}")
        if isinstance(exc, UserError):
            self._end("failed", step=step, reason=str(exc))
            return exc
        self._end("failed", step=step, reason=f"{type(exc).__name__}: {_first_line(exc)}"[:500])
        return exc

    def _disk_full(self, exc: BaseException):
        """A full disk outside a checkpoint save (memory log, final weights, run files): the same one line."""
        from lowmem_ft.train.resilience.checkpoints import Saver

        trainer = getattr(self, "trainer", None)
        saver = trainer.saver if trainer is not None else Saver(self.run)
        if trainer is not None and not saver.needed:
            saver.needed = saver.expected_bytes(trainer)
        return saver.disk_full(f"writing {_filename(exc) or self.run.path}")


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else ""


def _filename(exc: BaseException | None) -> str | None:
    """The file a failed write names, on the exception or one it came from."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if getattr(exc, "filename", None):
            return str(exc.filename)
        exc = exc.__cause__ or exc.__context__
    return None


def train(
    recipe: Recipe,
    run: RunDir | str | Path,
    *,
    choice: Choice | None = None,
    resume: bool = False,
    callbacks: list | None = None,
    reward_fns: list | None = None,
) -> RunResult:
    """Fine-tune per `recipe` into the run directory `run` (already created): build, fit, finalize."""
    run = run if isinstance(run, RunDir) else RunDir(run)
    job = FineTune(recipe, run, choice or Choice("recipe", "given"), resume=resume, callbacks=callbacks,
                   reward_fns=reward_fns)  # fmt: skip
    with job.recorded():
        job.build()
        job.fit()
        return job.finalize()
