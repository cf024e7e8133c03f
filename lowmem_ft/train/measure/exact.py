"""Exact memory of a CPU run, sample by sample, next to the memory model's prediction of the same thing.

On the CPU there is no allocator to ask, so the run counts its live tensor bytes itself: `ExactMemory` keeps
`lowmem_ft.train.measure.peak.PeakMemory` running from the start of training to its end — through the real `train` path:
SFTTrainer, the collator, evaluation, checkpoint saves, bitsandbytes' CPU optimizer kernels — and at every sample of
the monitor reports `live_gb` (live now) and `peak_live_gb` (the exact peak since the previous sample).

Beside each it puts the memory model's CPU form for the same phase and the batch that actually ran
(`predicted_peak_live_gb`, from `lowmem_ft.memory.estimate.phase_peak_bytes`): the batch's rows × tokens, its
labelled positions (what the chunked loss projects: labels ≠ -100 after the shift its head applies), whether
gradients and optimizer states were alive yet, whether activation checkpointing was on (the guard may switch it on
mid-run). Those are observed on the model and the optimizer, never assumed, so a disagreement is a gap in the memory
model, not in the bookkeeping. The plan's batch (micro batch × `max_seq_len`) is the worst case: batches that ran
are usually shorter, and the start record carries the prediction for the plan's batch too
(`predicted_cpu_peak_gb`).

Not seen (PeakMemory sees what Python can reach or an operator returns): tensors only C++ holds — DDP's reducer
buckets, allocated when the model is wrapped, before training starts (the planner's per-device DDP estimate counts
them, `lowmem_ft.memory.sharding`).

Phases without a prediction: `eval` (after an evaluation loop) and `save` (a checkpoint): both run with no gradient
and no activation alive, so they stay below the training peak (the report says so when they do not).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field, replace
from typing import Any

from lowmem_ft.errors import UserError
from lowmem_ft.memory.arch import Architecture
from lowmem_ft.memory.estimate import GB, RunPhase, Setup, estimate, phase_peak_bytes
from lowmem_ft.method_planning import planning
from lowmem_ft.train.measure.peak import PeakMemory

log = logging.getLogger(__name__)

# monitor phase → the memory model's phase whose peak a sample's `peak_live_gb` measures
PREDICTED: dict[str, RunPhase] = {
    "forward": "forward",
    "backward": "backward",
    "optimizer": "optimizer step",
    "eval_forward": "eval",
}
# ... and a GRPO run's: its generation and scoring phases too (`lowmem_ft.memory.grpo.phase_peaks`)
GRPO_PHASES: dict[str, str] = {
    "generation": "generation",
    "scoring": "scoring",
    "forward": "forward",
    "backward": "backward",
    "optimizer": "optimizer step",
}


@dataclass
class ExactMemory:
    """Exact live tensor bytes of a CPU run and their prediction; `arch` None: measured, not predicted.

    Args:
        arch: the model's architecture (the memory model's view of it).
        setup: the run's memory setup in its CPU form (`choosing.setup_from_recipe(recipe, device="cpu")`).
        eval_batch: the evaluation batch the run starts with (for the start record's eval prediction).
        ddp: one of several processes (`train --gpus N` on the CPU is DDP): the trainer's gradient average.
    """

    arch: Architecture | None
    setup: Setup
    eval_batch: int = 1
    ddp: bool = False
    method: str = "sft"  # training.method: a preference step's reference pass (lowmem_ft.memory.preference)
    reference: str = "none"  # the reference model a preference run uses (`memory.preference.ReferenceKind`)
    # objects whose tensors are the run's besides the model's and the optimizer's (a DPO reference copy)
    extra_roots: list = field(default_factory=list)
    grpo: Any = None  # a GRPO run's round (`memory.grpo.GrpoShape`, P = the data's longest prompt); None otherwise
    paused: bool = False  # inside GRPO's generation and scoring: their forwards are not training forwards
    # image chats: bytes of the collator's pixel values still alive (`lowmem_ft.vision.data.VisionCollator`)
    pixels_held: Any = None
    _meter: PeakMemory | None = field(default=None, init=False, repr=False)
    _hooks: list = field(default_factory=list, init=False, repr=False)
    _cache: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self):
        if self.setup.device != "cpu":
            raise ValueError("ExactMemory compares with the CPU form of the memory model (Setup.device='cpu')")
        self._train: tuple[int, int] | None = None  # rows × tokens of the last training forward
        self._labelled: int | None = None  # ... and its labelled positions (the chunked loss's `loss_tokens`)
        self._patches: int | None = None  # ... and its tower's patches (image chats)
        self._eval: tuple[int, int] | None = None  # ... and of the last evaluation forward
        self._grads = False  # gradients alive when the last training forward began
        self._states = False  # optimizer states alive when the last forward began
        self._checkpointing = self.setup.gradient_checkpointing
        self._trainable: list = []
        self._optimizer = None
        self._base = None
        self._round: tuple[int, int, int] | None = None  # GRPO: rows, prompt width, completion width that ran

    @classmethod
    def for_recipe(cls, recipe, eval_batch: int, processes: int = 1, config=None, prompt_len: int = 0) -> ExactMemory:
        """The CPU form of `recipe`'s setup, with the architecture the planner reads (config.json), else that of the
        loaded model's `config` (a Hub model read from the cache while offline)."""
        from lowmem_ft.choosing import setup_from_recipe
        from lowmem_ft.memory.arch import load_architecture

        try:
            arch = load_architecture(recipe.model.name_or_path, recipe.model.trust_remote_code)
        except UserError as exc:
            arch = None
            with contextlib.suppress(UserError):
                arch = Architecture.from_config(config.to_dict(), recipe.model.name_or_path) if config else None
            if arch is None:  # a model the memory model cannot describe: measured, not predicted
                log.warning("memory: measuring without a prediction (%s)", exc)
        method = recipe.training.method
        planned = planning(method)
        # On the CPU nothing is offloaded (`lowmem_ft.train.model._offload`: no accelerator), so the checkpointed layer
        # inputs a CUDA plan keeps in host memory are live here: predicted as such (the trace found the CPU form of
        # an offloading plan 10 % under its forward: Llama-3.1-8B at 24 GB, 2.2 GB of layer inputs).
        setup = planned.setup(replace(setup_from_recipe(recipe, device="cpu"), activation_offloading=False))
        if planned.rounds:
            from lowmem_ft.choosing import grpo_shape

            shape = grpo_shape(recipe, prompt_len)
            return cls(arch, setup, eval_batch, ddp=processes > 1, method=method, grpo=shape)
        if not planned.preference_step:
            return cls(arch, setup, eval_batch, ddp=processes > 1)
        from lowmem_ft.memory.preference import reference_kind

        # a preference micro batch of B pairs runs 2·B rows (the CPU form speaks rows, as the monitor sees them)
        reference = reference_kind(method, recipe.adapter.kind, recipe.preference.reference)
        return cls(
            arch,
            setup,
            planned.rows_per_sample * eval_batch,
            ddp=processes > 1,
            method=method,
            reference=reference,
        )

    # -- the plan's batch -----------------------------------------------------------------------------------------
    def start_fields(self) -> dict[str, Any]:
        """For memory.jsonl's start record: the CPU form's peak and phase peaks for the plan's batch (GB)."""
        if self.arch is None:
            return {"exact": True, "predicted_cpu_peak_gb": None}
        s = self.setup
        if self.grpo is not None:
            from lowmem_ft.memory.grpo import phase_peaks

            peaks = phase_peaks(self.arch, s, self.grpo)
            return {
                "exact": True,
                "predicted_cpu_peak_gb": round(max(peaks.values()) / GB, 6),
                "predicted_cpu_phases_gb": {p: round(b / GB, 6) for p, b in peaks.items()},
                "predicted_cpu_batch": [s.micro_batch_size, self.grpo.prompt_len + self.grpo.completion_len],
            }
        phases = {p: self._phase(s, p) for p in ("forward", "backward", "optimizer step")}
        phases["eval"] = phase_peak_bytes(self.arch, replace(s, micro_batch_size=self.eval_batch), "eval")
        return {
            "exact": True,
            "predicted_cpu_peak_gb": round(estimate(self.arch, s).model_peak_bytes / GB, 6),
            "predicted_cpu_phases_gb": {p: round(b / GB, 6) for p, b in phases.items()},
            "predicted_cpu_batch": [s.micro_batch_size, s.max_seq_len],
        }

    # -- measuring ------------------------------------------------------------------------------------------------
    def start(self, model, optimizer=None) -> None:
        """Count from now: the tensors `model` and `optimizer` hold, and every tensor created until `stop`."""
        if self._meter is not None:
            return
        self._base = model.get_base_model() if hasattr(model, "get_base_model") else model
        self._trainable = [p for p in model.parameters() if p.requires_grad]
        self._optimizer = optimizer
        # The run's own tensors only (not those of an earlier run in the same process); the optimizer's states,
        # not the optimizer object (bitsandbytes' process-wide GlobalOptimManager hangs off it).
        roots = [model, *self.extra_roots] + ([optimizer.state] if optimizer is not None else [])
        self._meter = PeakMemory(device="cpu", roots=roots)
        self._meter.__enter__()
        self._hooks.append(model.register_forward_pre_hook(self._before_forward, with_kwargs=True))

    def stop(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self._meter is not None:
            self._meter.__exit__(None, None, None)
            self._meter = None

    def _before_forward(self, module, args, kwargs) -> None:
        import torch

        if self.paused:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if ids is None:
            return
        if module.training and not torch.is_grad_enabled():
            # a no-grad pass inside a training step (DPO's reference log-probs, TRL disabling checkpointing for it):
            # the step's batch and setup are the training forward's
            return
        batch = (int(ids.shape[0]), int(ids.shape[1]))
        self._states = self._optimizer is not None and len(self._optimizer.state) > 0
        if not module.training:
            self._eval = batch
            return
        self._train = batch
        pixels = kwargs.get("pixel_values")  # image chats: the patches the tower runs on (memory.tower)
        tower = self.arch.vision if self.arch is not None else None  # its patches: Qwen-VL rows, SigLIP crops × n²
        self._patches = int(pixels.numel()) // tower.patch_values if pixels is not None and tower else None
        self._labelled = labelled_positions(kwargs) if self.setup.loss_impl == "chunked" else None
        self._grads = any(p.grad is not None for p in self._trainable)
        checkpointing = getattr(self._base, "is_activation_checkpointing", None)
        if isinstance(checkpointing, bool):
            self._checkpointing = checkpointing

    def read(self, phase: str) -> dict[str, Any]:
        """This sample's exact figures (GB), its batch and the prediction of `peak_live_gb` for its phase."""
        if self._meter is None:
            return {}
        live, peak = self._meter.window()
        out: dict[str, Any] = {"live_gb": round(live / GB, 6), "peak_live_gb": round(peak / GB, 6)}
        if self.grpo is not None:
            return out | self._grpo_read(phase)
        what = PREDICTED.get(phase)
        batch = self._eval if what == "eval" else self._train
        if what is None or batch is None:
            return out
        if what != "optimizer step":
            out["batch"] = list(batch)
        if self.arch is not None:
            # Image chats: the memory model counts the pixel values of the held micro batches at this batch's
            # patches (`memory.tower.pixel_values_bytes`); the batches held — every micro batch of the optimizer
            # step (transformers' Trainer collates them all before the first, `get_batch_samples`) and the one
            # accelerate's loader collated ahead — differ in their images, so that term is replaced by the pixel
            # values the collator made that are still alive, read like the batch's rows × tokens from the batches
            # as they are. Found by this exact count: a tiny Qwen2.5-VL run's optimizer phase was 144 patch rows ×
            # 4,704 B over without them.
            pixels = 0.0
            if self.pixels_held is not None and what != "eval":
                pixels = (self.pixels_held() - self._pixels_modelled(what, batch)) / GB
            out["predicted_peak_live_gb"] = round(self._predict(what, batch) + pixels, 6)
        return out

    # -- GRPO ---------------------------------------------------------------------------------------------------
    def round_shape(self, rows: int, prompt_len: int, completion_len: int) -> None:
        """The round just generated: its rows and the widths its tensors are padded to (`lowmem_ft.train.methods.grpo`)."""
        self._round = (rows, prompt_len, completion_len)

    def _grpo_read(self, phase: str) -> dict[str, Any]:
        """A GRPO sample's batch and prediction: `memory.grpo.phase_peaks` for the round that ran, the training
        micro-step's rows as they ran (a guard's piece keeps the round's rows)."""
        what = GRPO_PHASES.get(phase)
        if what is None or self._round is None:
            return {}
        rows, p, c = self._round
        b = self._train[0] if self._train is not None and what in ("forward", "backward") else None
        out: dict[str, Any] = {"batch": [b or rows, p + c]} if what != "optimizer step" else {}
        if self.arch is None:
            return out
        b = b or self.setup.micro_batch_size
        states = self._optimizer is not None and len(self._optimizer.state) > 0
        key = ("grpo", what, b, rows, p, c, states, self._checkpointing)
        if key not in self._cache:
            from lowmem_ft.memory.grpo import phase_peaks

            shape = replace(self.grpo, prompt_len=p, completion_len=c, steps_per_generation=max(1, rows // b))
            s = replace(self.setup, micro_batch_size=b, gradient_checkpointing=self._checkpointing)
            peaks = phase_peaks(self.arch, s, shape, states=states)
            if self.ddp and what == "optimizer step":  # the trainer's flat all-reduce copy of the gradients
                from lowmem_ft.memory.grpo import training_setup

                ts = training_setup(s, shape)
                peaks[what] += phase_peak_bytes(self.arch, ts, what, ddp=True) - phase_peak_bytes(self.arch, ts, what)
            self._cache[key] = round(peaks[what] / GB, 6) if what in peaks else None
        if self._cache[key] is not None:
            out["predicted_peak_live_gb"] = self._cache[key]
        return out

    def _pixels_modelled(self, what: RunPhase, batch: tuple[int, int]) -> float:
        """The memory model's pixel values for this batch (`_predict`'s setup), which `read` replaces."""
        from lowmem_ft.memory.tower import pixel_values_bytes

        rows, tokens = batch
        s = replace(self.setup, micro_batch_size=rows, max_seq_len=tokens, batch_patches=self._patches or 0)
        return pixel_values_bytes(self.arch, s)

    def _predict(self, what: RunPhase, batch: tuple[int, int]) -> float:
        # the backward of a micro batch begun without gradients creates them as it goes (`Estimate.first_micro_batch`)
        grads = self._grads if what in ("forward", "backward") else what != "eval"
        states = self._states or what == "optimizer step"
        labelled = None if what == "eval" else self._labelled
        patches = 0 if what == "eval" else self._patches or 0
        key = (what, batch, labelled, patches, grads, states, self._checkpointing)
        if key not in self._cache:
            rows, tokens = batch
            s = replace(
                self.setup,
                micro_batch_size=rows,
                max_seq_len=tokens,
                loss_tokens=labelled,
                batch_patches=patches,
                gradient_checkpointing=key[-1],
            )
            b = self._phase(s, what, grads=grads, states=states)
            self._cache[key] = round(b / GB, 6)
        return self._cache[key]

    def phase_bytes(self, phase: RunPhase | str, batch: tuple[int, int]) -> float:
        """The CPU peak of `phase` ("static" too) in the steady state (gradients and optimizer states alive) for a
        forward of `batch` = (rows, tokens): what the preference accuracy grid compares with (devkit/harness)."""
        rows, tokens = batch
        return self._phase(replace(self.setup, micro_batch_size=rows, max_seq_len=tokens), phase)  # type: ignore[arg-type]

    def _phase(self, s: Setup, what: RunPhase, grads: bool = True, states: bool = True) -> float:
        """The memory model's CPU phase peak: SFT's, or a preference step's with its reference pass."""
        if not planning(self.method).preference_step or what == "eval":
            return phase_peak_bytes(self.arch, s, what, grads=grads, states=states, ddp=self.ddp)
        from lowmem_ft.memory import preference

        return preference.phase_peak(
            self.arch, s, what, method=self.method, reference=self.reference,  # type: ignore[arg-type]
            grads=grads, states=states, ddp=self.ddp,
        )  # fmt: skip


def labelled_positions(kwargs: dict) -> int | None:
    """The positions a forward's loss is taken on: `shift_labels` ≠ -100, else `labels[:, 1:]` ≠ -100 (the shift
    `lowmem_ft.train.losses.token_log_probs` applies); None without labels (every position, the upper bound)."""
    from lowmem_ft.data.chat import IGNORE  # the label masks' -100, as `lowmem_ft.train.losses` reads them

    shifted = kwargs.get("shift_labels")
    if shifted is None:
        labels = kwargs.get("labels")
        if labels is None:
            return None
        shifted = labels[..., 1:]
    return int((shifted != IGNORE).sum())
