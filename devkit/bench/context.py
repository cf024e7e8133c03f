"""CPU step time and exact peak with and without each long-context technique (tiled MLP, tiled norms, LoRA
recompute, host embeddings, loss chunk size).

    python -m devkit.bench.context [--seq 2048] [--rounds 7] [--dtype float32] [--out benchmarks/context_cpu.md]

One random-initialized Llama-shaped model (vocab 16,000, hidden 256, intermediate 1,024, 4 layers, GQA 4/2; LoRA r 16
on all linears, dropout 0.05, checkpointing on, chunked loss in 64-token chunks unless the row says otherwise),
trained through `build_model` + the loss head `train` installs, one micro batch of `--seq` tokens per step; every
variant is built first, then timed step by step in round-robin (the fastest of `--rounds` steps each, after a
warm-up step: on a shared machine one step of the same variant took 0.5 to 5 s, and the fastest is the one the
other processes disturbed least); the peak is PeakMemory's exact peak of
live tensor bytes over one step, above what was live before it. CPU time is only a relative cost here: on a GPU
the recompute costs the same FLOPs, but the host embedding lookup adds a host→device copy the CPU does not have.
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

from devkit.harness.long_context import LongPoint, _loss_head, recipe_for, write_model

CONFIG = {
    "model_type": "llama", "vocab_size": 16000, "hidden_size": 256, "intermediate_size": 1024,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
}  # fmt: skip
VARIANTS = [
    ("baseline: checkpointing + chunked loss (64-token chunks)", {}),
    ("+ tiled MLP", {"tiled_mlp": True}),
    ("+ tiled norms", {"tiled_norms": True}),
    ("+ LoRA recompute", {"recompute_lora": True}),
    ("+ host embeddings", {"host_embeddings": True}),
    ("loss chunk 16 tokens", {"loss_chunk_tokens": 16}),
    ("loss chunk 1,024 tokens (the automatic 64 MiB here)", {"loss_chunk_tokens": 1024}),
    ("all four: tiled MLP + norms, LoRA recompute, host embeddings",
     {"tiled_mlp": True, "tiled_norms": True, "recompute_lora": True, "host_embeddings": True}),
]  # fmt: skip


def build(model_dir: Path, point: LongPoint, dtype: str):
    """The model as `train` builds it, its optimizer, the batch, and one training step as a closure."""
    import torch

    from lowmem_ft.train.model import build_model

    recipe = recipe_for(model_dir, point)
    recipe.model.compute_dtype = dtype
    torch.manual_seed(0)
    model = build_model(recipe)
    _loss_head(model, point)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, CONFIG["vocab_size"], (1, point.seq), generator=torch.Generator().manual_seed(1))

    def step():
        out = model(input_ids=ids, labels=ids, fused_lm_head=True)
        (-out.log_probs.sum() / out.label_mask.sum()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def main(argv=None) -> int:
    from lowmem_ft.train.measure.peak import PeakMemory

    ap = argparse.ArgumentParser(prog="python -m devkit.bench.context", description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    times: dict[str, list[float]] = {label: [] for label, _ in VARIANTS}
    peaks: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model(CONFIG, Path(tmp) / "m")
        steps = {}
        for label, knobs in VARIANTS:
            knobs = {"loss_chunk_tokens": 64, **knobs}
            steps[label] = build(model_dir, LongPoint("llama", "lora", True, args.seq, **knobs), args.dtype)
            steps[label]()  # warm-up
            with PeakMemory() as pm:
                start = pm.live_bytes
                steps[label]()
            peaks[label] = pm.peak_bytes - start
        # round-robin, so load from other processes on a shared machine falls on every variant alike
        for _ in range(args.rounds):
            for label, step in steps.items():
                started = time.perf_counter()
                step()
                times[label].append(time.perf_counter() - started)
    base = VARIANTS[0][0]
    rows = []
    for label, _ in VARIANTS:
        seconds = min(times[label])
        rows.append(
            f"| {label} | {seconds:.2f} | {seconds / min(times[base]) - 1:+.0%} | "
            f"{peaks[label] / 1e6:.1f} | {peaks[label] / peaks[base] - 1:+.0%} |"
        )
    table = "\n".join(
        [
            f"`python -m devkit.bench.context --seq {args.seq} --rounds {args.rounds} --dtype {args.dtype}`: the "
            "long-context savers one at a time on a Llama-shaped LoRA model with checkpointing (see the module's "
            "docstring); CPU times on a shared machine.",
            "",
            f"| variant ({args.seq} tokens, {args.dtype}, fastest of {args.rounds} round-robin steps) | CPU s/step "
            "| vs baseline | step peak above weights MB | vs baseline |",
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
