"""Accuracy of the memory model on mixtures of experts: predicted vs measured live tensor bytes, CPU.

    python -m devkit.bench.estimator_moe --out benchmarks/estimator_moe.md

Each family of `devkit.harness.moe.MOE_SHAPES` (Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE, Granite-MoE: tiny random models
of transformers 5.24's classes) × LoRA / QLoRA × checkpointing on / off at 1 × 512 tokens, plus a padded batch
(2 × 256) and an expert-wide shape (I = 4·h, Mixtral; I = 1.5·h top-8, Qwen3-MoE) per family where noted. Compared:
the whole step's peak (as `devkit/bench/estimator.py`) and the decoder layers' forward and backward windows
(`devkit.harness.moe.measure`), where the experts' terms are (the fused LM head's CPU tile buffer is the step's peak at
these sizes).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from devkit.harness.estimator import Point, write_model
from devkit.harness.moe import MOE_SHAPES, run_point

WIDE = {"mixtral": {"intermediate_size": 1024}, "qwen3_moe": {"moe_intermediate_size": 384}}


def grid(families):
    for family in families:
        for adapter in ("lora", "qlora"):
            for ckpt in (False, True):
                yield family, {}, adapter, ckpt, (1, 512)
        yield family, {}, "qlora", True, (2, 256)  # a padded batch: explicit masks
        if family in WIDE:
            for ckpt in (False, True):
                yield family, WIDE[family], "lora", ckpt, (1, 512)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devkit.bench.estimator_moe", description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(MOE_SHAPES))
    ap.add_argument("--out", help="write the markdown table here")
    args = ap.parse_args(argv)
    families = args.families.split(",")
    rows, errors, window_errors = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {}
        for family, over, adapter, ckpt, (b, s) in grid(families):
            key = (family, tuple(sorted(over.items())))
            if key not in dirs:
                dirs[key] = write_model({**MOE_SHAPES[family], **over}, Path(tmp) / str(len(dirs)))
            started = time.time()
            p = run_point(dirs[key], Point(family, adapter, "adamw_8bit", ckpt, b, s))
            errors.append(p.error)
            cells = []
            for name in ("layers forward", "layers backward"):
                measured, predicted = p.windows[name]
                window_errors.append((predicted - measured) / measured)
                cells.append(f"{measured / 1e6:.2f} / {predicted / 1e6:.2f} ({window_errors[-1]:+.1%})")
            shape = ", ".join(f"{k.split('_')[0]} I {v}" for k, v in over.items()) or "base"
            row = (
                f"| {family} | {shape} | {adapter} | {'on' if ckpt else 'off'} | {b} × {s} | {' | '.join(cells)} | "
                f"{p.measured / 1e6:.2f} / {p.predicted / 1e6:.2f} ({p.error:+.2%}) |"
            )
            rows.append(row)
            print(row, f"({time.time() - started:.0f} s)", flush=True)
    header = (
        "| family | shape | adapter | ckpt | batch × seq | layers forward MB meas / pred | layers backward MB meas / "
        "pred | step peak MB meas / pred |\n| --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    summary = (
        f"step peak: median |error| {statistics.median(abs(e) for e in errors):.2%}, max "
        f"{max(abs(e) for e in errors):.2%}; layers' windows: median |error| "
        f"{statistics.median(abs(e) for e in window_errors):.2%}, max {max(abs(e) for e in window_errors):.2%} "
        f"(min {min(window_errors):+.2%}) over {len(errors)} points"
    )
    print(summary)
    if args.out:
        Path(args.out).write_text(f"{header}\n" + "\n".join(rows) + f"\n\n{summary}\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
