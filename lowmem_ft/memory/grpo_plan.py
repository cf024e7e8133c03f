"""Planning a GRPO run: the SFT planner's micro-step, then the round that fits — pure arithmetic (no torch).

The one idea: a GRPO step peaks in its largest phase (`lowmem_ft.memory.grpo.phase_peaks`), and the knobs act on
different phases. The SFT planner (`lowmem_ft.memory.planner.plan`) chooses the training micro-step's knobs (b
completions of P + C tokens, checkpointing, storage, optimizer) for the training phases; then this module chooses
the round — b and steps_per_generation, whose product R is the rows one `generate` call makes — so that every
phase fits: the largest b first (the planner's, then halves), the largest steps_per_generation that divides the
accumulation (then no old-policy scoring pass is needed: TRL runs it only when they are misaligned), subject to
TRL 1.16's rule that a round holds whole prompt groups (`GRPOConfig.__post_init__`: b × steps_per_generation ×
processes divisible by num_generations). Only when no round fits, and only for what the user did not fix, the
completion length C is halved (down to `MIN_COMPLETION`), then num_generations G (down to 2); the reasons say so.

The phases' device form: the training phases are the device estimate's own (its attention kernels and offloading
differ from the CPU's) with GRPO's differences from an SFT step as `phase_peaks` counts them; generation and
scoring are their CPU form moved by the difference between the device and CPU forms of the static state; the
largest phase carries the device overheads of its transient (`lowmem_ft.memory.overheads`). A prediction, measured on the CPU only (docs/methods.md, "GRPO").
"""

from __future__ import annotations

import math
from dataclasses import replace

from lowmem_ft.errors import UserError
from lowmem_ft.memory.arch import Architecture
from lowmem_ft.memory.estimate import GB, Estimate, Setup, estimate
from lowmem_ft.memory.grpo import GrpoShape, generation_terms, peak_phase, phase_peaks, round_bytes, training_setup
from lowmem_ft.memory.overheads import device_overheads, overhead_bytes
from lowmem_ft.memory.planner import Plan, Request, plan
from lowmem_ft.memory.records import Component

MIN_COMPLETION = 32  # the planner halves max_completion_length no further (shorter answers rarely reason)


def round_problem(micro_batch: int, steps_per_generation: int, accumulation: int, processes: int,
                  num_generations: int) -> str | None:  # fmt: skip
    """TRL 1.16's rule on a GRPO round (`GRPOConfig.__post_init__`): one generate call makes micro_batch ×
    steps_per_generation (0: the accumulation) × processes completions, which must be whole prompt groups of
    num_generations; the line that says how to meet it, or None when it holds."""
    spg = steps_per_generation or accumulation
    rows = micro_batch * spg * processes
    if rows % num_generations == 0:
        return None
    on = f" × {processes} processes" if processes > 1 else ""
    return (
        f"--method grpo: a round of memory.micro_batch_size {micro_batch} × grpo.steps_per_generation {spg}{on} = "
        f"{rows} completions is not whole prompt groups of grpo.num_generations {num_generations}; make the product "
        f"a multiple of {num_generations} (e.g. --set grpo.steps_per_generation="
        f"{num_generations // math.gcd(num_generations, micro_batch * processes)}), or give --vram to let the planner "
        "choose"
    )


def cpu_form(s: Setup) -> Setup:
    return replace(s, device="cpu")


def grpo_estimate(arch: Architecture, s: Setup, g: GrpoShape) -> Estimate:
    """The estimate of a GRPO step on `s.device`: the training micro-step's components, generation's terms, and the
    peak = the largest phase (`phases` holds each)."""
    ts = training_setup(s, g)
    est, cpu_est = estimate(arch, ts), estimate(arch, cpu_form(ts))
    cpu = phase_peaks(arch, cpu_form(s), g)
    # the training phases: the device's own forward / backward / step (its attention kernels, offloading) with
    # GRPO's differences from SFT's (the round held instead of the batch); generation and scoring: their CPU form
    # moved by the static state's difference (host-resident paged states)
    shift = est.phases["static"] - cpu_est.phases["static"]
    phases = {
        name: est.phases[name] + b - cpu_est.phases[name] if name in est.phases else b + shift
        for name, b in cpu.items()
    }
    top = peak_phase(phases)
    gradients = est.by_name().get("gradients", 0.0)
    overheads = device_overheads(ts, phases[top] - est.phases["static"], gradients, block=est.allocator_block)
    terms = generation_terms(arch, cpu_form(s), g)
    comps = [c for c in est.components if c.phase != "overhead"]
    comps += [Component(f"generation: {name}", b, "generation", "lowmem_ft.memory.grpo") for name, b in terms.items()]
    comps.append(Component("GRPO round buffer", round_bytes(arch, s, g), "generation", "lowmem_ft.memory.grpo"))
    comps += overheads
    note = f"GRPO: {g.rows(s)} completions per round ({g.num_generations} per prompt), P {g.prompt_len}, C {g.completion_len}"
    notes = [*est.notes, note]
    return Estimate(
        comps, ts, phases[top], overhead_bytes(overheads), top, notes, phases, allocator_block=est.allocator_block
    )


def phase_lines(est: Estimate) -> list[str]:
    """Each phase's predicted peak on the device, in the order the step runs them, the largest marked."""
    top = peak_phase(est.phases)
    static = sum(c.bytes for c in est.components if c.phase == "static")
    return [
        f"{name:<15} {device_gb(est, b, static):6.2f} GB" + ("   ← peak" if name == top else "")
        for name, b in est.phases.items()
    ]


