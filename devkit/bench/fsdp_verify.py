"""One FSDP2 rank of catalog plans at full size: the traced step against the per-rank memory model.

    python -m devkit.bench.fsdp_verify --out benchmarks/fsdp_verify.md

Each row is the plan `lowmem-ft plan --model M --vram V --gpus N --strategy fsdp` chooses (host RAM 256 GB, so the
host does not decide the plan). Rank 0 of that plan's step is traced in one process on a fake process group
(`lowmem_ft.train.trace.sharded`, what `plan --verify --gpus N` runs), and compared with
`memory.sharding.fsdp2_phase_bytes` (the CPU form: no device overheads). A plan with CPU offload (the planner's
last step) is traced without it, less what it keeps on the host, as `plan --verify` does. No weights are read.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from lowmem_ft.errors import UserError
from lowmem_ft.memory.estimate import GB

# (model, --vram, --gpus, recipe keys): the targets of issue 35's item 4, and a QLoRA plan without checkpointing
PLANS = (
    ("meta-llama/Llama-3.1-70B", 24.0, 4, {}),
    ("meta-llama/Llama-3.1-70B", 24.0, 2, {}),
    ("meta-llama/Llama-3.1-8B", 40.0, 4, {"adapter": {"kind": "full"}}),
    ("meta-llama/Llama-3.1-8B", 12.0, 4, {"model": {"quantization": "nf4"}}),
)
PHASES = ("static", "forward", "backward", "optimizer step")


def row(model: str, vram: float, gpus: int, keys: dict) -> str:
    from lowmem_ft.choosing import choose_recipe
    from lowmem_ft.memory.arch import load_architecture
    from lowmem_ft.train.trace.sharded import traced_rank

    overrides = {**keys, "model": {"name_or_path": model, **keys.get("model", {})}, "memory": {"host_ram_gb": 256}}
    recipe, choice = choose_recipe(vram_gb=vram, recipe=None, overrides=overrides, gpus=gpus, strategy="fsdp")
    m = recipe.memory
    quant = "" if recipe.model.quantization == "none" else f"+{recipe.model.quantization}"
    what = (
        f"{model}, {gpus} × {vram:g} GB: {recipe.adapter.kind}{quant} {recipe.optimizer.name}, "
        f"{m.micro_batch_size}×{m.max_seq_len}{', ckpt' if m.gradient_checkpointing else ''}"
    )
    started = time.perf_counter()
    try:
        rank, predicted, how, _ = traced_rank(recipe, load_architecture(model), choice.plan)
    except UserError as exc:
        return f"| {what} | {exc} | | | | | |"
    cells = [f"{rank.phases[p] / GB:.2f} / {predicted[p] / GB:.2f} ({(predicted[p] / rank.phases[p] - 1):+.1%})"
             for p in PHASES]  # fmt: skip
    peak = max(predicted[p] for p in PHASES) / max(rank.phases[p] for p in PHASES) - 1
    return f"| {what} | {' | '.join(cells)} | {peak:+.1%} | {how}, {time.perf_counter() - started:.0f} s |"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the table here (markdown)")
    args = ap.parse_args(argv)
    lines = [
        "# One FSDP2 rank at full size: traced against predicted",
        "",
        "Written by `python -m devkit.bench.fsdp_verify`. Cells: traced / predicted GB of live tensor bytes on "
        "rank 0 (CPU form, no device overheads), the prediction's error in brackets. Traced on shape-only tensors "
        "in one process (fake process group), sharded by accelerate's `fsdp2_prepare_model` with the GPU run's "
        "bf16 mixed precision.",
        "",
        f"| plan | {' | '.join(PHASES)} | peak | how |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for plan in PLANS:
        lines.append(row(*plan))
        print(lines[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
