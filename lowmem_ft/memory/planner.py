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
from lowmem_ft.memory.estimate import GB, Estimate, estimate, setup_from_recipe
from lowmem_ft.recipe.load import build, to_dict
from lowmem_ft.recipe.schema import Recipe

# Relative step-time costs of each saving: rough, from published comparisons, used only to rank configurations.
# Checkpointing recomputes the forward (≈ +1/3 of a step: forward ≈ 1/3 of forward+backward). NF4 dequantizes
# every linear in forward and backward (QLoRA paper / bnb benchmarks: ~1.3× a 16-bit LoRA step at batch 1).
# Offloading copies each layer input to host and back (≈ +10 % where the copy does not fully overlap).
# Chunked loss recomputes the head projection per chunk in backward (≈ +5 %).
COST = {"checkpointing": 1.33, "nf4": 1.3, "int8": 1.5, "offloading": 1.10, "chunked_loss": 1.05}
SEQ_ROUND = 64  # max_seq_len is rounded up to a multiple of this (kernel-friendly shapes)


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
            **self.estimate.to_dict(),
            "reasons": self.reasons,
            "notes": self.estimate.notes,
            "recipe": to_dict(self.recipe),
        }


def _get(d: dict, dotted: str) -> Any:
    section, key = dotted.split(".")
    return d.get(section, {}).get(key)


def _set(d: dict, dotted: str, value: Any) -> None:
    section, key = dotted.split(".")
    d.setdefault(section, {})[key] = value


def check(recipe: Recipe, arch: Architecture, vram_gb: float, gpus: int = 1) -> Plan:
    """The estimate of a given recipe against a VRAM target (for `--recipe R --vram N`)."""
    return Plan(recipe, estimate(arch, setup_from_recipe(recipe)), vram_gb, gpus, {"recipe": "as given"})


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
    gpus: int = 1,
    seq_len: int | None = None,
    profile: Any = None,
    fixed: dict | None = None,
) -> Plan:
    """The fastest configuration starting from `start` whose predicted peak fits under `vram_gb` − margin.

    `fixed` is the nested dict of keys the user set (`--set`/flags); they are kept as given. Raises UserError with
    the smallest configuration's need and what would fit when nothing does.
    """
    if gpus != 1:
        raise UserError(f"--gpus {gpus}: planning for more than one GPU is not supported yet; use one GPU")
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
    scored = []
    for cand in _candidates(base, fixed, arch):
        rec = _with(base, cand, effective, gpus)
        est = estimate(arch, setup_from_recipe(rec))
        scored.append((_cost(cand), est.peak_gb, cand, rec, est))
    fitting = [x for x in scored if x[1] <= budget]
    if not fitting:
        raise UserError(_nothing_fits(arch, vram_gb, budget, base, scored, effective, gpus, fixed))
    fitting.sort(key=lambda x: (x[0], x[1]))
    _, _, cand, rec, est = fitting[0]
    fits_without = {"quantization": any(x[2]["model.quantization"] == "none" for x in fitting)}
    result = Plan(rec, est, vram_gb, gpus, _reasons(rec, start, fixed, seq_reason, fits_without))
    result.reasons["adapter"] += target_reason
    return result


def _nothing_fits(arch, vram_gb, budget, base, scored, effective, gpus, fixed) -> str:
    smallest = min(scored, key=lambda x: x[1])
    cand, est = smallest[2], smallest[4]
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
        if estimate(arch, setup_from_recipe(_with(d, cand, effective, gpus))).peak_gb <= budget:
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


def max_seq_len(arch: Architecture, vram_gb: float, start: Recipe, fixed: dict, limit: int = 262144) -> int:
    """The longest max_seq_len (multiple of 16) for which the planner finds a fitting configuration, else 0."""
    lo, hi, best = 16, limit, 0
    while lo <= hi:
        mid = (lo + hi) // 2 // 16 * 16 or 16
        try:
            plan(arch, vram_gb, start, seq_len=mid, fixed=fixed)
            best, lo = mid, mid + 16
        except UserError:
            hi = mid - 16
    return best


def peak_gb_of(p: Plan) -> float:
    return p.estimate.peak_bytes / GB
