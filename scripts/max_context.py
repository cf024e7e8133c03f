"""The planner's longest trainable sequence for QLoRA, batch 1, at 8 / 24 / 40 GB, with and without the savers.

    python scripts/max_context.py [--out benchmarks/max_context.md]

Pure arithmetic over the memory model (no GPU): for each model and VRAM target, the longest max_seq_len for which
`lowmem_ft.memory.planner.plan` finds a setup (NF4 LoRA, batch 1, gradient checkpointing allowed) that fits
under VRAM − the tier's margin; "savers" additionally allows activation offloading and the chunked loss.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lowmem_ft.planning import longest_context  # noqa: E402

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
        for vram in (8, 24, 40):
            fixed = {"model": {"quantization": "nf4"}, "adapter": {"kind": "lora"}, "memory": {"micro_batch_size": 1}}
            without = longest_context(name, vram, fixed, savers=False)
            with_savers = longest_context(name, vram, fixed)
            lines.append(f"| {name} | {vram} GB | {without:,} | {with_savers:,} | {PUBLISHED.get((name, vram), '—')} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
