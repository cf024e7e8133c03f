"""FSDP2 per rank: each rank's exact live tensor bytes per phase against the per-device plan, on CPU ranks (gloo).

    python -m devkit.bench.fsdp_grid                                  # 16 points: 2 families × LoRA / full ×
                                                                      # 2 and 4 ranks × checkpointing off / on
    python -m devkit.bench.fsdp_grid --families llama3 --ranks 2      # a subset
    python -m devkit.bench.fsdp_grid --out benchmarks/fsdp_grid.md --cache benchmarks/fsdp_grid.json
    python -m devkit.bench.fsdp_grid --adapters qlora --ranks 2,4 --out benchmarks/fsdp_grid.md --append \
        --cache benchmarks/fsdp_grid.json                             # QLoRA, 8 points

Each point runs `devkit.harness.fsdp` (N spawned processes, accelerate's `fsdp2_prepare_model` units, two
optimizer steps measured by `PeakMemory` on every rank) and compares every rank's steady-state phases (micro-step
2.2 and step 2, as `devkit.bench.estimator`) with `lowmem_ft.memory.sharding.fsdp2_phase_bytes`. QLoRA is not in
the default grid (`--adapters lora,full,qlora` adds it; see docs/fsdp.md). `--cache` keeps each
finished point's measurements (JSON), so a grid interrupted on a busy machine resumes where it stopped.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from devkit.harness.estimator import recipe_for, write_model
from devkit.harness.fsdp import PHASES, FsdpPoint, measure, phase_measurements
from devkit.zoo import estimator_config

FAMILIES = ("llama3", "qwen2.5")  # tied embeddings and a 3-layer accuracy-grid width (devkit/zoo.py ESTIMATOR_SHAPES)
TARGETS = "(targets: per-phase median ≤ 1 %, max ≤ 3 %)"


def grid(families=FAMILIES, ranks=(2, 4), adapters=("lora", "full")) -> list[FsdpPoint]:
    return [FsdpPoint(f, a, n, c) for n, a, f, c in itertools.product(ranks, adapters, families, (False, True))]


def key(p: FsdpPoint) -> str:
    return f"{p.family}/{p.adapter}/{p.ranks}/{'ckpt' if p.checkpointing else 'no-ckpt'}/{p.batch}x{p.seq}"


def predicted(model_dir: Path, p: FsdpPoint) -> dict[str, float]:
    from lowmem_ft.choosing import setup_from_recipe
    from lowmem_ft.memory.arch import Architecture
    from lowmem_ft.memory.sharding import fsdp2_phase_bytes

    config = json.loads((model_dir / "lowmem_config.json").read_text())
    setup = setup_from_recipe(recipe_for(model_dir, p.point()), device="cpu")
    return fsdp2_phase_bytes(Architecture.from_config(config, name=p.family), setup, p.ranks)


def table(rows: list[tuple[FsdpPoint, dict[str, float]]]) -> tuple[str, list[float]]:
    header = ["family", "adapter", "ranks", "ckpt", "rank", *(f"{ph} MB" for ph in PHASES), "max |error|"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    errors = []
    for p, pred in rows:
        for r, phases in sorted(p.phases.items()):
            m = phase_measurements(phases)
            errs = [(pred[ph] - m[ph]) / m[ph] for ph in PHASES]
            errors += errs
            cells = [f"{m[ph] / 1e6:.3f} / {pred[ph] / 1e6:.3f} ({e:+.2%})" for ph, e in zip(PHASES, errs, strict=True)]
            ck = "on" if p.checkpointing else "off"
            lines.append(
                f"| {p.family} | {p.adapter} | {p.ranks} | {ck} | {r} | " + " | ".join(cells)
                + f" | {max(abs(e) for e in errs):.2%} |"
            )  # fmt: skip
    return "\n".join(lines), errors


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--adapters", default="lora,full", help="of lora, full, qlora")
    ap.add_argument("--out", help="write the table here (markdown)")
    ap.add_argument("--cache", help="JSON file of finished points' measurements (read and extended)")
    ap.add_argument("--append", action="store_true", help="add this table to --out instead of replacing it")
    args = ap.parse_args(argv)
    points = grid(
        tuple(args.families.split(",")), tuple(int(n) for n in args.ranks.split(",")), tuple(args.adapters.split(","))
    )
    cache = json.loads(Path(args.cache).read_text()) if args.cache and Path(args.cache).exists() else {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {f: write_model(estimator_config(f), Path(tmp) / f) for f in {p.family for p in points}}
        for p in points:
            k = key(p)
            if k in cache:
                p.phases = {int(r): {ph: tuple(v) for ph, v in d.items()} for r, d in cache[k].items()}
            else:
                t = time.time()
                p.phases = measure(dirs[p.family], p)
                print(f"{k}: {time.time() - t:.0f} s", flush=True)
                if args.cache:
                    cache[k] = p.phases
                    Path(args.cache).write_text(json.dumps(cache))
            rows.append((p, predicted(dirs[p.family], p)))
    text, errors = table(rows)
    peaks = [abs(e) for e, ph in zip(errors, itertools.cycle(PHASES)) if ph != "static"]
    abs_err = [abs(e) for e in errors]
    summary = (
        f"per-phase |error| median {statistics.median(abs_err):.2%}, max {max(abs_err):.2%} over "
        f"{len(errors)} rank-phases of {len(rows)} points {TARGETS}\n"
        f"peaks only (forward, backward, optimizer step): median {statistics.median(peaks):.2%}, "
        f"max {max(peaks):.2%} over {len(peaks)} rank-phases"
    )
    print(text)
    print(summary)
    if args.out:
        note = (
            "FSDP2 (accelerate's `fsdp2_prepare_model`: a unit per decoder layer, an untied embedding, the final norm + "
            "LM head, the root) on CPU ranks (gloo), measured by "
            f"`python -m devkit.bench.fsdp_grid --adapters {args.adapters} --ranks {args.ranks}`.\nCells: measured / "
            "predicted peak live MB per rank "
            "(micro-step 2.2 and step 2; exact live tensor bytes, `PeakMemory`), predicted by "
            "`lowmem_ft.memory.sharding.fsdp2_phase_bytes`. Models: the zoo families at the accuracy grid's width "
            "(hidden 256, 3 layers), batch 2 × 128 tokens, AdamW (torch), LoRA r 8.\n\n"
            "gloo's reduce-scatter clones its input and frees the clone on its worker thread after the step has "
            "moved on; the harness waits for those clones to be freed before ending a phase (devkit/harness/fsdp.py, "
            "docs/fsdp.md): NCCL has no such copy.\n"
        )
        if args.append:
            with Path(args.out).open("a", encoding="utf-8") as f:
                f.write(f"\n## {args.adapters} on {args.ranks} ranks\n\n{text}\n\n{summary}\n")
        else:
            Path(args.out).write_text(f"{note}\n{text}\n\n{summary}\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
