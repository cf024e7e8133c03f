"""What the memory model predicts each long-context saver buys: the longest sequence that fits, per technique set.

    python -m devkit.bench.long_context_predicted [--out benchmarks/long_context_predicted.md]

Pure arithmetic over `lowmem_ft.memory.estimate` (no planner, no GPU): QLoRA NF4, LoRA rank 32 on all linear layers
(dropout 0.05), paged 8-bit AdamW, batch 1, checkpointing with activation offloading and the chunked loss (whose
chunk gets what the rest leaves, `largest_loss_chunk`), CUDA overheads on, under VRAM − the tier's margin
(0.75 / 1.5 / 2.0 GB). Each row adds one saver. These are predictions of the CPU-checked model
(benchmarks/long_context_cpu.md), not measurements: the CUDA-only terms are the assumptions listed in
lowmem_ft/memory/estimate.py. The planner turns them on by itself when needed: `devkit/bench/max_context.py`
tabulates its own choice.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from lowmem_ft.memory.arch import load_architecture
from lowmem_ft.memory.estimate import GB, Setup, estimate, largest_loss_chunk

MODELS = ["meta-llama/Llama-3.1-8B", "Qwen/Qwen2.5-7B"]
MARGIN = {8: 0.75, 24: 1.5, 40: 2.0}
BASE = {"activation_offloading": True, "loss_impl": "chunked", "gradient_accumulation": 1}  # as the table was made
ROWS = [
    ("checkpointing + offloading + chunked loss (today's savers)", {}),
    ("+ tiled MLP", {"tiled_mlp": True}),
    ("+ host embeddings", {"tiled_mlp": True, "embeddings_on_host": True}),
    ("+ LoRA recompute", {"tiled_mlp": True, "embeddings_on_host": True, "recompute_lora": True}),
    ("+ tiled norms", {"tiled_mlp": True, "embeddings_on_host": True, "recompute_lora": True, "tiled_norms": True}),
    ("all, tiles of 1,024 tokens", {"tiled_mlp": True, "embeddings_on_host": True, "recompute_lora": True,
                                    "tiled_norms": True, "mlp_tile_tokens": 1024}),
]  # fmt: skip
TARGETS = {8: 3000, 24: 100_000, 40: 200_000}  # the issue's, for Llama-3.1-8B


def fitted(arch, vram: int, seq: int, knobs: dict) -> tuple[bool, object]:
    """Does `seq` fit, with the loss chunk sized from what the rest of the step leaves?"""
    s = Setup(lora_r=32, lora_targets=("all-linear",), max_seq_len=seq, safety_margin_gb=MARGIN[vram], **BASE, **knobs)
    budget = (vram - MARGIN[vram]) * GB
    smallest = estimate(arch, replace(s, loss_chunk_tokens=1))
    loss_now = smallest.by_name()["logits / loss working set"]
    room = (budget - smallest.peak_bytes) / 1.1 + loss_now  # the allocator term grows with the transient (10 %)
    s = replace(s, loss_chunk_tokens=max(1, largest_loss_chunk(arch, s, max(room, 0))))
    est = estimate(arch, s)
    return est.peak_bytes <= budget, est


def longest(arch, vram: int, knobs: dict) -> int:
    lo, hi, best = 16, 1 << 20, 0
    while lo <= hi:
        mid = (lo + hi) // 2 // 16 * 16 or 16
        if fitted(arch, vram, mid, knobs)[0]:
            best, lo = mid, mid + 16
        else:
            hi = mid - 16
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m devkit.bench.long_context_predicted", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    out = [
        "`python -m devkit.bench.long_context_predicted`: the longest sequence the memory model predicts per saver "
        "set (predictions, not measurements), QLoRA r32 on all linear layers, batch 1.",
        "",
    ]
    for name in MODELS:
        arch = load_architecture(name)
        out += [f"| {name} | 8 GB | 24 GB | 40 GB |", "| --- | ---: | ---: | ---: |"]
        for label, knobs in ROWS:
            out.append(f"| {label} | " + " | ".join(f"{longest(arch, v, knobs):,}" for v in (8, 24, 40)) + " |")
            print(out[-1], flush=True)
        out.append("")
    arch = load_architecture(MODELS[0])
    out.append(f"Largest components of {MODELS[0]} at the issue's targets, all savers (tiles of 1,024 tokens):\n")
    for vram, seq in TARGETS.items():
        ok, est = fitted(arch, vram, seq, ROWS[-1][1])
        out.append(f"- {vram} GB, {seq:,} tokens: peak {est.peak_gb:.2f} GB of {vram - MARGIN[vram]:g} GB "
                   f"({'fits' if ok else 'does not fit'}): " + "; ".join(
                       f"{c.name} {c.gb:.2f}" + (" (host)" if c.phase == "host" else "")
                       for c in sorted(est.components, key=lambda c: -c.bytes)[:7]))  # fmt: skip
    text = "\n".join(out)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
