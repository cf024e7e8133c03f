"""What fits for GRPO on a 7–8B model at 8 / 24 / 40 GB: completions × completion length, with which b and
steps_per_generation — predicted by the memory model, not measured on a GPU.

    python -m devkit.bench.grpo_fits [--out benchmarks/grpo_fits.md]

Pure arithmetic (the planner's device form, `memory.grpo_plan.grpo_estimate`; no GPU): Llama-3.1-8B from the catalog, LoRA r 16 on every linear
(16-bit weights) or QLoRA (NF4, double quant; the adapter in fp32, as lowmem-ft trains it), paged 8-bit AdamW, gradient
checkpointing, TRL's fused head, beta 0 (TRL's default: no reference pass), prompts of 256 tokens, gradient
accumulation = steps_per_generation (aligned rounds: no old-policy pass). A setting fits when its largest phase, with
the CUDA overheads, stays under VRAM − the tier's safety margin (0.75 / 1.5 / 2 GB, the tier recipes'). Each cell is
the largest b (completions per micro-step) that fits, with the fewest steps_per_generation that make a round hold
one prompt's G completions (b × spg = G, or b when b ≥ G), and the phase that peaks: `b 4 × spg 2 (gen 7.1)`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lowmem_ft.memory.arch import load_architecture
from lowmem_ft.memory.estimate import Setup
from lowmem_ft.memory.grpo import GrpoShape, peak_phase
from lowmem_ft.memory.grpo_plan import device_gb, grpo_estimate

MODEL = "meta-llama/Llama-3.1-8B"
MARGIN = {8: 0.75, 24: 1.5, 40: 2.0}
PROMPT = 256
GENERATIONS = (4, 8, 16)
LENGTHS = (256, 512, 1024, 2048, 4096)
MICRO_BATCHES = (16, 8, 4, 2, 1)
SHORT = {"generation": "gen", "scoring": "score", "forward": "fwd", "backward": "bwd", "optimizer step": "opt"}


def best(arch, quant: str, vram: int, g: int, c: int) -> str:
    """The cell: the largest b that fits with one prompt per round, or — when even b 1 does not."""
    for b in MICRO_BATCHES:
        spg = max(1, g // b) if b <= g else 1
        if (b * spg) % g:
            continue
        s = Setup(quantization=quant, lora_r=16, micro_batch_size=b, gradient_accumulation=spg, device="cuda")
        est = grpo_estimate(arch, s, GrpoShape(PROMPT, c, num_generations=g, steps_per_generation=spg))
        static = sum(x.bytes for x in est.components if x.phase == "static")
        peaks = {name: device_gb(est, b_, static) for name, b_ in est.phases.items()}
        top = peak_phase(peaks)
        if peaks[top] <= vram - MARGIN[vram]:
            return f"b {b} × spg {spg} ({SHORT[top]} {peaks[top]:.1f})"
    return "—"


def table(arch, quant: str) -> list[str]:
    name = "QLoRA (NF4)" if quant == "nf4" else "LoRA (bf16 weights)"
    out = [f"### {name}", "", "| G × C | 8 GB | 24 GB | 40 GB |", "| --- | --- | --- | --- |"]
    for g in GENERATIONS:
        for c in LENGTHS:
            out.append(f"| {g} × {c:,} | " + " | ".join(best(arch, quant, v, g, c) for v in MARGIN) + " |")
    return [*out, ""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devkit.bench.grpo_fits", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    arch = load_architecture(MODEL)
    lines = [
        f"Predicted (memory model, not measured): {MODEL}, prompts {PROMPT} tokens, G completions of C tokens. "
        "Cell: the largest b that fits, its steps_per_generation, (the peaking phase, its predicted GB).",
        "",
        *table(arch, "nf4"),
        *table(arch, "none"),
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        intro = (__doc__ or "").split("\n\n", 2)[2].strip()
        args.out.write_text(
            f"# GRPO: what fits at 8 / 24 / 40 GB (predicted)\n\nCommand: `python -m devkit.bench.grpo_fits "
            f"--out {args.out}`\n\n{intro}\n\n{text}\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
