"""The planner: the fastest setup whose predicted peak fits the budget (pure arithmetic over `Setup`; no recipe, no torch).

One idea: every memory saving costs speed, so search the knobs (quantization, optimizer, checkpointing, activation
offloading, chunked loss, micro batch with gradient accumulation keeping the effective batch) as variants of the
frozen `Setup` (`dataclasses.replace`) and keep the fitting variant with the lowest estimated time per sample.

The long-context savers (host embeddings, tiled norms, tiled MLP, LoRA recompute, and the MLP tile size;
`lowmem_ft.memory.long_context`) are a staged search on top: only when no setup fits without them, sets of them are
added in order of cost — each set searched like the start — and the first set where something fits wins, so every
saver a plan turns on is needed. With the chunked loss chosen, its chunk is then sized from what the rest of the step
leaves of the budget.

A `Request` says where the search starts (a tier recipe's setup, mapped by `lowmem_ft.choosing`), the `Target` it must
fit, and which knobs the user fixed (`Setup` field names, plus "gradient_accumulation" and "eval_batch_size"): those
are never changed. The answer is a `Plan` record. Sequence length is the request's: choosing it from the data, and
shortening it when the data's length cannot fit, is `lowmem_ft.choosing`'s job (`max_seq_len` here finds the limit).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from lowmem_ft.errors import UserError
from lowmem_ft.memory import long_context, preference
from lowmem_ft.memory.arch import Architecture
from lowmem_ft.memory.estimate import GB, Estimate, Setup, loss_chunk_tokens, mlp_tile_tokens
from lowmem_ft.memory.host import host_need_gb, host_over
from lowmem_ft.memory.lengths import MAX_SEQ_LEN, SEQ_MULTIPLE, longest_length
from lowmem_ft.memory.long_context import LOSS_CHUNK_MIN, SAVER_COST, SAVERS
from lowmem_ft.memory.reasons import choose_eval_batch, frozen_experts_note, knob_reasons, partial_targets_note
from lowmem_ft.memory.savers import LONG_CONTEXT_SAVERS
from lowmem_ft.memory.sharding import (
    OFFLOAD_OPTIMIZERS,
    DeviceShare,
    Requested,
    _stages,
    _strategy_reason,
    per_device_estimate,
)
from lowmem_ft.memory.target import Target

# Relative step-time cost of each saving, used only to rank configurations (a setup's cost is their product).
# Rough, from published comparisons: checkpointing recomputes the forward (≈ +1/3 of a step: forward ≈ 1/3 of
# forward+backward); NF4 dequantizes every linear in forward and backward (QLoRA paper / bnb benchmarks: ~1.3× a
# 16-bit LoRA step at batch 1); offloading copies each layer input to host and back (≈ +10 % where the copy does not
# fully overlap); the chunked loss recomputes the head projection per chunk in backward (≈ +5 %). The long-context
# savers': CPU step-time ratios (`savers.Saver.cost`; the comment above the savers says where they come from).
COST = {"checkpointing": 1.33, "nf4": 1.3, "int8": 1.5, "offloading": 1.10, "chunked_loss": 1.05, **SAVER_COST}
# What the planner may change when the user did not fix it.
KNOBS = frozenset(
    {
        "quantization",
        "optimizer",
        "gradient_checkpointing",
        "activation_offloading",
        "loss_impl",
        "micro_batch_size",
        "gradient_accumulation",
        "eval_batch_size",
        "lora_targets",
        "loss_chunk_tokens",
        *SAVERS,
        "mlp_tile_tokens",
    }
)
STORAGE = {"nf4": "NF4", "int8": "int8", "none": "16-bit weights"}


@dataclass(frozen=True)
class Request:
    """What to plan: the starting setup, the target, and what the user fixed.

    `gradient_accumulation` is the start's; with the start's micro batch and the device count it defines the
    effective batch the planner keeps. `eval_batch_size` is the user's (0: the planner chooses). `fixed` holds the
    names of the knobs the user set (`Setup` fields, "gradient_accumulation", "eval_batch_size"). `length_reason`
    says why the start's `max_seq_len` was chosen (the plan's reason line for it).
    """

    start: Setup
    target: Target
    gradient_accumulation: int = 1
    eval_batch_size: int = 0
    fixed: frozenset[str] = frozenset()
    strategy: Requested = "auto"
    offload: bool | None = None
    length_reason: str = ""
    method: str = "sft"  # training.method: a preference step's terms (`memory.preference.method_estimate`)
    reference: str = "auto"  # preference.reference
    # the method whose TRL trainer computes the loss (GRPO, the preference methods): loss_impl is kept as the recipe
    # has it (in `fixed`, though the user did not set it) and its reason line says why; "" for SFT
    loss_by: str = ""

    @property
    def effective_batch(self) -> int:
        return self.start.micro_batch_size * self.gradient_accumulation * self.target.gpus


@dataclass(frozen=True)
class Plan:
    """The planner's answer: the setup, its estimate against the target, and why each knob is what it is."""

    setup: Setup
    estimate: Estimate
    target: Target
    gradient_accumulation: int
    eval_batch_size: int
    reasons: Mapping[str, str] = field(default_factory=dict)
    strategy: str = "single"  # single (one device) | ddp | fsdp | zero2 | zero3
    offload: bool = False
    share: DeviceShare | None = None  # the per-device split of the model states (gpus > 1)
    changeable: frozenset[str] = frozenset()  # the knobs the planner was allowed to change

    def __post_init__(self):  # a calibration of this GPU (or why a stale one is ignored) is a reason of every plan
        if (t := self.target).calibration and "safety_margin_gb" not in self.reasons:
            added = f" + {t.calibration_gb:.2f} GB" if t.calibration_gb else ""
            why = f"{t.margin_gb:g} GB (memory.safety_margin_gb){added}; {t.calibration}"
            object.__setattr__(self, "reasons", {**self.reasons, "safety_margin_gb": why})

    @property
    def vram_gb(self) -> float:
        return self.target.vram_gb

    @property
    def margin_gb(self) -> float:
        return self.target.margin_gb

    @property
    def budget_gb(self) -> float:
        return self.target.budget_gb

    @property
    def gpus(self) -> int:
        return self.target.gpus

    @property
    def headroom_gb(self) -> float:
        return self.budget_gb - self.estimate.peak_gb

    @property
    def fits(self) -> bool:
        return self.headroom_gb >= 0 and self.host_fits

    @property
    def host_need_gb(self) -> float:
        """Host RAM the plan keeps on one machine: the `host_gb` of each of its processes (`Target.node_gpus`)."""
        return host_need_gb(self.estimate, self.target.node_gpus)

    @property
    def host_fits(self) -> bool:
        return self.host_need_gb <= self.target.host_budget_gb

    def unfit_reason(self) -> str:
        """Why the plan does not fit (device, host RAM, or both), in words; "" when it fits."""
        why = []
        if self.headroom_gb < 0:
            why.append(
                f"predicted peak {self.estimate.peak_gb:.2f} GB over the budget of {self.budget_gb:.2f} GB "
                f"(--vram {self.vram_gb:g} − margin {self.margin_gb + self.target.calibration_gb:g})"
            )
        if not self.host_fits:
            why.append(host_over(self.estimate, self.target))
        return "; ".join(why)

    @property
    def effective_batch(self) -> int:
        return self.setup.micro_batch_size * self.gradient_accumulation * self.gpus

    @property
    def host_gb(self) -> float:
        """Host memory the plan's setup keeps per process: offloaded layer inputs (pinned), input embeddings on the
        host, paged optimizer states when evicted, offloaded model states (the estimate's "host" components)."""
        return sum(c.bytes for c in self.estimate.components if c.phase == "host") / GB

    def to_dict(self) -> dict[str, Any]:
        """What `plan --json` prints and `plan.json` holds (with the model and recipe `lowmem_ft.choosing` adds);
        `host_fits` where host RAM is a limit, `unfit_reason` where the plan does not fit."""
        host_limit = self.target.host_ram_gb is not None
        return {
            **self.target.to_dict(),
            "headroom_gb": round(self.headroom_gb, 3),
            "fits": self.fits,
            **({} if self.fits else {"unfit_reason": self.unfit_reason()}),
            "host_gb": round(self.host_gb, 3),
            **({"host_need_gb": round(self.host_need_gb, 3), "host_fits": self.host_fits} if host_limit else {}),
            "strategy": self.strategy,
            "offload": self.offload,
            **({"per_device": _share_dict(self.share)} if self.share is not None else {}),
            **self.estimate.to_dict(),
            "gradient_accumulation": self.gradient_accumulation,
            "eval_batch_size": self.eval_batch_size,
            "reasons": dict(self.reasons),
            "notes": self.estimate.notes,
            "changeable": sorted(self.changeable),
        }


