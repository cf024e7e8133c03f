"""The planner: the fastest recipe whose predicted peak fits under VRAM − margin (no torch import).

One idea: every memory saving costs speed, so search the knobs (quantization, optimizer, checkpointing, activation
offloading, chunked loss, micro batch with gradient accumulation keeping the effective batch) and keep the fitting
configuration with the lowest estimated time per sample. The tier recipe (8/24/40 GB) is the starting point; knobs
the user set (`--set`) are never changed. Sequence length comes from `--seq-len`, else from the data's length
profile (shortest length covering p99), else the recipe.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from lowmem_ft.errors import UserError
from lowmem_ft.memory.arch import Architecture
from lowmem_ft.memory.estimate import GB, Estimate, Setup, estimate, eval_peak_bytes, setup_from_recipe
from lowmem_ft.memory.sharding import OFFLOAD_OPTIMIZERS, DeviceShare, device_estimate, per_device, states_of
from lowmem_ft.recipe.load import build, to_dict
from lowmem_ft.recipe.schema import Recipe

# Relative step-time costs of each saving: rough, from published comparisons, used only to rank configurations.
# Checkpointing recomputes the forward (≈ +1/3 of a step: forward ≈ 1/3 of forward+backward). NF4 dequantizes
# every linear in forward and backward (QLoRA paper / bnb benchmarks: ~1.3× a 16-bit LoRA step at batch 1).
# Offloading copies each layer input to host and back (≈ +10 % where the copy does not fully overlap).
# Chunked loss recomputes the head projection per chunk in backward (≈ +5 %).
COST = {"checkpointing": 1.33, "nf4": 1.3, "int8": 1.5, "offloading": 1.10, "chunked_loss": 1.05}
SEQ_ROUND = 64  # max_seq_len is rounded up to a multiple of this (kernel-friendly shapes)
# Strategies the planner tries in order for `--gpus N` (strategy, offload): replication first (only the gradient
# all-reduce), then full sharding (an all-gather per layer), then host offload (PCIe copies every step) — each step
# saves device memory at a cost in speed. A user-given --strategy keeps its strategy; offload stays a further step.
STAGES: dict[str, tuple[tuple[str, bool], ...]] = {
    "auto": (("ddp", False), ("fsdp", False), ("fsdp", True)),
    "ddp": (("ddp", False),),
    "fsdp": (("fsdp", False), ("fsdp", True)),
    "zero2": (("zero2", False), ("zero2", True)),
    "zero3": (("zero3", False), ("zero3", True)),
}


@dataclass
class LengthProfile:
    """Token lengths of the training samples (computed from the data by `lowmem_ft.data`)."""

    p50: int = 0
    p90: int = 0
    p99: int = 0
    max: int = 0

    @classmethod
    def from_any(cls, value: Any) -> LengthProfile:
        if isinstance(value, LengthProfile):
            return value
        get = value.get if isinstance(value, dict) else lambda k, d=0: getattr(value, k, d)
        return cls(**{k: int(get(k, 0) or 0) for k in ("p50", "p90", "p99", "max")})


@dataclass
class Plan:
    recipe: Recipe
    estimate: Estimate
    vram_gb: float
    gpus: int
    reasons: dict[str, str] = field(default_factory=dict)
    strategy: str = "single"  # single (one device) | ddp | fsdp | zero2 | zero3
    offload: bool = False
    share: DeviceShare | None = None  # the per-device split of the model states (gpus > 1)

    @property
    def margin_gb(self) -> float:
        return self.recipe.memory.safety_margin_gb

    @property
    def budget_gb(self) -> float:
        return self.vram_gb - self.margin_gb

    @property
    def headroom_gb(self) -> float:
        return self.budget_gb - self.estimate.peak_gb

    @property
    def fits(self) -> bool:
        return self.headroom_gb >= 0

    def to_dict(self) -> dict[str, Any]:
        """What `plan --json` prints and `train` writes to plan.json (the monitor reads these keys)."""
        return {
            "model": self.recipe.model.name_or_path,
            "vram_gb": self.vram_gb,
            "gpus": self.gpus,
            "budget_gb": round(self.budget_gb, 3),
            "safety_margin_gb": self.margin_gb,
            "headroom_gb": round(self.headroom_gb, 3),
            "fits": self.fits,
            "strategy": self.strategy,
            "offload": self.offload,
            **({"per_device": _share_dict(self.share)} if self.share is not None else {}),
            **self.estimate.to_dict(),
            "reasons": self.reasons,
            "notes": self.estimate.notes,
            "recipe": to_dict(self.recipe),
        }


def _share_dict(share: DeviceShare) -> dict[str, Any]:
    """Per-device GB of each kind of model state (estimate components say the same, named for the table)."""
    keys = ("weights", "gradients", "optimizer", "gathered", "comm_buffers", "activations", "host")
    out: dict[str, Any] = {f"{k}_gb": round(getattr(share, k) / GB, 4) for k in keys}
    return {**out, "offload_optimizer": share.offload_optimizer, "offload_params": share.offload_params}


def per_device_estimate(
    arch: Architecture, s: Setup, gpus: int, strategy: str, offload: bool
) -> tuple[Estimate, DeviceShare | None]:
    """The estimate of one device: the single-device estimate when gpus == 1, else the strategy's share."""
    est = estimate(arch, s)
    if gpus == 1:
        return est, None
    full_shard = strategy in ("zero3", "fsdp")
    share = per_device(
        states_of(arch, s),
        strategy,  # type: ignore[arg-type]
        gpus,
        offload_optimizer=offload,
        offload_params=offload and strategy == "fsdp" and full_shard,  # FSDP CPUOffload moves both together
    )
    return device_estimate(arch, est, share), share


