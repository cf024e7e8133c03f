"""CPU step time and exact peak with and without each long-context technique (tiled MLP, tiled norms, LoRA
recompute, host embeddings, loss chunk size).

    python scripts/bench_context.py [--seq 2048] [--steps 3] [--dtype float32] [--out benchmarks/context_cpu.md]

One random-initialized Llama-shaped model (vocab 16,000, hidden 256, intermediate 1,024, 4 layers, GQA 4/2; LoRA r 16
on all linears, dropout 0.05, checkpointing on, chunked loss), trained through `build_model` + the loss head `train`
installs, one micro batch of `--seq` tokens per step; the median of `--steps` timed steps after one warm-up step,
and PeakMemory's exact peak of live tensor bytes over one more step. CPU time is only a relative cost here: on a GPU
the recompute costs the same FLOPs, but the host embedding lookup adds a host→device copy the CPU does not have.
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

from devkit.long_context_check import LongPoint, _loss_head, recipe_for, write_model  # noqa: E402

CONFIG = {
    "model_type": "llama", "vocab_size": 16000, "hidden_size": 256, "intermediate_size": 1024,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
}  # fmt: skip
VARIANTS = [
    ("baseline: checkpointing + chunked loss (auto chunk)", {}),
    ("+ tiled MLP", {"tiled_mlp": True}),
    ("+ tiled norms", {"tiled_norms": True}),
    ("+ LoRA recompute", {"recompute_lora": True}),
    ("+ host embeddings", {"host_embeddings": True}),
    ("loss chunk 32 tokens", {"loss_chunk_tokens": 32}),
    ("loss chunk 1,024 tokens", {"loss_chunk_tokens": 1024}),
    ("all: tiled MLP + norms, LoRA recompute, host embeddings",
     {"tiled_mlp": True, "tiled_norms": True, "recompute_lora": True, "host_embeddings": True}),
]  # fmt: skip


def step_times(model_dir: Path, point: LongPoint, steps: int, dtype: str) -> tuple[float, int]:
    import torch

    from lowmem_ft.train.measure import PeakMemory
    from lowmem_ft.train.model import build_model

    recipe = recipe_for(model_dir, point)
    recipe.model.compute_dtype = dtype
    torch.manual_seed(0)
    model = build_model(recipe)
    _loss_head(model, point)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    ids = torch.randint(0, CONFIG["vocab_size"], (1, point.seq), generator=torch.Generator().manual_seed(1))

    def step():
        out = model(input_ids=ids, labels=ids, fused_lm_head=True)
        (-out.log_probs.sum() / out.label_mask.sum()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    with PeakMemory() as pm:
        start = pm.live_bytes
        step()
    return statistics.median(times), pm.peak_bytes - start


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    rows = []
    base_time = base_peak = None
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(CONFIG, Path(tmp) / "m")
        for label, knobs in VARIANTS:
            point = LongPoint("llama", "lora", True, args.seq, **knobs)
            seconds, peak = step_times(model_dir, point, args.steps, args.dtype)
            base_time, base_peak = base_time or seconds, base_peak or peak
            rows.append(
                f"| {label} | {seconds:.2f} | {seconds / base_time - 1:+.0%} | {peak / 1e6:.1f} | "
                f"{peak / base_peak - 1:+.0%} |"
            )
            print(rows[-1], flush=True)
    table = "\n".join(
        [
            f"| variant ({args.seq} tokens, {args.dtype}) | CPU s/step | vs baseline | peak above weights MB | vs baseline |",
            "| --- | ---: | ---: | ---: | ---: |",
            *rows,
        ]
    )
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
