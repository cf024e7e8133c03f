"""The planner's longest trainable sequence for QLoRA, batch 1, at 8 / 24 / 40 GB, with and without the savers.

    python scripts/max_context.py [--out benchmarks/max_context.md]

Pure arithmetic over the memory model (no GPU): for each model and VRAM target, the longest max_seq_len for which
`lowmem_ft.memory.planner.plan` finds a setup (NF4 LoRA, batch 1, gradient checkpointing allowed) that fits
under VRAM − the tier's margin; "savers" additionally allows activation offloading and the chunked loss.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lowmem_ft.memory.arch import load_architecture  # noqa: E402
from lowmem_ft.memory.planner import Request, max_seq_len  # noqa: E402
from lowmem_ft.memory.target import Target  # noqa: E402
from lowmem_ft.planning import fixed_knobs, setup_from_recipe, tier_for_vram  # noqa: E402
from lowmem_ft.recipe.load import resolve  # noqa: E402

MODELS = ["Qwen/Qwen2.5-7B", "meta-llama/Llama-3.1-8B"]
PUBLISHED = {("meta-llama/Llama-3.1-8B", 24): "5,789", ("meta-llama/Llama-3.1-8B", 40): "12,264"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    lines = [
        "| model | VRAM | without savers | with savers | published HF + FA2 (QLoRA, batch 1) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in MODELS:
        arch = load_architecture(name)
        for vram in (8, 24, 40):
            fixed = {
                "model": {"name_or_path": name, "quantization": "nf4"},
                "adapter": {"kind": "lora"},
                "memory": {"micro_batch_size": 1},
            }
            start = resolve(tier_for_vram(vram), fixed)
            request = Request(
                setup_from_recipe(start),
                Target(vram, start.memory.safety_margin_gb),
                start.memory.gradient_accumulation,
                fixed=fixed_knobs(fixed),
            )
            without = max_seq_len(arch, replace(request, fixed=request.fixed | {"activation_offloading", "loss_impl"}))
            with_savers = max_seq_len(arch, request)
            lines.append(f"| {name} | {vram} GB | {without:,} | {with_savers:,} | {PUBLISHED.get((name, vram), '—')} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