def _get(d: dict, dotted: str) -> Any:
    section, key = dotted.split(".")
    return d.get(section, {}).get(key)


def _set(d: dict, dotted: str, value: Any) -> None:
    section, key = dotted.split(".")
    d.setdefault(section, {})[key] = value


def check(
    recipe: Recipe, arch: Architecture, vram_gb: float, gpus: int = 1, strategy: str = "auto", offload: bool = False
) -> Plan:
    """The estimate of a given recipe against a VRAM target (for `--recipe R --vram N`): with several GPUs, the
    first strategy stage that fits (else the last one tried)."""
    s = setup_from_recipe(recipe)
    if gpus == 1:
        return Plan(recipe, estimate(arch, s), vram_gb, gpus, {"recipe": "as given"})
    budget = vram_gb - recipe.memory.safety_margin_gb
    tried = []
    for strat, off in _stages(strategy, offload, recipe.optimizer.name, recipe.model.quantization):
        est, share = per_device_estimate(arch, s, gpus, strat, off)
        tried.append((strat, off, est, share))
        if est.peak_gb <= budget:
            break
    strat, off, est, share = tried[-1]
    reasons = {"recipe": "as given", "strategy": _strategy_reason(strat, off, strategy, gpus, tried, budget)}
    return Plan(recipe, est, vram_gb, gpus, reasons, strat, off, share)


def _stages(strategy: str, offload: bool | None, optimizer: str | None, quantization: str | None) -> list:
    """Strategy stages to try; offload only where the optimizer can step on the host, sharding not for int8."""
    if strategy not in STAGES:
        raise UserError(f"--strategy {strategy}: choose one of {', '.join(STAGES)}")
    stages = [
        (st, off)
        for st, off in STAGES[strategy]
        if (offload is None or off == offload)
        and not (off and optimizer is not None and optimizer not in OFFLOAD_OPTIMIZERS)
        and not (st != "ddp" and quantization == "int8")  # bnb int8 weights have no float storage to shard
    ]
    if not stages:
        raise UserError(
            f"--strategy {strategy}{' --offload' if offload else ''}: no runnable combination "
            f"(offload needs optimizer.name adamw_torch or adafactor; int8 weights cannot be sharded)"
        )
    return stages


