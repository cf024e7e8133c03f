"""`lowmem-ft plan`: where every GB goes, and the fastest recipe that fits a VRAM target (no torch on this path)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import get_args

from lowmem_ft.commands import flags
from lowmem_ft.errors import UserError
from lowmem_ft.memory.planner import Requested
from lowmem_ft.recipe.schema import MIN_SEQ_LEN


def add_parser(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="predict peak VRAM per component and pick the fastest recipe that fits",
        description="Plan a fine-tune of MODEL for --vram GB: each memory component, the total, budget, margin and "
        "headroom, and why each knob was chosen. --output writes the recipe `train --recipe` accepts.",
    )
    flags.add_key_flags(p, "--model", required=True, note="; a Hub id is read from the offline catalog or config.json")
    p.add_argument("--vram", type=flags.vram_gb, required=True, metavar="GB", help="GPU memory to fit in, in GB")
    flags.add_key_flags(p, "--host-ram")
    flags.add_key_flags(p, "--seq-len", checked=True, note=f"; at least {MIN_SEQ_LEN}, at most the model's positions")
    flags.add_key_flags(
        p,
        "--data",
        note="; max_seq_len is sized from its token lengths (p99), as train --vram does (needs the tokenizer)",
    )
    p.add_argument("--recipe", metavar="NAME_OR_FILE", help="check this recipe instead of planning from the tier")
    p.add_argument("--gpus", type=flags.count, default=1, metavar="N", help="GPUs per node; the plan is per device")
    p.add_argument("--nodes", type=flags.count, default=1, metavar="N",
                   help="machines, each with --gpus GPUs and its own host RAM (as train --nodes)")  # fmt: skip
    p.add_argument(
        "--strategy",
        default="auto",
        choices=get_args(Requested),
        help="with --gpus N: auto picks DDP when the model fits per device, else FSDP, then FSDP + CPU offload",
    )
    p.add_argument("--offload", action="store_true", default=None, help="plan with optimizer states in host RAM")
    flags.add_set(p, "fix one recipe key; the planner does not change it (repeatable)")
    p.add_argument("--output", metavar="FILE.yaml", help="write the resolved recipe here")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument(
        "--verify",
        action="store_true",
        help="trace the chosen plan's training step at full size on the CPU without weights (the installed "
        "library versions) and print traced against predicted per phase; over the budget, plan again below it",
    )
    flags.add_key_flags(
        p, "--trust-remote-code", note="; with --data, the tokenizer's (planning reads config.json and runs no code)"
    )
    flags.add_key_flags(p, "--method")
    p.set_defaults(func=run)


def check_output_file(path: Path) -> None:
    """--output before planning: a file path (not a directory) in a directory that exists."""
    if path.is_dir():
        raise UserError(f"--output {path} is a directory; give a file name, e.g. {path / 'recipe.yaml'}")
    if not path.parent.is_dir():
        raise UserError(f"--output {path}: directory {path.parent} does not exist")


def run(args: argparse.Namespace) -> int:
    from lowmem_ft.checks import check_model
    from lowmem_ft.method_planning import planning
    from lowmem_ft.preparing import TrainRequest, check_plan_inputs, planned
    from lowmem_ft.recipe.load import dump, merge, parse_overrides

    output = Path(args.output) if args.output else None
    if output is not None:
        check_output_file(output)
    check_model(args.model, "--model", weights=False)  # planning reads config.json only
    keys, origins = flags.key_overrides(args)
    request = TrainRequest(
        overrides=merge(parse_overrides(args.overrides), keys), origins=origins, vram_gb=args.vram,
        recipe=args.recipe, gpus=args.gpus, nodes=args.nodes, strategy=args.strategy, offload=bool(args.offload),
        verify=args.verify,
    )  # fmt: skip
    say = (lambda line: print(line, file=sys.stderr)) if args.json else print  # stdout stays JSON
    show = None if args.json else lambda recipe, choice: print_plan(choice.plan, recipe)
    try:  # the same path as train's: same checks, same refusals, same planner arguments (`preparing.planned`)
        recipe, choice = planned(request, check_plan_inputs, say, show)
    except UserError as exc:
        if args.json:  # nothing fits (the device or the host RAM): the JSON says so too, the line goes to stderr
            print(json.dumps({"model": args.model, "fits": False, "unfit_reason": str(exc)}, indent=2))
        raise
    fits = choice.plan.fits
    if output is not None and fits:
        try:
            output.write_text(dump(recipe, header=f"planned by lowmem-ft plan for --vram {args.vram:g}"), "utf-8")
        except OSError as exc:
            raise UserError(f"--output {output}: cannot write it ({exc.strerror or exc})") from None
    from lowmem_ft.vision.setup import vision_lines, vision_of

    vision = vision_of(recipe)  # image chats: the resolution cap chosen and the image tokens per sample
    described = vision.describe(recipe) if vision is not None else None
    if described and choice.reasons.get("vision.max_pixels"):
        described["why"] = choice.reasons["vision.max_pixels"]
    if args.json:
        print(json.dumps(choice.plan_record(recipe) | ({"vision": described} if described else {}), indent=2))
    else:
        if not args.verify:  # --verify showed each plan it traced, the chosen one last
            print_plan(choice.plan, recipe)
        if described:
            print("\n".join(vision_lines(described)))
        for line in planning(recipe.training.method).lines(choice.plan, recipe):  # a method's own lines
            print(f"  {line}")
        if output is not None and fits:
            print(f"recipe written to {output} (lowmem-ft train --recipe {output} --data ...)")
    if not fits:  # only a recipe as given (--recipe) can come back over a budget: the planner's plans fit
        p = choice.plan
        raise UserError(
            f"recipe {args.recipe} does not fit: {p.unfit_reason()} (the plan on stdout shows where it goes)"
            f"{'; nothing written to --output' if output is not None else ''}; drop --recipe to let the planner "
            "choose"
        )
    version_note()  # last, on stderr: an error stays one line, and the JSON on stdout stays JSON
    return 0


def version_note() -> None:
    """One line when the installed libraries are not the ones the memory model was checked against."""
    from lowmem_ft.versions import differences

    found = differences()
    if found:
        names = ", ".join(f"{name} {now or 'missing'} (checked {want})" for name, (want, now) in found.items())
        print(f"note: the memory model was checked against other library versions: {names}; --verify measures the "
              "installed ones", file=sys.stderr)  # fmt: skip


def print_plan(result, r) -> None:
    """The plan as a table of components, then one line per knob saying why."""
    from rich.table import Table

    from lowmem_ft.console import rich_console

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
    if (startup := est.startup_peak_gb) is not None:  # adapter.init pissa / olora: a moment before step 1
        over = " — OVER THE BUDGET" if startup > result.budget_gb else ""
        table.add_row("start-up peak", f"{startup:.2f}", f"once, at adapter.init; the step's peak is unchanged{over}")
    margin = f"margin {result.margin_gb:g} GB" + (
        f" + {c:.2f} GB calibrated" if (c := result.target.calibration_gb) else ""
    )
    table.add_row("budget (VRAM − margin)", f"{result.budget_gb:.2f}", margin)
    table.add_row("headroom", f"{result.headroom_gb:.2f}", "fits" if result.headroom_gb >= 0 else "DOES NOT FIT")
    host = [c for c in est.components if c.phase == "host" and c.bytes > 0]
    if host:
        table.add_section()
        for c in host:
            table.add_row(c.name, f"{c.gb:.2f}", "host RAM, not on the device")
        t = result.target
        if t.host_ram_gb is not None:
            table.add_row(
                "host budget (RAM − margin)",
                f"{t.host_budget_gb:.2f}",
                ("fits" if result.host_fits else "DOES NOT FIT") + f": {result.host_need_gb:.2f} GB on the host",
            )
    console = rich_console()
    console.print(table)
    for knob, why in result.reasons.items():
        console.print(f"  {knob}: {why}")
    for note in est.notes:
        console.print(f"  note: {note}")
