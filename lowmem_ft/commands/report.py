"""`lowmem-ft report RUN_DIR`: redraw a run's memory plot (memory.png) and print its memory summary."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    p = sub.add_parser(
        "report",
        help="redraw a run's memory curve and print measured vs predicted peak",
        description="Read RUN_DIR/memory.jsonl, draw RUN_DIR/memory.png (memory over steps with the budget, "
        "safety margin and predicted peak) and print the measured peak against the prediction and the budget.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory, e.g. runs/NAME")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lowmem_ft.errors import UserError
    from lowmem_ft.report import write_report
    from lowmem_ft.rundir import RunDir

    run = RunDir(args.run_dir)
    if not run.memory_file().is_file():
        what = "does not exist" if not run.path.exists() else "has no memory.jsonl (not a lowmem-ft run directory?)"
        raise UserError(f"{run.path} {what}; pass runs/NAME of a run started by lowmem-ft train")
    try:
        png, summary = write_report(run.path, strict=True)
    except OSError as exc:  # a run directory handed over read-only, or a full disk
        raise UserError(
            f"{run.path}: cannot write {run.MEMORY_PLOT} there ({exc.strerror or exc}); copy the run directory "
            "somewhere writable and report that"
        ) from None
    print(summary)
    print(f"plot: {png}")
    return 0
