"""Accuracy of the memory model on image steps: predicted vs measured live bytes per phase, tiny Qwen2.5-VL on the CPU.

    python -m devkit.bench.estimator_vision --out benchmarks/estimator_vision.md

The grid: the tower frozen / LoRA (`vision.train`) × gradient checkpointing × one and two images per sample × two
resolution caps (64 and 256 tokens per image), LoRA on the decoder, one row per micro batch. Each point is real
training steps of the zoo checkpoint (`devkit.harness.vision`: the run's build path, image chats collated by the run's
collator through the checkpoint's PIL image processor) measured exactly with PeakMemory, against
`lowmem_ft.memory.estimate.phase_peak_bytes` for the batch that ran (its tokens and patches). Targets: per-phase
|error| median ≤ 1 %, max ≤ 3 %.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from devkit.harness.estimator import TABLE_PHASES, phase_cells, phase_measurements
from devkit.harness.vision import VisionPoint, run_point

CAPS = (64 * 28 * 28, 256 * 28 * 28)


def points(trains: tuple[str, ...] = ("frozen", "lora")) -> list[VisionPoint]:
    return [VisionPoint(t, ck, n, cap) for t, ck, n, cap in itertools.product(trains, (True, False), (1, 2), CAPS)]


def errors(p: VisionPoint) -> dict[str, float]:
    measured = phase_measurements(p)
    return {k: p.predicted_phases[k] / measured[k] - 1 for k in TABLE_PHASES}


def row(p: VisionPoint) -> str:
    e = errors(p)
    return (
        f"| {p.train} | {'on' if p.checkpointing else 'off'} | {p.images} | {p.max_pixels:,} | {p.patches} | "
        f"{p.tokens} | {phase_cells(phase_measurements(p), p.predicted_phases, digits=2)} | "
        + " | ".join(f"{e[k]:+.2%}" for k in TABLE_PHASES)
        + " |"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devkit.bench.estimator_vision", description=__doc__.splitlines()[0])
    ap.add_argument("--trains", default="frozen,lora", help="vision.train values (frozen, lora, full)")
    ap.add_argument("--out", help="write the markdown table here")
    args = ap.parse_args(argv)
    from devkit.zoo import build

    model = str(build("qwen2.5-vl", Path(tempfile.mkdtemp()) / "qwen2.5-vl"))
    started, rows, done = time.time(), [], []
    for p in points(tuple(args.trains.split(","))):
        done.append(run_point(model, p))
        rows.append(row(p))
        print(rows[-1], flush=True)
    header = ["tower", "ckpt", "images", "max_pixels", "patches", "tokens", "static MB", "forward MB",
              "backward MB", "step MB", "static", "forward", "backward", "step"]  # fmt: skip
    abs_err = {k: [abs(errors(p)[k]) for p in done] for k in TABLE_PHASES}
    every = [e for errs in abs_err.values() for e in errs]
    summary = (
        f"per-phase |error| median {statistics.median(every):.2%}, max {max(every):.2%} over {len(done)} points × "
        f"{len(TABLE_PHASES)} phases (targets: median ≤ 1 %, max ≤ 3 %); by phase: "
        + ", ".join(f"{k} {statistics.median(v):.2%} / {max(v):.2%}" for k, v in abs_err.items())
    )
    print(summary)
    print(f"{len(done)} points in {time.time() - started:.0f} s")
    if args.out:
        note = (
            "Command: `python -m devkit.bench.estimator_vision --out benchmarks/estimator_vision.md` (CPU, exact live "
            "bytes with PeakMemory).\nTiny Qwen2.5-VL zoo checkpoint (devkit/zoo.py), LoRA r 8 on the decoder, "
            "adamw_torch, one row per micro batch; images 448×336 and 336×448 resized to the cap. Phase cells: "
            "measured / predicted peak live MB (micro-step 2.2 and step 2)."
        )
        table = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header), *rows]
        Path(args.out).write_text("\n".join([note, "", *table, "", summary, ""]), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
