"""The planner's longest trainable sequence for QLoRA r32 on all linear layers, batch 1, at 8 / 24 / 40 GB: without
savers, with the savers it had before the long-context ones, and with everything it may turn on by itself.

    python -m devkit.bench.max_context [--out benchmarks/max_context.md]

Pure arithmetic over the memory model (no GPU): for each model and VRAM target, the longest max_seq_len for which
`lowmem_ft.memory.planner.plan` finds a setup (NF4 LoRA rank 32 on all linear layers, batch 1; checkpointing and
the rest as the column allows) that fits under VRAM − the tier's margin. Columns (`lowmem_ft.longest_context.SAVER_SETS`):
"none" fixes activation offloading, the chunked loss and the long-context savers off; "previous" lets the planner
use offloading and the chunked loss at its automatic 64 MiB chunks (the planner before issue #13); "all" lets it
choose everything (host embeddings, tiled norms, tiled MLP, LoRA recompute, the MLP tile, the loss chunk sized from
the budget). The search is not capped at the model's positions (`max_position_embeddings`): the table says what
memory allows; `train` and `plan` cap a run's length there. Then, for "all", what the plan at that length turned on
and the host RAM it needs. These are predictions of the CPU-checked model (benchmarks/long_context_cpu.md), not GPU
measurements; the CUDA-only terms are the assumptions listed in lowmem_ft/memory/estimate.py.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from lowmem_ft.longest_context import context_request, longest_context
from lowmem_ft.memory.planner import plan

MODELS = ["meta-llama/Llama-3.1-8B", "Qwen/Qwen2.5-7B"]
VRAMS = (8, 24, 40)
FIXED = {
    "model": {"quantization": "nf4"},
    "adapter": {"kind": "lora", "r": 32, "target_modules": ["all-linear"]},
    "memory": {"micro_batch_size": 1},
}
LIMIT = 1 << 20  # beyond any length these fit: the search is bounded by memory, not by the model's positions
# Published for Llama-3.1-8B, QLoRA 4-bit rank 32 on all linear layers, batch 1 (https://unsloth.ai/blog/llama3-3,
# the figures docs/long-context.md quotes): (Unsloth, HF + FlashAttention-2); "—" where no figure is quoted.
PUBLISHED = {
    ("meta-llama/Llama-3.1-8B", 8): ("2,900", "out of memory"),
    ("meta-llama/Llama-3.1-8B", 24): ("78,475", "5,789"),
    ("meta-llama/Llama-3.1-8B", 40): ("—", "12,264"),
}
TARGETS = {8: 3000, 24: 100_000, 40: 200_000}  # issue #13's, for Llama-3.1-8B
HEADER = """Longest trainable sequence the planner predicts: NF4 QLoRA, LoRA rank 32 on all linear layers, batch 1,
under VRAM − the tier's margin (0.75 / 1.5 / 2.0 GB), `python -m devkit.bench.max_context`. Predictions of the memory model
checked on the CPU (benchmarks/long_context_cpu.md), not GPU measurements: its CUDA terms (context, cuBLAS
workspaces, allocator, Triton loss) are assumptions until the GPU check runs. Lengths are not capped at the models'
131,072 positions (what memory allows; `plan` and `train` cap a run there). Host RAM is not a limit here: the last
column says what the plan keeps in host memory (pinned offloaded layer inputs, host embeddings, paged states).
Published figures: https://unsloth.ai/blog/llama3-3 (Llama-3.1-8B, QLoRA rank 32 on all linear layers).

"""
SAVERS = ("embeddings_on_host", "tiled_norms", "tiled_mlp", "recompute_lora")


def chosen(model: str, vram: int, length: int) -> str:
    """What the planner's own plan at `length` turns on, its loss chunk and MLP tile, peak and host RAM."""
    arch, request = context_request(model, vram, FIXED)
    at = replace(request, start=replace(request.start, max_seq_len=length), fixed=request.fixed | {"max_seq_len"})
    p = plan(arch, at)
    s = p.setup
    on = [name for name in ("activation_offloading", *SAVERS) if getattr(s, name)]
    if s.loss_impl == "chunked":
        on.append(f"chunked loss ({s.loss_chunk_tokens:,}-token chunks)")
    if any(getattr(s, name) for name in ("tiled_norms", "tiled_mlp", "recompute_lora")):
        on.append(f"tiles of {s.mlp_tile_tokens or arch.hidden_size:,} tokens")
    return (
        f"| {model} | {vram} GB | {length:,} | {', '.join(on)} | {p.estimate.peak_gb:.2f} of {p.budget_gb:g} | "
        f"{p.host_gb:.1f} |"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devkit.bench.max_context", description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    lines = [
        "| model | VRAM | without savers | offloading + chunked loss (before) | the planner's own choice "
        "| published Unsloth | published HF + FA2 |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    longest = {}
    for name in MODELS:
        for vram in VRAMS:
            found = [
                longest_context(name, vram, FIXED, savers=s, limit=LIMIT, positions=False)
                for s in ("none", "previous", "all")
            ]
            longest[(name, vram)] = found[-1]
            unsloth, hf = PUBLISHED.get((name, vram), ("—", "—"))
            lines.append(f"| {name} | {vram} GB | " + " | ".join(f"{n:,}" for n in found) + f" | {unsloth} | {hf} |")
            print(lines[-1], flush=True)
    lines += [
        "",
        "At the longest length of the last column, the plan (`plan --vram N --seq-len L` with the same fixed knobs):",
        "",
        "| model | VRAM | tokens | turned on | predicted peak of budget, GB | host RAM, GB |",
        "| --- | --- | ---: | --- | ---: | ---: |",
    ]
    lines += [chosen(name, vram, longest[(name, vram)]) for name in MODELS for vram in VRAMS]
    lines += ["", "At issue #13's targets for meta-llama/Llama-3.1-8B:", ""]
    lines += [
        f"- {vram} GB, {tokens:,} tokens: "
        + ("fits" if longest[(MODELS[0], vram)] >= tokens else "DOES NOT FIT")
        + f" (longest {longest[(MODELS[0], vram)]:,})"
        for vram, tokens in TARGETS.items()
    ]
    text = "\n".join(lines)
    print("\n".join(lines[len(MODELS) * len(VRAMS) + 2 :]))
    if args.out:
        Path(args.out).write_text(HEADER + text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