def _share_dict(share: DeviceShare) -> dict[str, Any]:
    """Per-device GB of each kind of model state (estimate components say the same, named for the table)."""
    keys = ("weights", "gradients", "optimizer", "gathered", "comm_buffers", "activations", "host")
    out: dict[str, Any] = {f"{k}_gb": round(getattr(share, k) / GB, 4) for k in keys}
    return {**out, "offload_optimizer": share.offload_optimizer, "offload_params": share.offload_params}


def check(arch: Architecture, request: Request) -> Plan:
    """The estimate of a setup as given (for `--recipe R --vram N`): with several devices, the first strategy stage
    that fits (else the last one tried)."""
    s, target = request.start, request.target
    _refuse_chunked_loss(arch, s)
    common = dict(
        gradient_accumulation=request.gradient_accumulation,
        eval_batch_size=request.eval_batch_size,
        changeable=frozenset(),
    )
    if target.gpus == 1:
        return Plan(
            s, _estimate(arch, request, s, "single", False)[0], target, reasons={"recipe": "as given"}, **common
        )
    tried = []
    for strat, off in _stages(request.strategy, bool(request.offload), s.optimizer, s.quantization):
        est, share = _estimate(arch, request, s, strat, off)
        tried.append((strat, off, est, share))
        if est.peak_gb <= target.budget_gb:
            break
    strat, off, est, share = tried[-1]
    why = _strategy_reason(strat, off, request.strategy, target.gpus, tried, target.budget_gb, s.quantization)
    return Plan(s, est, target, reasons={"recipe": "as given", "strategy": why}, strategy=strat, offload=off,
                share=share, **common)  # fmt: skip


