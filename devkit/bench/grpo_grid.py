"""The CPU estimator grid for GRPO: each phase of TRL 1.16's own GRPO step, measured, against `memory.grpo`.

    python -m devkit.bench.grpo_grid                                  # 24 points, 10-20 min on 2 shared cores
    python -m devkit.bench.grpo_grid --quick                          # 6 of them
    python -m devkit.bench.grpo_grid --out benchmarks/grpo_grid.md    # the committed table (+ grpo_grid.json)
    python -m devkit.bench.grpo_grid --measured benchmarks/grpo_grid.json  # predict again, measure nothing
    python -m devkit.bench.grpo_grid --measured benchmarks/grpo_grid.json --points 15  # measure point 15 again

Each point is `devkit.harness.grpo.measure`: a zoo model built through `build_model` (LoRA r 8, QLoRA NF4 or full,
bf16 weights, paged_adamw_8bit, gradient checkpointing unless said), two optimizer steps of `GRPOTrainer` on the CPU
(HF generation, every completion exactly C tokens), each phase's exact peak of live tensor bytes (`PeakMemory`)
against `memory.grpo.phase_peaks` (CPU form). The design is fractional: three families (Llama 3, Qwen2.5, Gemma-2 —
tied / untied, qkv bias, head_dim ≠ h / heads, softcapping, sliding-window layers), each adapter kind on each family,
and G (num_generations), C, P, b, steps_per_generation (aligned, two rounds per step, misaligned: the old policy's
pass) and beta (0, 0.04: the reference pass) varied across them. The measurements are saved beside the table
(.json) by the measuring run; `--measured` predicts them again after a change to the memory model.

The misaligned point (steps_per_generation 3 against accumulation 2, neither dividing the other) was measured
again (`--points 15`) once the harness gave every run enough prompts: its first measurement ran out of data in the
second optimizer step (a one-micro-step accumulation, one round only) and looked over-predicted by 25 %.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from devkit.harness.grpo import PHASES, Case, measure, predict

C = Case
GRID = (
    C(),
    C(family="qwen2.5"),
    C(family="gemma2"),
    C(adapter="qlora"),
    C(family="qwen2.5", adapter="qlora", steps_per_generation=1, beta=0.04),
    C(family="gemma2", adapter="qlora", prompt_len=24, completion_len=16, num_generations=2, micro_batch=2, beta=0.04),
    C(adapter="full"),
    C(family="qwen2.5", adapter="full", beta=0.04),
    C(family="gemma2", adapter="full", prompt_len=8, completion_len=12, steps_per_generation=1, gradient_accumulation=1),
    C(prompt_len=8, completion_len=12, num_generations=8, micro_batch=8, steps_per_generation=1, gradient_accumulation=1),
    C(family="qwen2.5", prompt_len=16, completion_len=32, num_generations=2, micro_batch=2, steps_per_generation=4,
      gradient_accumulation=4),
    C(family="gemma2", completion_len=24, num_generations=8, beta=0.04),
    C(prompt_len=64, completion_len=8, steps_per_generation=1, beta=0.04),
    C(family="qwen2.5", prompt_len=8, completion_len=48, micro_batch=2),
    C(num_generations=2, micro_batch=2, steps_per_generation=3),  # misaligned: the old policy's pass (open)
    C(family="qwen2.5", adapter="qlora", micro_batch=2, steps_per_generation=4),  # one round, two optimizer steps
    C(family="gemma2", prompt_len=40, completion_len=24),  # past the sliding window (16)
    C(adapter="qlora", prompt_len=16, completion_len=16, num_generations=8, micro_batch=8, beta=0.04),
    C(family="qwen2.5", adapter="full", num_generations=2, micro_batch=2, gradient_accumulation=1),
    C(family="gemma2", adapter="qlora", prompt_len=8, completion_len=8, steps_per_generation=1,
      gradient_accumulation=1),
    C(adapter="full", prompt_len=24, completion_len=24, num_generations=2, beta=0.04),
    C(family="qwen2.5", gradient_checkpointing=False, beta=0.04),
    C(family="gemma2", adapter="full", prompt_len=16, completion_len=16, beta=0.04),
    C(family="qwen2.5", adapter="qlora", prompt_len=32, completion_len=32, num_generations=8, micro_batch=8,
      steps_per_generation=1, gradient_accumulation=1, beta=0.04),
)  # fmt: skip
QUICK = (0, 4, 7, 11, 14, 17)


def describe(case: Case) -> str:
    ckpt = "" if case.gradient_checkpointing else ", no ckpt"
    spg, ga = case.steps_per_generation, case.gradient_accumulation
    ckpt += ", misaligned" if spg % ga and ga % spg else ""  # neither divides the other
    return (
        f"{case.family} {case.adapter}, P {case.prompt_len}, C {case.completion_len}, G {case.num_generations}, "
        f"b {case.micro_batch}, spg {case.steps_per_generation}, ga {case.gradient_accumulation}, "
        f"beta {case.beta:g}{ckpt}"
    )


def measure_all(cases: tuple[Case, ...]) -> list[dict]:
    """Each point's case, measured phase peaks, architecture config and setup (what predicting again needs)."""
    out = []
    for i, case in enumerate(cases, 1):
        t0 = time.time()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            measured, arch, setup = measure(case)
        phases = {p: measured[p] for p in PHASES if p in measured}
        out.append({"case": dataclasses.asdict(case), "measured": phases, "arch": measured["config"],
                    "setup": dataclasses.asdict(setup)})  # fmt: skip
        print(f"[{i}/{len(cases)}] {time.time() - t0:.0f} s  {describe(case)}: {phases}", file=sys.stderr, flush=True)
    return out


