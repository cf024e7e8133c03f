"""The real-size truth table: every catalog model at each tier's plan and a long-context plan per tier, the memory
model's CPU form against the traced step (`lowmem_ft.train.trace`: the real step at full size, no weights).

    python -m devkit.bench.real_size --out benchmarks/real_size.md                    # every row (hours on 2 cores)
    python -m devkit.bench.real_size --models meta-llama/Llama-3.1-8B --tiers 24 --out /tmp/t.md

Each row: the plan `lowmem-ft plan --model M --vram T` chooses (`--seq-len` for the long-context row), traced
(peak live tensor bytes over the yardstick's two optimizer steps and an evaluation forward) against predicted
(`phase_peak_bytes`, the CPU form: no device overheads). Rows already in `--out` are kept, so a run that stops
can be continued; a model the planner cannot fit in a tier, or the tracer cannot build, is a row saying why.
Cheap enough to re-run when a library version changes: no weights are read or allocated.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

from lowmem_ft.errors import UserError
from lowmem_ft.memory.arch import catalog
from lowmem_ft.memory.estimate import GB

TIERS = (8.0, 24.0, 40.0)
LONG_SEQ = 16384  # the long-context row's --seq-len (capped at the model's positions)
PREAMBLE = (
    "# Real size: the memory model against the traced step\n\n"
    "Written by `python -m devkit.bench.real_size`. Each row: the plan `lowmem-ft plan --model M --vram T` chooses "
    "(rows marked long: with `--seq-len 16384`), traced by `lowmem_ft.train.trace` (the real step at full size on the "
    "CPU, no weights: two optimizer steps with an accumulation window and an evaluation forward) against the memory "
    "model's CPU form of the same phases (live tensor bytes, no device overheads; on the CPU nothing is offloaded). "
    "`gap` = (predicted − traced) / traced of the peaks; `worst phase` the phase with the largest gap. "
    "`trace s` is wall time on a shared 2-core machine (load ~9).\n\n"
)
HEADER = PREAMBLE + (
    "| model | vram | plan | traced GB | predicted GB | gap | worst phase | trace s |\n"
    "|---|---|---|---|---|---|---|---|\n"
)


def plan_row(model: str, vram: float, seq_len: int | None) -> str:
    from lowmem_ft.choosing import choose_recipe
    from lowmem_ft.train.verify import verified

    try:
        recipe, choice = choose_recipe(
            vram_gb=vram, recipe=None, overrides={"model": {"name_or_path": model}}, seq_len=seq_len
        )
    except UserError as exc:
        return f"| {model} | {vram:g} | no plan: {str(exc)[:90]} | | | | | |"
    m = recipe.memory
    savers = [k for k in ("chunked_loss", "tiled_mlp", "tiled_norms", "recompute_lora", "embeddings_on_host")
              if getattr(m, k)]  # fmt: skip
    quant = "" if recipe.model.quantization == "none" else f"+{recipe.model.quantization}"
    what = (
        f"{recipe.adapter.kind}{quant} {recipe.optimizer.name}, {m.micro_batch_size}×{m.max_seq_len}"
        f"{', ckpt' if m.gradient_checkpointing else ''}{', ' + ', '.join(savers) if savers else ''}"
    )
    started = time.perf_counter()
    try:
        _, _, v = verified(recipe, choice, lambda margin: (recipe, choice), lambda line: None, tries=1)
    except UserError as exc:
        return f"| {model} | {vram:g} | {what} | cannot trace: {str(exc)[:80]} | | | | |"
    gaps = {p: (v.predicted[p] - t) / t for p, t in v.traced.items()}
    worst = max(gaps, key=lambda p: abs(gaps[p]))
    return (
        f"| {model} | {vram:g} | {what} | {v.traced_peak / GB:.3f} | {v.predicted_peak / GB:.3f} | {v.error:+.2%} "
        f"| {worst} {gaps[worst]:+.2%} | {time.perf_counter() - started:.0f} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", help="catalog ids (default: every catalog model)")
    parser.add_argument("--tiers", nargs="*", type=float, default=list(TIERS))
    parser.add_argument("--long-seq", type=int, default=LONG_SEQ, help="the long-context rows' --seq-len (0: none)")
    parser.add_argument("--out", default="benchmarks/real_size.md")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    out = Path(args.out)
    models = args.models or list(catalog())
    lines = [line for line in (out.read_text().splitlines() if out.is_file() else []) if line.startswith("| ")]
    lines = [line for line in lines if not line.startswith(("| model", "|---"))]
    for model in models:
        for vram in args.tiers:
            for seq in (None, args.long_seq or None) if args.long_seq else (None,):
                key = f"| {model} | {vram:g} | " + ("long " if seq else "")
                if any(line.startswith(key) for line in lines):
                    continue
                row = plan_row(model, vram, seq)
                if seq:
                    row = row.replace(f"| {model} | {vram:g} | ", key, 1)
                print(row, flush=True)
                lines.append(row)
                out.write_text(HEADER + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