# -- the search --------------------------------------------------------------------------------------------------
def _refuse_chunked_loss(arch: Architecture, s: Setup) -> None:
    """A setup with `memory.chunked_loss` on a model whose loss it does not reproduce is refused (one line)."""
    if s.loss_impl == "chunked" and not arch.chunked_loss_exact:
        raise UserError(arch.chunked_loss_refusal)


def _options(
    start: Setup, fixed: frozenset[str], arch: Architecture, step: int = 1, least: int = 1
) -> dict[str, list[Any]]:
    """Values to try per knob; a knob the user fixed keeps its value. The chunked loss is tried only where it
    reproduces the model's own loss (`Architecture.chunked_loss_exact`). Micro batches are multiples of `step` rows
    (2: whole pairs, `memory.preference.rows_per_micro_batch`) and at least `least` rows (KTO's 2,
    `memory.preference.least_rows`)."""
    b0 = max(start.micro_batch_size, least) if "micro_batch_size" not in fixed else start.micro_batch_size
    # the model's own loss over full logits is a choice of how the loss is computed, not a saver: kept
    losses = ["trl_fused", "chunked"] if arch.chunked_loss_exact else ["trl_fused"]
    options: dict[str, list[Any]] = {
        "quantization": ["none"]
        if start.adapter == "full"
        else list(dict.fromkeys(["none", start.quantization, "nf4"])),
        "optimizer": list(dict.fromkeys([start.optimizer, "paged_adamw_8bit"])),
        "gradient_checkpointing": [False, True],
        "activation_offloading": [False, True],
        "loss_impl": ["hf_full"] if start.loss_impl == "hf_full" else losses,
        "micro_batch_size": sorted(
            {b for b in (b0 * 2, b0, 8, 4, 2, 1) if least <= b <= max(b0 * 2, 1) and b % step == 0}
        ),
    }
    return {key: [getattr(start, key)] if key in fixed else values for key, values in options.items()}


def _candidates(start: Setup, fixed: frozenset[str], arch: Architecture, step: int = 1, least: int = 1) -> list[Setup]:
    options = _options(start, fixed, arch, step, least)
    out = []
    for values in itertools.product(*options.values()):
        knobs = dict(zip(options, values, strict=True))
        if knobs["activation_offloading"] and not knobs["gradient_checkpointing"]:
            continue  # offloading moves checkpointed inputs: it needs checkpointing
        out.append(replace(start, **knobs))
    return out