def run(points: list[dict]) -> tuple[list[str], dict[str, list[float]]]:
    """The table's rows and each phase's signed errors (predicted − measured) / measured."""
    from lowmem_ft.memory.arch import Architecture
    from lowmem_ft.memory.estimate import Setup

    rows, errors = [], {p: [] for p in PHASES}
    for point in points:
        case = Case(**point["case"])
        measured = point["measured"]
        setup = Setup(**{k: tuple(v) if isinstance(v, list) else v for k, v in point["setup"].items()})
        predicted = predict(case, Architecture.from_config(point["arch"]), setup)
        cells = []
        for phase in PHASES:
            m, p = measured.get(phase), predicted.get(phase)
            if m is None or p is None:
                if (m is None) != (p is None):
                    raise SystemExit(f"{describe(case)}: phase {phase} measured {m} but predicted {p}")
                cells.append("–")
                continue
            errors[phase].append((p - m) / m)
            cells.append(f"{m / 1e6:.3f} / {p / 1e6:.3f} ({(p - m) / m:+.2%})")
        rows.append(f"| {describe(case)} | " + " | ".join(cells) + " |")
    return rows, errors


def summary(errors: dict[str, list[float]]) -> list[str]:
    out = ["| phase | points | median abs error | max abs error |", "| --- | --- | --- | --- |"]
    for phase, errs in errors.items():
        if errs:
            a = [abs(e) for e in errs]
            out.append(f"| {phase} | {len(a)} | {statistics.median(a):.2%} | {max(a):.2%} |")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devkit.bench.grpo_grid", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"only points {QUICK}")
    ap.add_argument("--out", type=Path, help="write the markdown table here too, the measurements beside (.json)")
    ap.add_argument("--measured", type=Path, help="predict again for the measurements saved in this file")
    ap.add_argument("--points", help="with --measured: measure these grid points again (comma-separated, from 1)")
    args = ap.parse_args(argv)
    cases = tuple(GRID[i] for i in QUICK) if args.quick else GRID
    t0 = time.time()
    if args.measured:
        points = json.loads(args.measured.read_text(encoding="utf-8"))
        if args.points:  # measured again, saved in place
            for i in (int(x) - 1 for x in args.points.split(",")):
                points[i] = measure_all((GRID[i],))[0]
            args.measured.write_text(json.dumps(points, indent=1, default=str), encoding="utf-8")
    else:
        points = measure_all(cases)
        if args.out:
            args.out.with_suffix(".json").write_text(json.dumps(points, indent=1, default=str), encoding="utf-8")
    rows, errors = run(points)
    head = "| point | " + " | ".join(PHASES) + " |"
    lines = [
        "Cells: measured / predicted MB (error). Phases the step does not run: –.",
        "",
        head,
        "| " + " | ".join(["---"] * (len(PHASES) + 1)) + " |",
        *rows,
        "",
        *summary(errors),
        "",
        f"{len(points)} points" + ("" if args.measured else f", measured in {time.time() - t0:.0f} s") + ".",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        command = "python -m devkit.bench.grpo_grid" + (" --quick" if args.quick else "") + f" --out {args.out}"
        if args.measured:
            command += f" --measured {args.measured}" + (f" --points {args.points}" if args.points else "")
        intro = (__doc__ or "").split("\n\n", 2)[2].strip()
        args.out.write_text(f"# GRPO: the CPU estimator grid\n\nCommand: `{command}`\n\n{intro}\n\n{text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
