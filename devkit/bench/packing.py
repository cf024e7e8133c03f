"""Training throughput with and without packing on a skewed-length dataset, same run, same data.

    python -m devkit.bench.packing [--samples 256] [--max-len 512] [--batch 4] [--out benchmarks/packing.md]

Trains one epoch of the same tokenized data three ways through lowmem-ft's own train path (CPU, a small random
Qwen2 built in code, fp32 LoRA): unpacked with random batches (TRL's default), unpacked with length-grouped batches
(lowmem-ft's default), and packed (TRL bfd packing, padding-free, position ids reset per sample). Every run sees
every real token once, so tokens/s = real tokens / train_runtime and the ratio is a time ratio. Padding share =
padded positions / all positions the model computed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")

MODES = {
    "unpacked, random batches": ["data.packing=false"],
    "unpacked, length-grouped": ["data.packing=false"],
    "packed (bfd, padding-free)": ["data.packing=true"],
}


class CountPositions:
    """Counts the positions the model computes (input_ids numel) per forward, to get the padding share."""

    def __init__(self):
        self.positions = 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        def hook(module, a, kw):
            ids = kw.get("input_ids")
            if ids is not None and module.training:
                self.positions += ids.numel()

        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        base.register_forward_pre_hook(hook, with_kwargs=True)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m devkit.bench.packing", description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/packing.md")
    args = parser.parse_args()

    import datasets
    import torch
    from transformers import TrainerCallback

    from devkit.bench.skewed_data import write_dataset
    from devkit.tiny import build_tiny_model
    from lowmem_ft.recipe.load import resolve
    from lowmem_ft.train import args as args_mod
    from lowmem_ft.train import run as run_mod

    datasets.disable_progress_bars()
    torch.set_num_threads(args.threads)  # a fixed thread count: fewer stalls on a shared machine
    work = Path(tempfile.mkdtemp(prefix="bench-pack-"))
    os.environ["LOWMEM_FT_CACHE"] = str(work / "cache")
    model_dir = build_tiny_model(
        work / "model", hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8
    )
    data = write_dataset(work / "skewed.jsonl", "text", args.samples)
    base_sets = [
        f"model.name_or_path={model_dir}",
        f"data.path={data}",
        "model.quantization=none",
        "model.compute_dtype=float32",
        "optimizer.name=adamw_torch",
        f"memory.micro_batch_size={args.batch}",
        "memory.gradient_accumulation=1",
        f"memory.max_seq_len={args.max_len}",
        "data.truncate=drop",
        "training.epochs=1",
        "training.logging_steps=1000",
        "training.save_steps=100000",
        "logging.wandb_mode=disabled",
    ]
    rows = []
    profile = None
    for i, (mode, sets) in enumerate(MODES.items()):
        recipe = resolve("8gb", [*base_sets, *sets])
        real_sft_config = args_mod.sft_config
        if mode.endswith("random batches"):  # TRL's default sampler, for comparison

            def random_sampler(*a, real=real_sft_config, **kw):
                cfg = real(*a, **kw)
                cfg.train_sampling_strategy = "random"
                return cfg

            args_mod.sft_config = random_sampler
        run_dir = work / f"run{i}"
        run_dir.mkdir()
        counter = type("Counter", (CountPositions, TrainerCallback), {})()
        try:
            result = run_mod.train(recipe, run_dir, callbacks=[counter])
        finally:
            args_mod.sft_config = real_sft_config
        report = json.loads((run_dir / "data_report.json").read_text())
        profile = report["profile"]
        tokens = report["budget"]["tokens_out"]
        seconds = result.metrics["train_runtime"]
        padding = 1 - tokens / counter.positions
        rows.append(
            (mode, result.metrics["global_step"], tokens, counter.positions, padding, seconds, tokens / seconds)
        )

    base_tps = rows[0][-1]
    lines = [
        "| batching | steps | real tokens | computed positions | padding share | train s | tokens/s | vs random |",
        "|" + "---|" * 8,
    ]
    for mode, steps, tokens, positions, padding, seconds, tps in rows:
        lines.append(
            f"| {mode} | {steps} | {tokens} | {positions} | {100 * padding:.1f}% | {seconds:.1f} | {tps:,.0f} | "
            f"{tps / base_tps:.2f}× |"
        )
    table = "\n".join(lines)
    print(table)
    note = (
        f"# Packing: tokens/s with and without packing\n\n`python -m devkit.bench.packing --samples {args.samples} "
        f"--max-len {args.max_len} --batch {args.batch} --threads {args.threads}`: one epoch each, same run, CPU (shared 2-core machine with "
        "other jobs, so absolute numbers are noisy), Qwen2 with hidden 256, 4 layers, LoRA r=8 (8gb recipe), fp32, sdpa. "
        f"Data: {profile['count']} skewed text samples, tokens p50 {profile['p50']} / p90 {profile['p90']} / "
        f"p99 {profile['p99']} / max {profile['max']}.\n\n"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(note + table + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