def _cost(s: Setup) -> float:
    """Estimated time per sample relative to a 16-bit, no-savings step at large batch."""
    cost = COST.get(s.quantization, 1.0)
    for on, name in (
        (s.gradient_checkpointing, "checkpointing"),
        (s.activation_offloading, "offloading"),
        (s.loss_impl == "chunked", "chunked_loss"),
        *((getattr(s, saver), saver) for saver in SAVERS),
    ):
        if on:
            cost *= COST[name]
    # small micro batches under-use the GPU: per-sample time ∝ 1 + 1/(2b) (a saturating curve, used for ranking)
    return cost * (1 + 1 / (2 * s.micro_batch_size))


def _accumulation(request: Request, micro_batch: int) -> int:
    """The fixed accumulation, else the one that keeps the request's effective batch."""
    if "gradient_accumulation" in request.fixed:
        return request.gradient_accumulation
    return max(1, math.ceil(request.effective_batch / (micro_batch * request.target.gpus)))


@dataclass(frozen=True)
class _Scored:
    cost: float
    setup: Setup
    estimate: Estimate
    share: DeviceShare | None

    @property
    def peak_gb(self) -> float:
        return self.estimate.peak_gb

    def fits(self, target: Target) -> bool:
        """Under the device budget, and within the host RAM budget (`host_need_gb`) where that is a limit."""
        return (
            self.peak_gb <= target.budget_gb and host_need_gb(self.estimate, target.node_gpus) <= target.host_budget_gb
        )


def _estimate(arch: Architecture, request: Request, s: Setup, strat: str, off: bool):
    """One device's estimate of `s`, with the request's preference method's own terms (reference pass and copy)."""
    est, share = per_device_estimate(arch, s, request.target.gpus, strat, off)
    return preference.method_estimate(arch, est, request.method, request.reference, share), share  # type: ignore[arg-type]


def _score(arch: Architecture, request: Request, s: Setup, strat: str, off: bool) -> _Scored:
    s = replace(s, gradient_accumulation=_accumulation(request, s.micro_batch_size))
    return _Scored(_cost(s), s, *_estimate(arch, request, s, strat, off))


def _runnable(s: Setup, strat: str, off: bool) -> bool:
    """Whether a setup can run under a strategy stage: int8 weights cannot be sharded (no float storage to flatten),
    an offloaded optimizer steps on the host (a torch optimizer)."""
    return not (strat not in ("single", "ddp") and s.quantization == "int8") and not (
        off and s.optimizer not in OFFLOAD_OPTIMIZERS
    )


def _micro_batch_rows(request: Request) -> tuple[int, int]:
    """The method's micro batch in rows: the step (2 per pair) and the least its trainer accepts (KTO's 2)."""
    return preference.rows_per_micro_batch(request.method, 1), preference.least_rows(request.method)  # type: ignore[arg-type]


def _score_stage(arch: Architecture, request: Request, start: Setup, strat: str, off: bool) -> list[_Scored]:
    return [
        _score(arch, request, s, strat, off)
        for s in _candidates(start, request.fixed, arch, *_micro_batch_rows(request))
        if _runnable(s, strat, off)
    ]


# -- the long-context savers: a staged search (lowmem_ft.memory.long_context) ---------------------------------
def _stage_start(request: Request, off: bool, savers: dict[str, Any], first: bool) -> Setup:
    """Where a stage's search starts: the request's setup with the stage's savers; an offloaded optimizer is a torch
    one; beyond the first stage the loss chunk is the smallest (`LOSS_CHUNK_MIN`) unless fixed — it is sized from
    the budget once a setup is chosen (`_size_loss_chunk`)."""
    start = request.start
    if off and "optimizer" not in request.fixed:  # the host steps the optimizer: a torch optimizer (bnb's are CUDA)
        start = replace(start, optimizer="adamw_torch")
    if first:
        return start
    start = replace(start, **savers)
    return start if "loss_chunk_tokens" in request.fixed else replace(start, loss_chunk_tokens=LOSS_CHUNK_MIN)


