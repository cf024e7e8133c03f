"""The long-context memory terms (tiled MLP and norms, LoRA recompute, host embeddings, loss chunk size) against
exact CPU measurement.

    python -m devkit.bench.long_context [--quick] [--out benchmarks/long_context_cpu.md]

Each point trains two optimizer steps through `build_model` with the knobs on (devkit/harness/long_context.py) and
compares PeakMemory's exact peak of live tensor bytes with `estimate(...).model_peak_bytes` (device overheads
excluded), per phase too. Narrow models (hidden 96-160) at 1k-8k tokens, so the per-token terms of the layers —
what the tiled MLP changes — decide the peak rather than the weights; vocabularies of 2-4k with small loss chunks
keep the loss from hiding them, and a few points use the automatic chunk or TRL's fused head.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from devkit.harness.estimator import phase_cells, phase_measurements, write_accuracy_table
from devkit.harness.long_context import LongPoint, run_point, write_model

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
        "sliding_window": None,
    },
    "mistral-sw (as above, 2,048-token window)": {  # Mistral-7B-v0.1's kind: longer sequences get s × s masks
        "model_type": "mistral", "vocab_size": 4000, "hidden_size": 160, "intermediate_size": 384,
        "num_hidden_layers": 2, "num_attention_heads": 5, "num_key_value_heads": 5, "sliding_window": 2048,
    },
}  # fmt: skip

# LongPoint keyword arguments; the first is the long-context plan (everything on), the rest vary one thing at a time
ALL = dict(tiled_mlp=True, tiled_norms=True, recompute_lora=True)  # the four savers a long-context plan turns on
POINTS = [
    dict(adapter="lora", checkpointing=True, seq=4096, **ALL, loss_chunk_tokens=64),
    dict(adapter="qlora", checkpointing=True, seq=8192, **ALL, host_embeddings=True, loss_chunk_tokens=128,
         optimizer="adamw_8bit"),  # longest: the tiled terms dominate
    dict(adapter="lora", checkpointing=True, seq=2048, loss_chunk_tokens=64),  # untiled reference
    dict(adapter="qlora", checkpointing=True, seq=8192, tiled_mlp=True, host_embeddings=True, loss_chunk_tokens=128),
    dict(adapter="lora", checkpointing=True, seq=2048, tiled_mlp=True, tile_tokens=1024, loss_chunk_tokens=64,
         optimizer="adamw_8bit"),  # a large tile: its term decides
    dict(adapter="qlora", checkpointing=True, seq=4096, recompute_lora=True, loss_chunk_tokens=64),  # one at a time
    dict(adapter="qlora", checkpointing=True, seq=2048, tiled_norms=True, loss_chunk_tokens=64),
    dict(adapter="lora", checkpointing=False, seq=2048, tiled_mlp=True, host_embeddings=True, loss_chunk_tokens=64),
    dict(adapter="lora", checkpointing=False, seq=2048, **ALL, tile_tokens=64, loss_chunk_tokens=32),
    dict(adapter="qlora", checkpointing=True, seq=2048, tiled_mlp=True, loss_chunk_tokens=0, dropout=0.0),  # auto chunk
    dict(adapter="lora", checkpointing=True, seq=4096, **ALL, loss_chunk_tokens=2048),  # a budget-sized large chunk
    dict(adapter="lora", checkpointing=True, seq=1024, tiled_mlp=True, host_embeddings=True, chunked_loss=False),
    dict(adapter="lora", checkpointing=True, seq=2048, tiled_mlp=True, tiled_norms=True, loss_chunk_tokens=64),
]  # fmt: skip
# (the last: tiled MLP + norms without LoRA recompute, where the recomputed attention's LoRA backward decides)
QUICK = [0, 1, 4]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devkit.bench.long_context", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 points on the first model")
    ap.add_argument("--out", help="write the markdown table here")
    args = ap.parse_args(argv)
    rows, errors = [], []
    archs = list(ARCHS)[:1] if args.quick else list(ARCHS)
    points = [POINTS[k] for k in QUICK] if args.quick else POINTS
    with tempfile.TemporaryDirectory() as tmp:
        for n, arch in enumerate(archs):
            model_dir = write_model(ARCHS[arch], Path(tmp) / str(n))
            for kw in points:
                started = time.time()
                p = run_point(model_dir, LongPoint(arch.split(" ")[0], **kw))
                errors.append(p.error)
                cells = phase_cells(phase_measurements(p), p.predicted_phases, digits=2)
                extra = (f", tile {p.tile_tokens}" if p.tile_tokens else "") + ("" if p.dropout else ", no dropout")
                row = (
                    f"| {p.arch} | {p.adapter} | {'on' if p.checkpointing else 'off'} | {p.seq} | {p.knobs()}{extra} | "
                    f"{p.optimizer} | {cells} | {p.measured / 1e6:.2f} | {p.predicted / 1e6:.2f} | {p.error:+.1%} |"
                )
                rows.append(row)
                print(row, f"({time.time() - started:.0f} s)", flush=True)
    write_accuracy_table(["model", "adapter", "ckpt", "seq", "knobs", "optimizer"], rows, errors, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