def _strategy_reason(strat: str, off: bool, asked: str, gpus: int, tried: list, budget: float) -> str:
    """Why this strategy: the per-device need of each stage tried before it."""
    verb = {"ddp": "DDP (a full copy per device)", "fsdp": "FSDP full shard", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}
    name = verb[strat] + (" + CPU offload" if off else "")
    before = [f"{verb[t[0]] + (' + offload' if t[1] else '')} needs {t[2].peak_gb:.1f} GB" for t in tried[:-1]]
    last = tried[-1][2].peak_gb
    fits = last <= budget
    why = f"{name} on {gpus} devices: {last:.1f} GB per device " + (
        f"fits the {budget:.1f} GB budget" if fits else f"OVER the {budget:.1f} GB budget"
    )
    if before:
        why += f" ({'; '.join(before)} per device, over the budget)"
    elif strat == "ddp" and fits:
        why += " — the model fits whole on each device, so only gradients are all-reduced"
    return why + ("; strategy as asked (--strategy)" if asked != "auto" else "")


def choose_seq_len(recipe: Recipe, seq_len: int | None, profile: Any, fixed: dict) -> tuple[int, str]:
    if seq_len:
        return seq_len, f"{seq_len} tokens, as --seq-len asked"
    if _get(fixed, "memory.max_seq_len"):
        return recipe.memory.max_seq_len, f"{recipe.memory.max_seq_len} tokens, as --set asked"
    if profile is not None:
        prof = LengthProfile.from_any(profile)
        if prof.p99 > 0:
            length = SEQ_ROUND * math.ceil(prof.p99 / SEQ_ROUND)
            covers = "every sample" if prof.max and length >= prof.max else "99 % of samples (longer ones truncate)"
            return length, f"{length} tokens covers {covers} (p99 {prof.p99}, max {prof.max})"
    return recipe.memory.max_seq_len, f"{recipe.memory.max_seq_len} tokens from the recipe"


def _candidates(start: dict, fixed: dict, arch: Architecture) -> list[dict[str, Any]]:
    """Knob settings to try; a knob the user fixed keeps its value."""
    m0 = start["model"]
    full = start["adapter"]["kind"] == "full"
    options: dict[str, list[Any]] = {
        "model.quantization": ["none"] if full else list(dict.fromkeys(["none", m0["quantization"], "nf4"])),
        "optimizer.name": list(dict.fromkeys([start["optimizer"]["name"], "paged_adamw_8bit"])),
        "memory.gradient_checkpointing": [False, True],
        "memory.activation_offloading": [False, True],
        "memory.chunked_loss": [False, True],
    }
    b0 = start["memory"]["micro_batch_size"]
    options["memory.micro_batch_size"] = sorted({b for b in (b0 * 2, b0, 8, 4, 2, 1) if 1 <= b <= max(b0 * 2, 1)})
    for key in options:
        if _get(fixed, key) is not None:
            options[key] = [_get(fixed, key)]
    keys = list(options)
    out = []
    for values in itertools.product(*(options[k] for k in keys)):
        cand = dict(zip(keys, values, strict=True))
        if cand["memory.activation_offloading"] and not cand["memory.gradient_checkpointing"]:
            continue  # offloading moves checkpointed inputs: it needs checkpointing
        out.append(cand)
    return out


def _cost(c: dict[str, Any]) -> float:
    """Estimated time per sample relative to a 16-bit, no-savings step at large batch."""
    cost = COST.get(c["model.quantization"], 1.0)
    for key, name in (
        ("memory.gradient_checkpointing", "checkpointing"),
        ("memory.activation_offloading", "offloading"),
        ("memory.chunked_loss", "chunked_loss"),
    ):
        if c[key]:
            cost *= COST[name]
    # small micro batches under-use the GPU: per-sample time ∝ 1 + 1/(2b) (a saturating curve, used for ranking)
    return cost * (1 + 1 / (2 * c["memory.micro_batch_size"]))