def _smallest(arch: Architecture, request: Request, start: Setup, strat: str, off: bool) -> Setup | None:
    """The stage's setup with each knob at its least memory (NF4, paged 8-bit states, checkpointing with offloading,
    the smaller loss, the smallest micro batch — as far as the user's fixed knobs and the strategy allow), None when
    none runs. A saver stage whose smallest setup does not fit is skipped after this one estimate: each of these
    values lowers the predicted peak on its own, so no other setup of the stage would fit."""
    options = _options(start, request.fixed, arch, *_micro_batch_rows(request))

    def least(key: str, order: tuple[Any, ...]) -> Any:
        return next((value for value in order if value in options[key]), options[key][0])

    optimizers = [o for o in options["optimizer"] if o in OFFLOAD_OPTIMIZERS] if off else options["optimizer"]
    checkpointing = least("gradient_checkpointing", (True,))
    s = replace(
        start,
        quantization=least("quantization", ("nf4", "int8") if strat in ("single", "ddp") else ("nf4",)),
        optimizer=next((o for o in ("paged_adamw_8bit", *optimizers) if o in optimizers), start.optimizer),
        gradient_checkpointing=checkpointing,
        activation_offloading=checkpointing and least("activation_offloading", (True,)),
        micro_batch_size=min(options["micro_batch_size"]),
    )
    # the chunked loss keeps ~15 B per token more than TRL's fused head (its targets and statistics): where the
    # loss does not set the peak (full fine-tuning at long lengths) the fused head is the smaller
    losses = [replace(s, loss_impl=impl) for impl in options["loss_impl"]]
    s = min(losses, key=lambda x: _score(arch, request, x, strat, off).estimate.peak_bytes)
    return s if _runnable(s, strat, off) else None


def _search_order(arch: Architecture, request: Request, stages: list) -> list[tuple[str, bool, dict, bool]]:
    """(strategy, offload, savers, first) in the order searched: every strategy stage with the start's savers (the
    search as it was before the long-context savers, so its choices stay), then each strategy stage with the saver
    stages in cost order — a cheaper strategy with savers before a dearer one."""
    savers = long_context.saver_stages(arch, request.start, request.fixed, request.target.gpus)
    return [(st, off, savers[0], True) for st, off in stages] + [
        (st, off, knobs, False) for st, off in stages for knobs in savers[1:]
    ]


def _lora_targets(arch: Architecture, request: Request) -> tuple[Request, str]:
    """The request with LoRA on every linear when the start's target names match none of this model's."""
    s = request.start
    if s.adapter != "lora":
        return request, ""
    adapted = arch.adapter_modules(list(s.lora_targets))
    if adapted:
        return request, partial_targets_note(arch, s.lora_targets, adapted) + frozen_experts_note(arch)
    if "lora_targets" in request.fixed:
        raise UserError(
            f"adapter.target_modules {list(s.lora_targets)} match no linear layer of {arch.name}; "
            f"its linears are {', '.join(arch.linear_names)}"
        )
    why = f"; targets all linear layers ({', '.join(arch.linear_names)}): the recipe's names are absent"
    return replace(request, start=replace(s, lora_targets=("all-linear",))), why


