"""The long-context memory terms (tiled MLP, host embeddings, loss chunk size) against exact CPU measurement.

    python scripts/validate_long_context.py [--quick] [--out benchmarks/long_context_cpu.md]

Each point trains two optimizer steps through `build_model` with the knobs on (devkit/long_context_check.py) and
compares PeakMemory's exact peak of live tensor bytes with `estimate(...).model_peak_bytes` (device overheads
excluded), per phase too. Narrow models (hidden 96-160) at 1k-8k tokens, so the per-token terms of the layers —
what the tiled MLP changes — decide the peak rather than the weights; vocabularies of 2-4k with small loss chunks
keep the loss from hiding them, and a few points use the automatic chunk or TRL's fused head.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from devkit.long_context_check import LongPoint, phase_measurements, run_point, write_model  # noqa: E402

ARCHS = {
    "llama (V 2000, h 128, i 512, 2 L, GQA 4/2)": {
        "model_type": "llama", "vocab_size": 2000, "hidden_size": 128, "intermediate_size": 512,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    },
    "qwen2 (V 3000, h 96, i 448, 3 L, GQA 6/2, bias)": {
        "model_type": "qwen2", "vocab_size": 3000, "hidden_size": 96, "intermediate_size": 448,
        "num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 2, "tie_word_embeddings": False,
    },
    "mistral (V 4000, h 160, i 384, 2 L, MHA 5/5)": {
        "model_type": "mistral", "vocab_size": 4000, "hidden_size": 160, "intermediate_size": 384,
        "num_hidden_layers": 2, "num_attention_heads": 5, "num_key_value_heads": 5,
        "sliding_window": None,  # a window below seq makes SDPA materialize an s × s mask (not modelled yet)
    },
}  # fmt: skip

# (adapter, checkpointing, seq, tiled, tile tokens, host embeddings, chunked loss, chunk tokens, optimizer, dropout)
POINTS = [
    ("lora", True, 4096, True, 0, False, True, 64, "adamw_torch", 0.05),  # the long-context plan: all on
    ("qlora", True, 4096, True, 0, True, True, 64, "adamw_8bit", 0.05),
    ("lora", True, 2048, False, 0, False, True, 64, "adamw_torch", 0.05),  # untiled reference at the same shape
    ("qlora", True, 8192, True, 0, True, True, 128, "adamw_torch", 0.05),  # longest: tiled terms dominate
    ("lora", True, 2048, True, 1024, False, True, 64, "adamw_8bit", 0.05),  # a large tile: its term decides
    ("lora", False, 2048, True, 0, True, True, 64, "adamw_torch", 0.05),  # tiled without layer checkpointing
    ("qlora", True, 2048, True, 0, False, True, 0, "adamw_torch", 0.0),  # automatic chunk, no dropout
    ("lora", True, 1024, True, 0, True, False, 0, "adamw_torch", 0.05),  # TRL's fused loss
]
QUICK = [0, 3, 4]
PHASES = ("static", "forward", "backward", "optimizer step")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 points on the first model")
    ap.add_argument("--out", help="write the markdown table here")
    args = ap.parse_args(argv)
    rows, errors = [], []
    archs = list(ARCHS)[:1] if args.quick else list(ARCHS)
    points = [POINTS[k] for k in QUICK] if args.quick else POINTS
    with tempfile.TemporaryDirectory() as tmp:
        for n, arch in enumerate(archs):
            model_dir = write_model(ARCHS[arch], Path(tmp) / str(n))
            for adapter, ckpt, seq, tiled, tile, host, chunked, chunk, optim, drop in points:
                started = time.time()
                p = LongPoint(arch.split(" ")[0], adapter, ckpt, seq, 1, tiled, tile, host, chunked, chunk, optim, drop)
                run_point(model_dir, p)
                errors.append(p.error)
                measured = phase_measurements(p)
                cells = " | ".join(f"{measured[k] / 1e6:.2f} / {p.predicted_phases[k] / 1e6:.2f}" for k in PHASES)
                row = (
                    f"| {p.arch} | {adapter} | {'on' if ckpt else 'off'} | {seq} | {p.knobs()}"
                    f"{', tile ' + str(tile) if tiled and tile else ''}{', no dropout' if not drop else ''} | "
                    f"{optim} | {cells} | {p.measured / 1e6:.2f} | {p.predicted / 1e6:.2f} | {p.error:+.1%} |"
                )
                rows.append(row)
                print(row, f"({time.time() - started:.0f} s)", flush=True)
    abs_err = [abs(e) for e in errors]
    summary = (
        f"median |error| {statistics.median(abs_err):.1%}, max |error| {max(abs_err):.1%} over {len(errors)} points"
    )
    table = "\n".join(
        [
            "| model | adapter | ckpt | seq | knobs | optimizer | static MB | forward MB | backward MB | step MB "
            "| peak measured MB | peak predicted MB | error |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            *rows,
        ]
    )
    print(summary)
    if args.out:
        note = "Phase cells: measured / predicted peak live MB (micro-step 2.2 and step 2)."
        Path(args.out).write_text(
            f"{note}\n\n{table}\n\n{summary} (targets: median ≤ 3 %, max ≤ 8 %)\n", encoding="utf-8"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