def _with(start: dict, cand: dict[str, Any], effective: int, gpus: int) -> Recipe:
    d = copy.deepcopy(start)
    for key, value in cand.items():
        _set(d, key, value)
    b = d["memory"]["micro_batch_size"]
    d["memory"]["gradient_accumulation"] = max(1, math.ceil(effective / (b * gpus)))
    return build(d, source="plan")


def _reasons(rec: Recipe, start: Recipe, fixed: dict, seq_reason: str, fits_without: dict[str, bool]) -> dict:
    m, mem = rec.model, rec.memory

    def why(key: str, text: str) -> str:
        return "set by you (--set)" if _get(fixed, key) is not None else text

    eff = mem.micro_batch_size * mem.gradient_accumulation
    r = {
        "quantization": why(
            "model.quantization",
            "16-bit weights fit: fastest"
            if m.quantization == "none"
            else f"{m.quantization}: 16-bit weights do not fit"
            if not fits_without.get("quantization")
            else f"{m.quantization}: 16-bit fits only with slower savings",
        ),
        "adapter": f"{rec.adapter.kind}"
        + (f", rank {rec.adapter.r} from the recipe" if rec.adapter.kind == "lora" else " fine-tuning (recipe)"),
        "optimizer": why(
            "optimizer.name",
            f"{rec.optimizer.name}"
            + (" (from the recipe)" if rec.optimizer.name == start.optimizer.name else ": smaller states needed"),
        ),
        "gradient_checkpointing": why(
            "memory.gradient_checkpointing",
            "on: activations of all layers do not fit" if mem.gradient_checkpointing else "off: activations fit",
        ),
        "activation_offloading": why(
            "memory.activation_offloading",
            "on: checkpointed layer inputs do not fit on the device"
            if mem.activation_offloading
            else "off: not needed",
        ),
        "chunked_loss": why(
            "memory.chunked_loss", "on: needed to fit" if mem.chunked_loss else "off: the loss fits without it"
        ),
        "micro_batch_size": why(
            "memory.micro_batch_size",
            f"{mem.micro_batch_size}: largest that fits with the fewest savings; "
            f"accumulation {mem.gradient_accumulation} keeps the effective batch {eff}",
        ),
        "max_seq_len": seq_reason,
    }
    return r


def plan(
    arch: Architecture,
    vram_gb: float,
    start: Recipe,
    *,
    seq_len: int | None = None,
    profile: Any = None,
    fixed: dict | None = None,
    **kw: Any,
) -> Plan:
    """`plan_once` (same arguments; `kw`: gpus, strategy, offload), and when the data's p99 length (the planner's
    own choice) does not fit, the longest length that does: longer samples then follow `data.truncate`, and the
    reason line says how many that cuts."""
    try:
        return plan_once(arch, vram_gb, start, seq_len=seq_len, profile=profile, fixed=fixed, **kw)
    except UserError:
        if profile is None or seq_len or _get(fixed or {}, "memory.max_seq_len"):
            raise
        wanted, _ = choose_seq_len(start, None, profile, fixed or {})
        fit = max_seq_len(arch, vram_gb, start, fixed or {}, limit=wanted, **kw)
        if not fit:
            raise
    result = plan_once(arch, vram_gb, start, seq_len=fit, fixed=fixed, **kw)
    prof = LengthProfile.from_any(profile)
    cut = ""
    if hasattr(profile, "over"):  # lowmem_ft.data.LengthProfile knows every sample's length
        samples, tokens = profile.over(fit)
        cut = f"; {samples} samples longer, {tokens} tokens beyond it (data.truncate={start.data.truncate})"
    result.reasons["max_seq_len"] = f"{fit} tokens: the longest that fits (p99 {prof.p99} does not){cut}"
    return result


