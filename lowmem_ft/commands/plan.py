"""`lowmem-ft plan`: where every GB goes, and the fastest recipe that fits a VRAM target (no torch on this path)."""

from __future__ import annotations

import argparse
import json
from typing import get_args

from lowmem_ft.memory.planner import Requested


def add_parser(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="predict peak VRAM per component and pick the fastest recipe that fits",
        description="Plan a fine-tune of MODEL for --vram GB: each memory component, the total, budget, margin and "
        "headroom, and why each knob was chosen. --output writes the recipe `train --recipe` accepts.",
    )
    p.add_argument("--model", required=True, help="hub id (offline catalog or Hub config.json) or local directory")
    p.add_argument("--vram", type=float, required=True, metavar="GB", help="GPU memory to fit in, in GB")
    p.add_argument(
        "--seq-len", type=int, metavar="N", help="maximum sequence length in tokens (fixes memory.max_seq_len)"
    )
    p.add_argument(
        "--data",
        metavar="FILE.jsonl",
        help="size max_seq_len from this data's token lengths (p99), as train --vram does; needs the tokenizer",
    )
    p.add_argument("--recipe", metavar="NAME_OR_FILE", help="check this recipe instead of planning from the tier")
    p.add_argument("--gpus", type=int, default=1, metavar="N", help="GPUs to train on; the plan is per device")
    p.add_argument(
        "--strategy",
        default="auto",
        choices=get_args(Requested),
        help="with --gpus N: auto picks DDP when the model fits per device, else FSDP, then FSDP + CPU offload",
    )
    p.add_argument("--offload", action="store_true", default=None, help="plan with optimizer states in host RAM")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="fix one recipe key; the planner does not change it (repeatable)",
    )
    p.add_argument("--output", metavar="FILE.yaml", help="write the resolved recipe here")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--trust-remote-code", action="store_true", help="accepted for symmetry with train (not needed)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from lowmem_ft.planning import choose_recipe, start_recipe
    from lowmem_ft.recipe.load import dump, merge, parse_overrides

    overrides = merge(parse_overrides(args.overrides), {"model": {"name_or_path": args.model}})
    origins = {"model.name_or_path": "--model", "data.path": "--data"}
    profile = None
    if args.data:
        from lowmem_ft.data import check_source, length_profile

        overrides = merge(overrides, {"data": {"path": args.data}})
        start = start_recipe(args.vram, args.recipe, overrides, origins)
        check_source(start)
        profile = length_profile(start)
    recipe, choice = choose_recipe(
        vram_gb=args.vram,
        recipe=args.recipe,
        overrides=overrides,
        origins=origins,
        seq_len=args.seq_len,
        profile=profile,
        gpus=args.gpus,
        strategy=args.strategy,
        offload=args.offload,
    )
    if args.output:
        Path(args.output).write_text(
            dump(recipe, header=f"planned by lowmem-ft plan for --vram {args.vram:g}"), encoding="utf-8"
        )
    if args.json:
        print(json.dumps(choice.plan_record(recipe), indent=2))
    else:
        print_plan(choice.plan, recipe)
        if args.output:
            print(f"recipe written to {args.output} (lowmem-ft train --recipe {args.output} --data ...)")
    return 0


def print_plan(result, r) -> None:
    """The plan as a table of components, then one line per knob saying why."""
    from rich.console import Console
    from rich.table import Table

    est = result.estimate
    where = f"{result.vram_gb:g} GB" if result.gpus == 1 else f"{result.gpus} × {result.vram_gb:g} GB, per device"
    how = "" if result.gpus == 1 else f" ({result.strategy}{' + offload' if result.offload else ''})"
    title = (
        f"{r.model.name_or_path} on {where}{how}: {r.adapter.kind}"
        f"{'' if r.model.quantization == 'none' else ' + ' + r.model.quantization}, "
        f"batch {r.memory.micro_batch_size}×{r.memory.gradient_accumulation}, seq {r.memory.max_seq_len}"
    )
    table = Table(title=title)
    table.add_column("component")
    table.add_column("GB", justify="right")
    table.add_column("when")
    for c in est.components:
        if c.bytes <= 0 or c.phase == "host":
            continue
        table.add_row(c.name, f"{c.gb:.2f}", c.phase)
    table.add_section()
    table.add_row("predicted peak", f"{est.peak_gb:.2f}", f"at the {est.peak_phase}")
    table.add_row("budget (VRAM − margin)", f"{result.budget_gb:.2f}", f"margin {result.margin_gb:g} GB")
    table.add_row("headroom", f"{result.headroom_gb:.2f}", "fits" if result.fits else "DOES NOT FIT")
    host = [c for c in est.components if c.phase == "host" and c.bytes > 0]
    if host:
        table.add_section()
        for c in host:
            table.add_row(c.name, f"{c.gb:.2f}", "host RAM, not on the device")
    console = Console()
    console.print(table)
    for knob, why in result.reasons.items():
        console.print(f"  {knob}: {why}")
    for note in est.notes:
        console.print(f"  note: {note}")