def plan(arch: Architecture, request: Request, hint: bool = True) -> Plan:
    """The fastest setup starting from `request.start` whose predicted peak fits the target's budget.

    With several devices the peak is per device, and the strategy stages (`STAGES[request.strategy]`) are tried in
    order: the first stage where some setup fits wins, so DDP is kept whenever the model fits whole on each device.
    `request.offload` None lets the planner offload as a last stage; True/False fixes it. Only when no stage fits
    with the start's savers are the long-context savers added (`_search_order`). Raises UserError with the smallest
    setup's need and what would fit when nothing does (`hint`: with the longest length that would — a search of its
    own, which the searches for a length turn off).

    Host RAM is a limit too where the target has one: a setup that fits the device but keeps more in host RAM
    (offloaded layer inputs, host embeddings, paged or offloaded states) than the host budget does not fit.
    """
    gpus, budget = request.target.gpus, request.target.budget_gb
    request, target_reason, stages = _prepare(arch, request)
    tried: dict[tuple[str, bool], _Scored] = {}  # the smallest setup seen per strategy stage, for the reason line
    last: list[_Scored] = []
    host_blocked: list[_Scored] = []  # setups that fit the device but not the host RAM
    for strat, off, savers, first in _search_order(arch, request, stages):
        start = _stage_start(request, off, savers, first)
        if not first:
            smallest = _smallest(arch, request, start, strat, off)
            if smallest is not None:
                last = [_score(arch, request, smallest, strat, off)]
                tried[(strat, off)] = last[0]
                if last[0].peak_gb > budget:
                    continue
        scored = _score_stage(arch, request, start, strat, off)
        if not scored:
            continue
        last = scored
        tried[(strat, off)] = min(scored, key=lambda x: x.peak_gb)
        fitting = [x for x in scored if x.fits(request.target)]
        if not fitting:
            host_blocked += [x for x in scored if x.peak_gb <= budget]
            continue
        # Offloaded weights and states cross PCIe every step, which dwarfs the other costs: fewest host bytes first.
        fitting.sort(key=lambda x: (x.share.host if off else 0.0, x.cost, x.peak_gb))
        if gpus > 1:
            tried[(strat, off)] = fitting[0]
        return _plan_of(arch, request, fitting, strat, off, _tried(tried, stages, (strat, off)), target_reason)
    if not tried:
        raise UserError(f"--strategy {request.strategy}: no configuration of {arch.name or 'the model'} can use it")
    if host_blocked:
        raise UserError(_host_refusal(arch, request, host_blocked, hint))
    stage = ""
    if gpus > 1:
        strategies = _tried(tried, stages, None)
        q = request.start.quantization
        why = _strategy_reason(*strategies[-1][:2], request.strategy, gpus, strategies, budget, q)
        stage = f" per device with {why}"
    raise UserError(_nothing_fits(arch, request, last) + stage + _what_fits_instead(arch, request))


def _prepare(arch: Architecture, request: Request) -> tuple[Request, str, list[tuple[str, bool]]]:
    """The request as searched (LoRA targets this model has), the adapter reason's addition, and the strategy
    stages; refuses a chunked loss the user fixed on a model it does not reproduce, and a device count below one."""
    if request.target.gpus < 1:
        raise UserError(f"--gpus {request.target.gpus}: must be at least 1")
    request, target_reason = _lora_targets(arch, request)
    fixed = request.fixed
    if "loss_impl" in fixed:
        _refuse_chunked_loss(arch, request.start)
    if request.target.gpus == 1:
        return request, target_reason, [("single", False)]
    stages = _stages(
        request.strategy,
        request.offload,
        request.start.optimizer if "optimizer" in fixed else None,
        request.start.quantization if "quantization" in fixed else None,
    )
    return request, target_reason, stages


def _tried(tried: dict, stages: list, upto: tuple[str, bool] | None) -> list:
    """(strategy, offload, estimate, share) of each strategy stage tried, in stage order, up to `upto`."""
    out = []
    for stage in stages:
        if stage in tried:
            out.append((*stage, tried[stage].estimate, tried[stage].share))
        if stage == upto:
            break
    return out


def _plan_of(arch, request: Request, fitting: list[_Scored], strat, off, tried, target_reason) -> Plan:
    """The Plan record of the chosen setup (the first of `fitting`, its loss chunk then sized from the budget), with
    a reason per knob."""
    gpus = request.target.gpus
    best, chunk_reason = _size_loss_chunk(arch, request, fitting[0], strat, off)
    s = best.setup
    accumulation = _accumulation(request, s.micro_batch_size)
    eval_batch, eval_reason = choose_eval_batch(arch, request, s)
    fits_16bit = any(x.setup.quantization == "none" for x in fitting)
    savers = long_context.saver_reasons(
        arch,
        fitting[0].setup,
        request.start,
        request.fixed,
        gpus,
        request.target.budget_gb,
        _scorer(arch, request, strat, off),
    )
    savers["loss_chunk_tokens"] = chunk_reason
    reasons = knob_reasons(request, s, accumulation, fits_16bit, savers)
    reasons["adapter"] += target_reason
    if not arch.chunked_loss_exact and "loss_impl" not in request.fixed:
        reasons["chunked_loss"] = f"off: not verified for model_type {arch.model_type!r} (its loss may differ)"
    if off and "optimizer" not in request.fixed:
        reasons["optimizer"] = f"{s.optimizer}: offloaded states step on the host (bnb's need CUDA)"
    reasons["eval_batch_size"] = eval_reason
    if gpus > 1:
        budget = request.target.budget_gb
        reasons["strategy"] = _strategy_reason(strat, off, request.strategy, gpus, tried, budget, s.quantization)
        reasons["micro_batch_size"] += (
            f" per device; × {gpus} devices = {s.micro_batch_size * accumulation * gpus} per optimizer step"
        )
    return Plan(
        s,
        best.estimate,
        request.target,
        accumulation,
        eval_batch,
        reasons,
        strat,
        off,
        best.share,
        changeable=KNOBS - request.fixed,
    )