def plan_once(
    arch: Architecture,
    vram_gb: float,
    start: Recipe,
    *,
    gpus: int = 1,
    seq_len: int | None = None,
    profile: Any = None,
    fixed: dict | None = None,
    strategy: str = "auto",
    offload: bool | None = None,
) -> Plan:
    """The fastest configuration starting from `start` whose predicted peak fits under `vram_gb` − margin.

    `fixed` is the nested dict of keys the user set (`--set`/flags); they are kept as given. With `gpus` > 1 the
    peak is per device, and the strategy stages (`STAGES[strategy]`) are tried in order: the first stage where some
    configuration fits wins, so DDP is kept whenever the model fits whole on each device. `offload` None lets the
    planner offload as a last stage; True/False fixes it. Raises UserError with the smallest configuration's need
    and what would fit when nothing does.
    """
    if gpus < 1:
        raise UserError(f"--gpus {gpus}: must be at least 1")
    fixed = fixed or {}
    length, seq_reason = choose_seq_len(start, seq_len, profile, fixed)
    base = to_dict(start)
    base["memory"]["max_seq_len"] = length
    target_reason = ""
    if start.adapter.kind == "lora" and not arch.lora_targets(start.adapter.target_modules):
        if _get(fixed, "adapter.target_modules") is not None:
            raise UserError(
                f"adapter.target_modules {start.adapter.target_modules} match no linear layer of {arch.name}; "
                f"its linears are {', '.join(arch.linear_names)}"
            )
        base["adapter"]["target_modules"] = ["all-linear"]
        target_reason = f"; targets all linear layers ({', '.join(arch.linear_names)}): the recipe's names are absent"
    effective = start.memory.micro_batch_size * start.memory.gradient_accumulation * gpus
    budget = vram_gb - start.memory.safety_margin_gb
    stages = (
        [("single", False)]
        if gpus == 1
        else _stages(strategy, offload, _get(fixed, "optimizer.name"), _get(fixed, "model.quantization"))
    )
    tried: list = []  # (strategy, offload, smallest estimate, share) of each stage, for the reason line
    scored: list = []
    for strat, off in stages:
        stage_base = base
        if off and _get(fixed, "optimizer.name") is None:
            stage_base = copy.deepcopy(base)  # the host steps the optimizer: a torch optimizer (bnb's are CUDA)
            stage_base["optimizer"]["name"] = "adamw_torch"
        stage_scored = []
        for cand in _candidates(stage_base, fixed, arch):
            if strat not in ("single", "ddp") and cand["model.quantization"] == "int8":
                continue
            if off and cand["optimizer.name"] not in OFFLOAD_OPTIMIZERS:
                continue
            rec = _with(stage_base, cand, effective, gpus)
            est, share = per_device_estimate(arch, setup_from_recipe(rec), gpus, strat, off)
            stage_scored.append((_cost(cand), est.peak_gb, cand, rec, est, share))
        if not stage_scored:
            continue
        scored = stage_scored
        smallest = min(scored, key=lambda x: x[1])
        tried.append((strat, off, smallest[4], smallest[5]))
        fitting = [x for x in scored if x[1] <= budget]
        if not fitting:
            continue
        # Offloaded weights and states cross PCIe every step, which dwarfs the other costs: fewest host bytes first.
        fitting.sort(key=lambda x: (x[5].host if off else 0.0, x[0], x[1]))
        _, _, cand, rec, est, share = fitting[0]
        fits_without = {"quantization": any(x[2]["model.quantization"] == "none" for x in fitting)}
        result = Plan(rec, est, vram_gb, gpus, _reasons(rec, start, fixed, seq_reason, fits_without), strat, off, share)
        result.reasons["adapter"] += target_reason
        if off and _get(fixed, "optimizer.name") is None:
            result.reasons["optimizer"] = f"{rec.optimizer.name}: offloaded states step on the host (bnb's need CUDA)"
        result.reasons["eval_batch_size"] = _choose_eval_batch(arch, rec, budget, fixed, gpus)
        if gpus > 1:
            tried[-1] = (strat, off, est, share)
            result.reasons["strategy"] = _strategy_reason(strat, off, strategy, gpus, tried, budget)
            result.reasons["micro_batch_size"] += f" per device; × {gpus} devices = {effective} per optimizer step"
        return result
    if not tried:
        raise UserError(f"--strategy {strategy}: no configuration of {arch.name or 'the model'} can use it")
    stage = f" per device with {_strategy_reason(*tried[-1][:2], strategy, gpus, tried, budget)}" if gpus > 1 else ""
    raise UserError(_nothing_fits(arch, vram_gb, budget, base, scored, effective, gpus, fixed) + stage)


