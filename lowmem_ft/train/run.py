"""Running a fine-tune, read as the recipe it runs: `build()` builds, `fit()` trains, `finalize()` saves.

Like torchtune's recipes, building is a list of steps in an order whose comments say why. What each step needs lives
in a library module: the device (`device`), W&B (`tracking`), the trainer arguments (`args`), model (`model`),
memory policy and observation (`guard`, `monitor`), and every file of the run directory (`lowmem_ft.rundir.RunDir`).
What differs between methods — their TRL config, data and trainer class — the run's `Method` says
(`lowmem_ft.train.methods`): `FineTune` never asks which method it runs.

Around the three steps, `FineTune.recorded` keeps the run's record (`lowmem_ft.train.ending.RunRecord`): the run
directory locked, run.json's status (running → completed, interrupted or failed with the one-line reason),
SIGINT/SIGTERM answered by a checkpoint after the step in progress (`interrupt`), and every way a run can end said
in one line — what was kept and how to go on (`--resume`, or the same command again when nothing was kept).
"""

from __future__ import annotations

import logging
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowmem_ft.choosing import Choice
from lowmem_ft.errors import Interrupted, UserError
from lowmem_ft.memory.target import Target
from lowmem_ft.recipe.schema import Recipe
from lowmem_ft.rundir import RunDir
from lowmem_ft.train import methods
from lowmem_ft.train.distributed import ranks
from lowmem_ft.train.ending import RunRecord, resume_point
from lowmem_ft.train.methods.rewards import reward_flags

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
        self.checkpoint, self.resume_step = resume_point(run) if resume else (None, None)
        self.callbacks = list(callbacks or [])
        self.stop = StopOnSignal()
        self.method = methods.get(recipe.training.method)
        self.record = RunRecord(
            run,
            self.rank,
            self.world_size,
            self.stop,
            lambda: getattr(self, "trainer", None),
            reward_flags(self.reward_fns),
        )

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
        # Every rank built before training.rank_timeout_s bounds a collective: until here the ranks waited for the
        # slowest one's imports and loading, which is not a hang; from here one that stops answering is.
        ranks.ready(self.recipe.training.rank_timeout_s)
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
        from lowmem_ft.train.args import sft_config

        self.batching = self.method.batching(self.recipe)
        sft_args = sft_config(self.recipe, self.run.checkpoints, self.run.name, trackers=self.tracking.active,
                              packed=self.batching.packed)  # fmt: skip
        self.args = self.method.config(sft_args, self.recipe)  # the method's TRL config, from the SFT one
        # transformers' process-zero check: under `train --gpus`, only rank 0 writes the run directory
        self.is_main = self.args.process_index == 0
        ranks.building(self.recipe.training.rank_timeout_s)  # CPU ranks too: transformers sets no gloo timeout

    def _setup_data(self) -> None:
        from lowmem_ft.data.prepare import pack
        from lowmem_ft.train.model import load_tokenizer

        self.tokenizer = load_tokenizer(self.recipe)
        self.data = self.method.prepare_data(self.recipe, self.tokenizer, self.reward_fns)
        self.train_ds, self.eval_ds, self.data_summary = self.data.train, self.data.eval, self.data.summary
        if self.data.keeps_columns:  # its collator reads columns beside the model's inputs (image chats' files)
            self.args.remove_unused_columns = False
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
        cpu = self.args.device.type == "cpu"
        exact = ExactMemory.for_recipe(self.recipe, eval_batch_size(self.recipe), self.args.world_size,
                                       config=self.model.config, prompt_len=longest) if cpu else None  # fmt: skip
        if exact is not None and self.data.held is not None:  # what the collator's batches hold is the run's too
            exact.pixels_held = self.data.held
        # under `train --gpus` each rank writes its own device's file (memory.jsonl on rank 0, memory.rank{R}.jsonl)
        self.monitor = MemoryMonitor(
            self.run.memory_file(self.args.process_index), predicted_peak_gb=self.choice.predicted_peak_gb,
            target=self.target, exact=exact, use_wandb=self.tracking.enabled, rank=self.args.process_index,
            world_size=self.args.world_size,
        )  # fmt: skip
        self.guard = MemoryGuard(m.micro_batch_size, m.gradient_accumulation, m.gradient_checkpointing,
                                 eval_batch_size(self.recipe), recorder=self.monitor, target=self.target)  # fmt: skip
        self.monitor.watch(self.guard.watch)
        if not cpu and self.is_main and self.args.world_size == 1:
            self._watch_calibration()

    def _watch_calibration(self) -> None:
        """On a GPU: the first steps' peaks beside the prediction, recorded as this GPU's calibration, which later
        plans and runs on it add to their margin (`observe.calibrating`, `lowmem_ft.calibrated`)."""
        from lowmem_ft.calibrated import this_device
        from lowmem_ft.choosing import setup_from_recipe
        from lowmem_ft.memory.arch import load_architecture
        from lowmem_ft.memory.estimate import estimate
        from lowmem_ft.train.observe.calibrating import STEPS, CalibrationRecorder

        key = this_device()
        if key is None:  # a GPU NVML does not see (another vendor's): no device to key a calibration by
            return
        r, plan = self.recipe, self.choice.plan
        # a resumed run or a recipe without --vram has no plan of its own: the same prediction, made here
        est = plan.estimate if plan is not None else estimate(load_architecture(r.model.name_or_path,
                                                                                r.model.trust_remote_code),
                                                              setup_from_recipe(r))  # fmt: skip
        what = {"model": r.model.name_or_path, "quantization": r.model.quantization, "adapter": r.adapter.kind,
                "micro_batch_size": r.memory.micro_batch_size, "max_seq_len": r.memory.max_seq_len,
                "gradient_checkpointing": r.memory.gradient_checkpointing,
                "vram_gb": self.target.vram_gb if self.target is not None else None}  # fmt: skip
        steps = min(STEPS, self.args.max_steps) if self.args.max_steps > 0 else STEPS
        recorder = CalibrationRecorder(key, est, what, steps, context=self.checkpoint is None)
        self.monitor.watch(recorder.watch)

    def _setup_trainer(self) -> None:
        from lowmem_ft.train.losses import install_loss_head
        from lowmem_ft.train.model import keep_adapters_fp32
        from lowmem_ft.train.observe import progress, tracking
        from lowmem_ft.train.observe.totals import RunTotals
        from lowmem_ft.train.resilience.early import ProveEarly

        m = self.recipe.memory
        self.totals = RunTotals()  # the whole run's loss across resumes, kept in every checkpoint
        figures = {"predicted_peak_gb": self.choice.predicted_peak_gb}
        figures |= self.target.to_dict() if self.target is not None else {}
        trainer_class, extra = self.method.trainer(self.recipe)
        self.trainer = trainer_class(
            **extra,
            **self.data.trainer_kwargs,  # what the method's trainer takes for its data (rewards, a collator)
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
        self.trainer.add_callback(
            _banner(
                self.recipe,
                self.choice,
                self.model,
                self.run,
                self.args.world_size,
                self.method,
                self.data.banner,
            )  # fmt: skip
        )
        progress.install(self.trainer, self.monitor, self.target, self.method.shown)
        keep_adapters_fp32(self.trainer.model, self.recipe)
        if m.chunked_loss and self.method.chunked_loss:  # not where the trainer's loss is its own (GRPO)
            # After the trainer, which patches in TRL's own fused LM head (the `chunked_loss: false` loss): ours
            # answers the same loss call instead.
            install_loss_head(self.trainer.model, chunked=True, chunk_tokens=m.loss_chunk_tokens or None)
        elif m.full_logits_loss and self.method.chunked_loss:  # the model's own loss over full logits
            install_loss_head(self.trainer.model, chunked=False)

    def _write_run_files(self) -> None:
        if not self.is_main:
            return
        info = _run_info(self.recipe, self.run, self.choice, self.model, self.args, self.data_summary, self.eval_ds)
        info |= {"allocator": self.allocator, "resumed_from": str(self.checkpoint) if self.checkpoint else None}
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
        _memory_report(self.run, said)

    # -- finalize ------------------------------------------------------------------------------------------------------
    def finalize(self) -> RunResult:
        from lowmem_ft.train.model import forget_bnb_overrides
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
            _write_card(self.run, self.recipe.adapter.kind == "full")
        tracking.finish(self.tracking, self.run if self.is_main else None)
        forget_bnb_overrides(self.trainer.model)
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
        if self.is_main and self.data.save_beside is not None:  # image chats: the processor at the cap it trained at
            self.data.save_beside(staged)
        barrier()
        if self.is_main:
            rename_into_place(staged, final, aside=staged.with_name(f"{staged.name}.replaced"))

    def _interrupted(self):
        """Metrics and log history of the steps done, and the interruption to raise (`recorded` adds what was kept)."""
        from lowmem_ft.train.model import forget_bnb_overrides
        from lowmem_ft.train.observe import tracking

        history = self.trainer.state.log_history
        step = self.trainer.state.global_step
        metrics = self._metrics(history) | {"interrupted": self.stop.name, "stopped_after_step": step}
        if self.is_main:
            self.run.write_metrics(metrics, history)
        tracking.finish(self.tracking, self.run if self.is_main else None)
        forget_bnb_overrides(self.trainer.model)
        return Interrupted(f"interrupted by {self.stop.name}: stopped after step {step}", self.stop.stopped_by)

    def _metrics(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """Final metrics of the whole run, across resumes (`totals.final_metrics`)."""
        from lowmem_ft.train.observe import progress, tracking
        from lowmem_ft.train.observe.totals import final_metrics

        logged = [h for h in history if "loss" in h]
        return final_metrics(self.trainer, self.output.metrics, history, self.totals) | {
            # the method's own figures at the last logged step (TRL's names: rewards/margins, ...)
            "method_metrics": methods.own_figures(self.method, logged[-1] if logged else {}),
            # GRPO: the mean reward at the first and the last logged step (the done line's trend)
            "reward_trend": [logged[0]["reward"], logged[-1]["reward"]] if logged and "reward" in logged[0] else None,
            "unscored_completions": getattr(self.trainer, "unscored_rows", None),  # GRPO: rows no reward scored
            "wall_seconds": round(self.elapsed, 2),
            "tokens_per_second": progress.tokens_per_second(self.output.metrics, history),
            "early_checks": self.early.costs,  # what showing the eval's and the save's memory at step 1 cost
            "wandb_mode": tracking.current_mode(self.tracking),  # offline after an unreachable server
        }

    # -- the run's record ----------------------------------------------------------------------------------------------
    def recorded(self):
        """Around build, fit and finalize: the run's status and every ending as one line (`ending.RunRecord`)."""
        return self.record.around()


def _banner(recipe: Recipe, choice: Choice, model, run: RunDir, world_size: int, method: methods.Method,
            images: str):  # fmt: skip
    """The plan on the console when training begins (`banner`): what the planner chose and where the run is."""
    from lowmem_ft.train.model import trainable_summary
    from lowmem_ft.train.observe.banner import PlanBanner, RunView, machine_ram_gb

    plan = choice.plan
    host = plan.host_gb if plan is not None else (run.read_plan() or {}).get("host_gb")
    counts = trainable_summary(model)
    view = RunView(
        recipe.training.method, recipe, choice, counts["trainable_params"], counts["total_params"],
        world_size=world_size, host_gb=host, machine_ram_gb=machine_ram_gb(), run_dir=str(run.path),
        batch=method.batch_text(recipe, world_size), images=images,
    )  # fmt: skip
    return PlanBanner(view, tensorboard_dir=str(run.tensorboard))


def _run_info(recipe: Recipe, run: RunDir, choice: Choice, model, args, data_summary: dict, eval_ds) -> dict[str, Any]:
    """run.json's record of what building decided: the data, the choice, the versions, the parameter counts and,
    with eval data, how it is evaluated."""
    from lowmem_ft.train.model import trainable_summary

    info: dict[str, Any] = {
        "name": run.name,
        "model": recipe.model.name_or_path,
        "data": data_summary,
        "choice": choice.to_dict(),
        "versions": _versions(),
        **trainable_summary(model),
    }
    if eval_ds is not None:
        info["eval"] = {
            "records": len(eval_ds),
            "batch_size": args.per_device_eval_batch_size,
            "batch_size_from": choice.reasons.get("eval_batch_size")
            or ("recipe" if recipe.memory.eval_batch_size else "micro_batch_size"),
            "eval_steps": args.eval_steps,
            "save_steps": args.save_steps,
            "best_by": "eval_loss",
        }
    return info


def _memory_report(run: RunDir, said=log.warning) -> None:
    """The memory report at the end of `fit`, which runs in a `finally` and so must never hide why fit ended:
    nothing when no memory was recorded (fit failed before the first step), and a report that fails is logged."""
    from lowmem_ft.report import write_report

    if not run.memory_file().is_file():
        return
    try:
        _, memory_summary = write_report(run.path)
    except Exception as exc:  # noqa: BLE001 — raising here would replace the exception fit is ending with
        said("memory report not written: %s: %s", type(exc).__name__, exc)
        return
    print(memory_summary)


def _write_card(run: RunDir, full: bool) -> None:
    """The model card of the saved weights (replacing peft's placeholder): what `--push-to-hub` uploads. The
    weights are saved already, so a card that cannot be written is a warning, not a failed run."""
    from lowmem_ft.hub import write_card

    weights = run.weights(full)
    try:
        write_card(run, weights)
    except Exception as exc:  # anything in the run's records the card cannot render
        log.warning("model card not written to %s (%s: %s)", weights, type(exc).__name__, exc)


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
