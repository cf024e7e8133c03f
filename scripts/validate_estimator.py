"""Accuracy of the memory model: predicted vs measured peak live tensor bytes over a grid of real CPU training steps.

    python scripts/validate_estimator.py            # full grid (2 archs × full/LoRA/QLoRA × AdamW/8-bit × ckpt × 2 b × 2 s)
    python scripts/validate_estimator.py --quick    # a subset
    python scripts/validate_estimator.py --out benchmarks/estimator_cpu.md

Device overheads are excluded (CPU): the comparison is of the model's live tensor bytes (PeakMemory) with
`estimate(...).model_peak_bytes`. Models are tiny random-initialized Qwen2 / Llama shapes (see ARCHS) so the grid
runs on a shared 2-core CPU; their vocabularies, widths and GQA ratios differ on purpose.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lowmem_ft.train.estimator_check import Point, run_point, write_model  # noqa: E402

ARCHS = {
    "qwen2-s (V 4000, h 128, GQA 4/2)": {
        "model_type": "qwen2", "vocab_size": 4000, "hidden_size": 128, "intermediate_size": 384,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False,
    },
    "llama-s (V 3000, h 160, MHA 5/5)": {
        "model_type": "llama", "vocab_size": 3000, "hidden_size": 160, "intermediate_size": 448,
        "num_hidden_layers": 2, "num_attention_heads": 5, "num_key_value_heads": 5,
    },
}  # fmt: skip


def grid(quick: bool):
    adapters = ["full", "lora", "qlora"]
    optims = ["adamw_torch"] if quick else ["adamw_torch", "adamw_8bit"]
    ckpts = [False, True]
    shapes = [(1, 128), (2, 256)] if quick else [(1, 128), (2, 128), (1, 256), (2, 256)]
    archs = list(ARCHS)[:1] if quick else list(ARCHS)
    yield from itertools.product(archs, adapters, optims, ckpts, shapes)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", help="write the markdown table here")
    args = ap.parse_args(argv)
    rows, errors = [], []
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {name: write_model(cfg, Path(tmp) / str(i)) for i, (name, cfg) in enumerate(ARCHS.items())}
        for arch, adapter, optim, ckpt, (b, s) in grid(args.quick):
            started = time.time()
            p = run_point(dirs[arch], Point(arch, adapter, optim, ckpt, b, s))
            errors.append(p.error)
            row = (
                f"| {arch} | {adapter} | {optim} | {'on' if ckpt else 'off'} | {b} | {s} | "
                f"{p.measured / 1e6:.1f} | {p.predicted / 1e6:.1f} | {p.error:+.1%} |"
            )
            rows.append(row)
            print(row, f"({time.time() - started:.0f} s)", flush=True)
    abs_err = [abs(e) for e in errors]
    summary = (
        f"median |error| {statistics.median(abs_err):.1%}, max |error| {max(abs_err):.1%} over {len(errors)} points"
    )
    table = "\n".join(
        [
            "| model | adapter | optimizer | ckpt | batch | seq | measured MB | predicted MB | error |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            *rows,
        ]
    )
    print(summary)
    if args.out:
        Path(args.out).write_text(f"{table}\n\n{summary} (targets: median ≤ 3 %, max ≤ 8 %)\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