def _scorer(arch: Architecture, request: Request, strat: str, off: bool) -> long_context.Score:
    return lambda s: _score(arch, request, s, strat, off)


def _size_loss_chunk(arch: Architecture, request: Request, best: _Scored, strat: str, off: bool) -> tuple[_Scored, str]:
    """`best` with its loss chunk sized from the budget (`long_context.size_loss_chunk`), unless the user fixed it
    or the loss is not chunked; and the chunk's reason line."""
    s = best.setup
    if s.loss_impl != "chunked":
        if "loss_chunk_tokens" in request.fixed:
            return best, "set by you (--set); unused: the chunked loss is off"
        unchunked = replace(s, loss_chunk_tokens=request.start.loss_chunk_tokens)  # a saver stage's 16 means nothing
        return _score(arch, request, unchunked, strat, off), "off: no chunked loss"
    if "loss_chunk_tokens" in request.fixed:
        return best, f"{loss_chunk_tokens(arch, s):,} tokens, set by you (--set)"
    return long_context.size_loss_chunk(arch, best, request.target.budget_gb, _scorer(arch, request, strat, off))


# -- when nothing fits -------------------------------------------------------------------------------------------
def _nothing_fits(arch: Architecture, request: Request, scored: list[_Scored]) -> str:
    smallest = min(scored, key=lambda x: x.peak_gb)
    s, est, share = smallest.setup, smallest.estimate, smallest.share
    strat, off = ("single", False) if share is None else (share.strategy, share.offload_optimizer)
    target = request.target
    savings = [STORAGE[s.quantization], f"batch {s.micro_batch_size}"]
    savings += [name for on, name in ((s.gradient_checkpointing, "checkpointing"),
                                      (s.activation_offloading, "offloading"),
                                      (s.loss_impl == "chunked", f"chunked loss ({loss_chunk_tokens(arch, s)}-token chunks)"),
                                      *((saver.on(s), saver.label) for saver in LONG_CONTEXT_SAVERS),
                                      (long_context.tiled(s), f"tiles of {mlp_tile_tokens(arch, s)} tokens")) if on]  # fmt: skip

    def fits(length: int) -> bool:
        return _estimate(arch, request, replace(s, max_seq_len=length), strat, off)[0].peak_gb <= target.budget_gb

    fits_len = longest_length(fits, s.max_seq_len)  # the longest sequence the smallest setup fits
    need = est.peak_gb + target.margin_gb
    hint = (
        f"use --seq-len {fits_len} or a smaller model"
        if fits_len >= 4 * SEQ_MULTIPLE
        else f"use a smaller model or --vram {math.ceil(need)}"
    )
    experts = ""
    # a single device's estimate names the 16-bit experts (a per-device share names weights by kind instead)
    expert_bytes = est.by_name().get("experts + routers (16-bit)")
    if arch.moe and s.quantization != "none" and expert_bytes is not None:
        n_experts = arch.num_layers * arch.moe.expert_params(arch.hidden_size)
        experts = (
            f", of which {expert_bytes / 1e9:.1f} GB are its {n_experts / 1e9:.1f}B "
            f"expert parameters (of {arch.total_params / 1e9:.1f}B), which {STORAGE[s.quantization]} leaves in 16-bit: "
            "bitsandbytes quantizes nn.Linear layers only"
        )
    return (
        f"{arch.name or 'model'} needs {est.peak_gb:.1f} GB at seq {s.max_seq_len} even with {', '.join(savings)} "
        f"(budget {target.budget_gb:.1f} GB = --vram {target.vram_gb:g} − margin {target.margin_gb:g}){experts}; "
        f"{hint}"
    )


