"""`lowmem-ft plan` at PEFT's MetaMathQA settings, against lowmem-ft's own training step at those settings.

    python -m devkit.bench.published_plan                                   # traces, writes benchmarks/published.json
    python -m devkit.bench.published --rewrite --out benchmarks/published.md  # renders its section

The `plan` column of `benchmarks/published.md` sets what lowmem-ft plans against what PEFT's loop reserved, and the
two loops hold different tensors. PEFT's run.py keeps each step's `outputs` (the bf16 logits and the KV cache)
through its backward and until the next forward returns. lowmem-ft's trainer (TRL's SFTTrainer with the
full-logits head, like transformers' Trainer) drops them before the backward. So this section also sets the plan
against lowmem-ft's own step at the same settings. That step is the recipe the plan resolves (`plan_overrides`:
`memory.full_logits_loss`, one micro batch of 4 × the longest batch's tokens per optimizer step), traced whole on
shape-only tensors. `allocation_log` runs it with `ONE_MICRO_BATCH`: a step of 8 tokens that makes AdamW's state,
then the full batch. Its allocations are replayed through the allocator model twice: with torch's default settings
(PEFT's) and with expandable segments (what `train` sets). The cuBLAS workspaces the plan counts are added to each.

The plan's allocator term for the default settings is assumed (10 % of the transient), and the expandable one is
derived from other steps (benchmarks/allocator_term.md); these rows took no part in either. Each figure is a
prediction checked against a replay, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from devkit.harness import peft_metamathqa as pub

KEY = "own_step"
GB = 1e9
SECTION = """
## The plan against lowmem-ft's own step

Written by `python -m devkit.bench.published_plan` (its docstring says how). PEFT's loop keeps each step's outputs
(the bf16 logits, the KV cache) through its backward and into the next step, where lowmem-ft's trainer drops them,
so the `plan` column above is also set against lowmem-ft's own step at PEFT's settings: the recipe the plan
resolves, one micro batch of 4 × {length} tokens per optimizer step, traced whole on shape-only tensors and replayed
through the allocator model with each setting. `step reserved`: the replay's peak reserved plus the plan's cuBLAS
workspaces ({cublas:.3f} GB). `plan`: the plan's peak less its CUDA context, planned with that setting.
`allowance`: the plan's allocator term. `excess`: the replay's reserved less its live peak. Predictions against a
replay, not measurements.

"""


def configurations() -> list[pub.Published]:
    """One result per configuration (the newest generation): the plan and lowmem-ft's step read no library date."""
    newest = max(r.date for r in pub.published())
    return [r for r in pub.published() if r.date == newest]


def own_step(result: pub.Published, length: int) -> dict:
    """lowmem-ft's step for the recipe the plan resolves at `length` tokens, traced whole and replayed with each
    allocator setting: {"live": the peak of live bytes, "default" / "expandable": the peak reserved, "seconds"}."""
    from devkit.bench.allocator_term import train_peaks
    from lowmem_ft.train.trace.step import ONE_MICRO_BATCH, allocation_log, model_config

    started = time.perf_counter()
    recipe, _ = pub.plan_at(result, length)
    peaks = train_peaks(allocation_log(recipe, model_config(recipe), steps=ONE_MICRO_BATCH))
    return {
        "live": peaks["default"]["live"],
        "default": peaks["default"]["reserved"],
        "expandable": peaks["expandable"]["reserved"],
        "seconds": round(time.perf_counter() - started),
    }


def _plan(result: pub.Published, length: int, expandable: bool) -> tuple[float, float, float]:
    """The plan's peak less the CUDA context, its live peak and its allocator term, bytes."""
    from lowmem_ft.memory.calibration import CUDA_CONTEXT_BYTES
    from lowmem_ft.memory.overheads import allocator_component_bytes

    est = pub.plan_at(result, length, expandable)[1].plan.estimate
    return est.peak_bytes - CUDA_CONTEXT_BYTES, est.model_peak_bytes, allocator_component_bytes(est.components)


def render(cache: dict) -> str:
    """The section, from what `main` cached (empty when nothing was traced)."""
    from lowmem_ft.memory.calibration import CUBLAS_WORKSPACE_BYTES

    rows = cache.get(KEY)
    if not rows:
        return ""
    length = cache["lengths"][0]
    out = [
        SECTION.format(length=length, cublas=CUBLAS_WORKSPACE_BYTES / GB),
        "| configuration | allocator | plan GB | step reserved GB | gap | plan live GB | traced live GB | gap | "
        "allowance GB | excess GB | PEFT's published max GB | trace s |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    ]
    for result in configurations():
        row = rows.get(result.name)
        if row is None:
            continue
        for setting in ("default", "expandable"):
            plan, live, allowance = _plan(result, length, setting == "expandable")
            step = row[setting] + CUBLAS_WORKSPACE_BYTES
            name = "torch's default settings" if setting == "default" else "expandable segments"
            out.append(
                f"| {result.label} | {name} | {plan / GB:.2f} | {step / GB:.2f} | {pub.gap(plan, step)} | "
                f"{live / GB:.2f} | {row['live'] / GB:.2f} | {pub.gap(live, row['live'])} | {allowance / GB:.2f} | "
                f"{(row[setting] - row['live']) / GB:.2f} | {result.max_reserved / GB:.2f} | {row['seconds']} |\n"
            )
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=Path("benchmarks/published.json"))
    parser.add_argument("--only", nargs="*", default=None, help="result names to trace (default: every one)")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    cache = json.loads(args.cache.read_text())
    section = cache.setdefault(KEY, {})
    for result in configurations():
        if args.only is None or result.name in args.only:
            print(f"tracing lowmem-ft's step for {result.label}", flush=True)
            section[result.name] = own_step(result, cache["lengths"][0])
            args.cache.write_text(json.dumps(cache, indent=1))
    print(render(cache))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
