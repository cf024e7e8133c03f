"""Accuracy of the memory model for preference training: each method's step on TRL's trainers, measured exactly.

    python -m devkit.bench.estimator_preference --out benchmarks/estimator_preference.md
    python -m devkit.bench.estimator_preference --methods kto --families llama3   # a subset

Each point (`devkit.harness.preference`) builds a zoo family at the accuracy grid's width through the `train` path
(`FineTune`: data fitted, model, TRL trainer, optimizer) and runs two optimizer steps of the trainer's own
`compute_loss` + backward under the exact CPU count. The grid: DPO with four loss types (sigmoid, IPO, robust,
hinge), ORPO, SimPO and KTO; LoRA, QLoRA (NF4) and full fine-tuning (DPO and KTO with both reference strategies:
a frozen copy, log-probs precomputed); checkpointing on and off; over Llama-3, Qwen2.5 and Gemma-2 (and Phi-3, Mistral),
the combinations rotating so each method meets each adapter and family. Targets (issue 21): median |error| ≤ 1 %,
max ≤ 3 % per phase.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from devkit.harness.estimator import TABLE_PHASES, phase_cells
from devkit.harness.preference import PrefPoint, run_points

# (family, method, adapter, checkpointing, loss_type, reference, optimizer); 2 pairs × 96 tokens each
GRID = [
    ("llama3", "dpo", "lora", True, "sigmoid", "auto", "adamw_torch"),
    ("qwen2.5", "dpo", "lora", False, "ipo", "auto", "adamw_8bit"),
    ("gemma2", "dpo", "qlora", True, "robust", "auto", "adamw_torch"),
    ("llama3", "dpo", "qlora", False, "hinge", "auto", "adamw_8bit"),
    ("qwen2.5", "dpo", "full", True, "sigmoid", "copy", "adamw_torch"),
    ("gemma2", "dpo", "full", False, "sigmoid", "copy", "adamw_8bit"),
    ("llama3", "dpo", "full", True, "ipo", "precomputed", "adamw_8bit"),
    ("phi3", "dpo", "full", False, "hinge", "precomputed", "adamw_torch"),
    ("mistral", "dpo", "lora", False, "robust", "auto", "adamw_torch"),
    ("llama3", "orpo", "lora", False, "sigmoid", "auto", "adamw_torch"),
    ("qwen2.5", "orpo", "qlora", True, "sigmoid", "auto", "adamw_8bit"),
    ("gemma2", "orpo", "full", True, "sigmoid", "auto", "adamw_torch"),
    ("qwen2.5", "simpo", "lora", True, "sigmoid", "auto", "adamw_torch"),
    ("gemma2", "simpo", "qlora", False, "sigmoid", "auto", "adamw_8bit"),
    ("llama3", "simpo", "full", False, "sigmoid", "auto", "adamw_8bit"),
    ("gemma2", "kto", "lora", False, "sigmoid", "auto", "adamw_torch"),
    ("llama3", "kto", "qlora", True, "sigmoid", "auto", "adamw_8bit"),
    ("qwen2.5", "kto", "full", True, "sigmoid", "precomputed", "adamw_torch"),
    ("phi3", "kto", "full", False, "sigmoid", "copy", "adamw_8bit"),
]
PAIRS, SEQ = 2, 96


def points(methods: set[str] | None = None, families: set[str] | None = None) -> list[PrefPoint]:
    return [
        PrefPoint(family, method, adapter, ckpt, PAIRS, SEQ, loss_type=loss, reference=ref, optimizer=optim)
        for family, method, adapter, ckpt, loss, ref, optim in GRID
        if (not methods or method in methods) and (not families or family in families)
    ]


def row(p: PrefPoint) -> str:
    errors = p.errors()
    worst = max(errors.values(), key=abs)
    return (
        f"| {p.family} | {p.method}{'/' + p.loss_type if p.method == 'dpo' else ''} | {p.adapter} | "
        f"{p.reference if p.adapter == 'full' and p.method in ('dpo', 'kto') else ''} | "
        f"{'on' if p.checkpointing else 'off'} | {p.optimizer} | {p.batch[0]} × {p.batch[1]} | "
        f"{phase_cells(p.measured(), p.predicted_phases, digits=2)} | "
        + " | ".join(f"{errors[k]:+.1%}" for k in TABLE_PHASES)
        + f" | {worst:+.1%} |"
    )


def summary(done: list[PrefPoint]) -> list[str]:
    """Median and max |error| per method and phase."""
    lines = ["| method | points | " + " | ".join(f"{k} median / max" for k in TABLE_PHASES) + " |",
             "|" + " --- |" * (2 + len(TABLE_PHASES))]  # fmt: skip
    for method in ("dpo", "orpo", "simpo", "kto", "all"):
        group = [p for p in done if method in ("all", p.method)]
        if not group:
            continue
        cells = []
        for k in TABLE_PHASES:
            errs = [abs(p.errors()[k]) for p in group]
            cells.append(f"{statistics.median(errs):.2%} / {max(errs):.2%}")
        lines.append(f"| {method} | {len(group)} | " + " | ".join(cells) + " |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m devkit.bench.estimator_preference", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--methods", help="a comma-separated subset of dpo, orpo, simpo, kto")
    ap.add_argument("--families", help="a comma-separated subset of the grid's families")
    ap.add_argument("--out", help="write the markdown table here")
    args = ap.parse_args(argv)
    methods = set(args.methods.split(",")) if args.methods else None
    families = set(args.families.split(",")) if args.families else None
    started = time.time()
    rows = []

    def show(p: PrefPoint) -> None:
        rows.append(row(p))
        print(rows[-1], flush=True)

    done = run_points(points(methods, families), progress=show)
    header = ["family", "method", "adapter", "reference", "ckpt", "optimizer", "rows × tokens", "static MB",
              "forward MB", "backward MB", "step MB", "static", "forward", "backward", "step", "worst"]  # fmt: skip
    table = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header), *rows]
    text = "\n".join([*table, "", *summary(done)])
    print("\n".join(summary(done)))
    print(f"{len(done)} points in {time.time() - started:.0f} s")
    if args.out:
        note = (
            "Command: `python -m devkit.bench.estimator_preference --out benchmarks/estimator_preference.md`.\n"
            f"Phase cells: measured / predicted peak live MB (micro-step 2.2 and step 2); {PAIRS} pairs per micro "
            "batch (KTO: completions), the full micro batch fitted to "
            f"{SEQ} tokens; errors are (predicted − measured) / measured. Targets: median |error| ≤ 1 %, max ≤ 3 % "
            "per phase.\n"
        )
        Path(args.out).write_text(f"{note}\n{text}\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