def phases_gb(est: Estimate) -> dict[str, float]:
    """Each phase's predicted peak on the device, GB (plan --json, plan.json)."""
    static = sum(c.bytes for c in est.components if c.phase == "static")
    return {name: round(device_gb(est, b, static), 3) for name, b in est.phases.items()}


def device_gb(est: Estimate, phase_bytes: float, static: float) -> float:
    """A phase's peak with the device overheads of its own transient (none on the CPU)."""
    gradients = est.by_name().get("gradients", 0.0)  # as `grpo_estimate` prices the peak's
    overheads = device_overheads(est.setup, phase_bytes - static, gradients, block=est.allocator_block)
    return (phase_bytes + overhead_bytes(overheads)) / GB


def _rounds(ga: int, fixed: int | None) -> list[int]:
    """steps_per_generation candidates: the fixed one, else the divisors of the accumulation, largest first."""
    if fixed:
        return [fixed]
    return [d for d in range(ga, 0, -1) if ga % d == 0]


def _shapes(g: GrpoShape, fixed: frozenset[str]) -> list[tuple[GrpoShape, str]]:
    """The round shapes to try, the recipe's first; then C halved, then G halved, where not fixed."""
    out = [(g, "")]
    c, n = g.completion_len, g.num_generations
    while "max_completion_length" not in fixed and c // 2 >= MIN_COMPLETION:
        c //= 2
        out.append((replace(g, completion_len=c), f"max_completion_length {g.completion_len} → {c}"))
    while "num_generations" not in fixed and n // 2 >= 2:
        n //= 2
        out.append((replace(g, completion_len=c, num_generations=n),
                    f"max_completion_length {g.completion_len} → {c}, num_generations {g.num_generations} → {n}"))  # fmt: skip
    return out


def plan_grpo(arch: Architecture, request: Request, g: GrpoShape, fixed: frozenset[str] = frozenset()) -> tuple[Plan, GrpoShape]:  # fmt: skip
    """The plan of a GRPO run: the SFT planner's micro-step knobs, and the b and steps_per_generation (C and G if
    needed, `fixed` naming those the user set: micro_batch_size, gradient_accumulation, steps_per_generation,
    max_completion_length, num_generations) whose every phase fits the budget."""
    width = g.prompt_len + g.completion_len
    if request.target.gpus > 1 and request.strategy not in ("auto", "ddp"):
        raise UserError(
            f"--method grpo --strategy {request.strategy}: lowmem-ft plans GRPO's phases on one device or a full copy "
            "per device (generation under sharded weights is not planned); use --strategy ddp"
        )
    base = plan(arch, replace(request, start=replace(request.start, max_seq_len=width)))
    if base.strategy not in ("single", "ddp"):
        raise UserError(
            f"--method grpo: lowmem-ft plans GRPO's phases on one device or a full copy per device (DDP); this model "
            f"needs {base.strategy} to fit, which generation's memory is not planned for; use a larger --vram"
        )
    gpus, budget = request.target.gpus, request.target.budget_gb
    effective = request.effective_batch
    top_b = base.setup.micro_batch_size
    bs = [top_b] if "micro_batch_size" in fixed else [b for b in _halves(top_b)]
    tried: Estimate | None = None
    for shape, stepped in _shapes(g, fixed):
        for b in bs:
            ga = (
                request.gradient_accumulation
                if "gradient_accumulation" in fixed
                else max(1, math.ceil(effective / (b * gpus)))
            )
            for spg in _rounds(ga, g.steps_per_generation if "steps_per_generation" in fixed else None):
                if (b * spg * gpus) % shape.num_generations:
                    continue
                s = replace(base.setup, micro_batch_size=b, gradient_accumulation=ga)
                sh = replace(shape, steps_per_generation=spg)
                est = grpo_estimate(arch, s, sh)
                if tried is None or est.peak_gb < tried.peak_gb:
                    tried = est
                if est.peak_gb <= budget:
                    return _plan_of(base, s, sh, est, ga, stepped), sh
    need = (
        f"{tried.peak_gb:.2f} GB at its smallest round" if tried is not None else "no round holds whole prompt groups"
    )
    raise UserError(
        f"--method grpo: no round fits the {budget:.2f} GB budget ({need}, peak in {tried.peak_phase if tried else '-'}); "
        "lower grpo.max_completion_length, grpo.num_generations or grpo.max_prompt_length, or use a larger --vram"
    )


def _halves(b: int) -> list[int]:
    out = []
    while b >= 1:
        out.append(b)
        b //= 2
    return out


def _plan_of(base: Plan, s: Setup, g: GrpoShape, est: Estimate, ga: int, stepped: str) -> Plan:
    rows = g.rows(s)
    reasons = dict(base.reasons)
    reasons["micro_batch_size"] = (
        f"{s.micro_batch_size} completions per micro-step ({base.reasons.get('micro_batch_size', 'the planner')})"
    )
    reasons["steps_per_generation"] = (
        f"{g.steps_per_generation}: one generate call makes {rows} completions ({rows // g.num_generations} prompts × "
        f"{g.num_generations}); {'no old-policy pass (it divides the accumulation)' if ga % (g.steps_per_generation or ga) == 0 else 'an old-policy scoring pass (misaligned with the accumulation)'}"
    )
    static = sum(c.bytes for c in est.components if c.phase == "static")
    reasons["phases"] = ", ".join(f"{n} {device_gb(est, b, static):.2f} GB" for n, b in est.phases.items())
    reasons["phases"] += f"; peak in {est.peak_phase}"
    if stepped:
        reasons["round"] = f"stepped down to fit: {stepped} (set them to fix them)"
    return replace(base, setup=s, estimate=est, gradient_accumulation=ga, reasons=reasons)