def _host_refusal(arch: Architecture, request: Request, blocked: list[_Scored], hint: bool) -> str:
    """Nothing fits because of host RAM: the setup that fits the device with the least host RAM, what it keeps
    there against the host budget, and what would fit — a shorter length (with `hint`) or the RAM it needs."""
    least = min(blocked, key=lambda x: (host_need_gb(x.estimate, request.target.node_gpus), x.cost))
    s, target = least.setup, request.target
    need = host_need_gb(least.estimate, target.node_gpus)
    ram = math.ceil(need + target.host_margin_gb)
    instead = [f"--host-ram {ram} (a machine with {ram} GB available)"]
    if hint:
        shorter = max_seq_len(arch, request, limit=max(SEQ_MULTIPLE, s.max_seq_len - SEQ_MULTIPLE))
        if shorter:
            instead.insert(0, f"--seq-len {shorter}")
    return (
        f"{arch.name or 'model'} at seq {s.max_seq_len} fits the {target.budget_gb:.1f} GB VRAM budget only if it "
        f"{host_over(least.estimate, target)}; what fits: {' or '.join(instead)}"
    )


def _what_fits_instead(arch: Architecture, request: Request) -> str:
    """For a full fine-tune that cannot fit: what LoRA or QLoRA would need at the same budget."""
    if request.start.adapter != "full":
        return ""
    lora = replace(
        request,
        start=replace(request.start, adapter="lora"),
        fixed=request.fixed - {"adapter", "quantization"},
        length_reason="",
    )
    try:
        alternative = plan(arch, lora)
    except UserError:
        return "; LoRA and QLoRA do not fit this budget either"
    kind = "LoRA (16-bit weights)" if alternative.setup.quantization == "none" else (
        f"QLoRA ({alternative.setup.quantization})"
    )  # fmt: skip
    return (
        f"; {kind} fits: predicted peak {alternative.estimate.peak_gb:.1f} GB of the {request.target.budget_gb:.1f} "
        "GB budget (drop adapter.kind=full)"
    )


def max_seq_len(arch: Architecture, request: Request, limit: int = MAX_SEQ_LEN) -> int:
    """The longest max_seq_len (a multiple of SEQ_MULTIPLE, at most `limit`) for which `plan` finds a fitting
    setup, else 0."""

    least = _least_micro_batch(arch, request)

    def fits(length: int) -> bool:
        at = replace(least, start=replace(least.start, max_seq_len=length), fixed=least.fixed | {"max_seq_len"})
        if _fits_with_every_saver(arch, at):
            return True
        try:
            plan(arch, at, hint=False)
        except UserError:
            return False
        return True

    return longest_length(fits, limit)


def _least_micro_batch(arch: Architecture, request: Request) -> Request:
    """`request` with its micro batch fixed at the least the search would try, the effective batch kept: whether a
    length fits is decided there, as every estimate grows with the micro batch (its tokens; an effective batch's
    batch tensors too, `_accumulation` rounding up). Unchanged when the micro batch is fixed, or when the effective
    batch is no whole number of the least micro batches."""
    if "micro_batch_size" in request.fixed:
        return request
    least = min(_options(request.start, request.fixed, arch, *_micro_batch_rows(request))["micro_batch_size"])
    rows = request.start.micro_batch_size * request.gradient_accumulation
    if "gradient_accumulation" not in request.fixed and rows % least:
        return request
    accumulation = request.gradient_accumulation if "gradient_accumulation" in request.fixed else rows // least
    start = replace(request.start, micro_batch_size=least)
    return replace(request, start=start, gradient_accumulation=accumulation, fixed=request.fixed | {"micro_batch_size"})


def _fits_with_every_saver(arch: Architecture, request: Request) -> bool:
    """Whether the last stage's smallest setup (every saver the planner may add, the smallest tile) fits on some
    strategy stage — then `plan` finds a fitting setup (that stage searches it), in one estimate per strategy."""
    try:
        request, _, stages = _prepare(arch, request)
    except UserError:
        return False
    savers = long_context.saver_stages(arch, request.start, request.fixed, request.target.gpus)
    for strat, off in stages:
        start = _stage_start(request, off, savers[-1], len(savers) == 1)
        smallest = _smallest(arch, request, start, strat, off)
        if smallest is not None and _score(arch, request, smallest, strat, off).fits(request.target):
            return True
    return False