def _choose_eval_batch(arch: Architecture, rec: Recipe, budget_gb: float, fixed: dict, gpus: int) -> str:
    """Set `rec.memory.eval_batch_size`: the largest of 8×, 4×, 2×, 1× the micro batch (at most 64) whose eval
    forward fits the budget — evaluation keeps no activations for backward, so it can batch wider than training."""
    m = rec.memory
    if _get(fixed, "memory.eval_batch_size"):
        return f"{m.eval_batch_size} (set by you)"
    if gpus > 1:
        m.eval_batch_size = m.micro_batch_size
        return f"{m.micro_batch_size}: the micro batch (per-device eval planning is not modelled for sharded runs)"
    setup = setup_from_recipe(rec)
    need = {b: eval_peak_bytes(arch, setup, b) / GB for b in {min(64, m.micro_batch_size * f) for f in (8, 4, 2, 1)}}
    m.eval_batch_size = max((b for b, gb in need.items() if gb <= budget_gb), default=m.micro_batch_size)
    return (
        f"{m.eval_batch_size}: eval forward needs {need[m.eval_batch_size]:.2f} GB (no gradients or saved activations)"
    )


def _nothing_fits(arch, vram_gb, budget, base, scored, effective, gpus, fixed) -> str:
    smallest = min(scored, key=lambda x: x[1])
    cand, est = smallest[2], smallest[4]
    strat, off = ("single", False) if smallest[5] is None else (smallest[5].strategy, smallest[5].offload_optimizer)
    length = base["memory"]["max_seq_len"]
    savings = [
        "NF4" if cand["model.quantization"] == "nf4" else cand["model.quantization"],
        f"batch {cand['memory.micro_batch_size']}",
    ]
    savings += [n for k, n in (("memory.gradient_checkpointing", "checkpointing"),
                               ("memory.activation_offloading", "offloading"),
                               ("memory.chunked_loss", "chunked loss")) if cand[k]]  # fmt: skip
    fits_len = 0
    lo, hi = 16, length
    while lo <= hi:  # the longest sequence the smallest configuration fits (binary search)
        mid = (lo + hi) // 2
        d = copy.deepcopy(base)
        d["memory"]["max_seq_len"] = mid
        setup = setup_from_recipe(_with(d, cand, effective, gpus))
        if per_device_estimate(arch, setup, gpus, strat, off)[0].peak_gb <= budget:
            fits_len, lo = mid, mid + 1
        else:
            hi = mid - 1
    need = est.peak_gb + base["memory"]["safety_margin_gb"]
    hint = (
        f"use --seq-len {fits_len // 16 * 16} or a smaller model"
        if fits_len >= 64
        else f"use a smaller model or --vram {math.ceil(need)}"
    )
    return (
        f"{arch.name or 'model'} needs {est.peak_gb:.1f} GB at seq {length} even with {', '.join(savings)} "
        f"(budget {budget:.1f} GB = --vram {vram_gb:g} − margin {base['memory']['safety_margin_gb']:g}); {hint}"
    )


def max_seq_len(arch: Architecture, vram_gb: float, start: Recipe, fixed: dict, limit: int = 262144, **kw: Any) -> int:
    """The longest max_seq_len (multiple of 16) for which the planner finds a fitting configuration, else 0."""
    lo, hi, best = 16, limit, 0
    while lo <= hi:
        mid = (lo + hi) // 2 // 16 * 16 or 16
        try:
            plan_once(arch, vram_gb, start, seq_len=mid, fixed=fixed, **kw)
            best, lo = mid, mid + 16
        except UserError:
            hi = mid - 16
    return best


def peak_gb_of(p: Plan) -> float:
    return p.estimate.peak_bytes / GB
