"""`lowmem-ft train`: parse, choose the recipe, build, run, save — the logic lives in library modules."""

from __future__ import annotations

import argparse

from lowmem_ft.recipe.load import merge, parse_overrides


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="fine-tune a model on JSONL data within a VRAM target",
        description="Fine-tune MODEL on DATA. With --vram the recipe is chosen for that much GPU memory; "
        "--recipe uses a shipped recipe (8gb, 24gb, 40gb) or a YAML file; --set section.key=value overrides any key.",
    )
    p.add_argument("--model", help="hub id or local directory of the base model (model.name_or_path)")
    p.add_argument("--data", help="training data, JSONL (data.path)")
    p.add_argument(
        "--vram",
        type=float,
        metavar="GB",
        help="GPU memory to fit in, in GB (e.g. 8, 24, 40); on a bigger card the process is capped at GB",
    )
    p.add_argument("--recipe", metavar="NAME_OR_FILE", help="shipped recipe name or YAML file")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one recipe key; repeatable (e.g. --set training.max_steps=100)",
    )
    p.add_argument("--name", help="run name; the run goes to <training.output_dir>/<name> (default: model-timestamp)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    p.add_argument("--eval-data", help="evaluation data, JSONL (data.eval_path)")
    p.add_argument(
        "--format", help="force the data format (data.format): text, prompt_completion, messages, sharegpt, alpaca"
    )
    p.add_argument("--skip-bad-lines", action="store_true", help="skip malformed data lines and report them")
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow the model repository's own code (model.trust_remote_code)",
    )
    p.add_argument(
        "--no-wandb", action="store_true", help="do not log to Weights & Biases (logging.wandb_mode=disabled)"
    )
    p.set_defaults(func=run)


def flag_overrides(args: argparse.Namespace) -> dict:
    """`--set` items merged with the dedicated flags (the flags win)."""
    overrides = parse_overrides(args.overrides)
    flags: dict = {}
    if args.model:
        flags.setdefault("model", {})["name_or_path"] = args.model
    if args.trust_remote_code:
        flags.setdefault("model", {})["trust_remote_code"] = True
    if args.data:
        flags.setdefault("data", {})["path"] = args.data
    if args.eval_data:
        flags.setdefault("data", {})["eval_path"] = args.eval_data
    if args.format:
        flags.setdefault("data", {})["format"] = args.format
    if args.skip_bad_lines:
        flags.setdefault("data", {})["skip_bad_lines"] = True
    if args.no_wandb:
        flags.setdefault("logging", {})["wandb_mode"] = "disabled"
    return merge(overrides, flags)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from lowmem_ft.errors import UserError
    from lowmem_ft.recipe.load import resolve
    from lowmem_ft.recipe.select import choose_recipe
    from lowmem_ft.train.run import last_checkpoint, prepare_run_dir, train

    overrides = flag_overrides(args)
    if args.resume:
        run_dir = Path(args.resume)
        if not (run_dir / "recipe.yaml").is_file():
            raise UserError(f"--resume {run_dir}: not a run directory (no recipe.yaml)")
        if last_checkpoint(run_dir) is None:
            raise UserError(f"--resume {run_dir}: no checkpoint saved yet; start the run again without --resume")
        recipe = resolve(run_dir / "recipe.yaml", overrides)
        choice = {"how": "resume", "recipe": str(run_dir / "recipe.yaml")}
    else:
        recipe, choice = choose_recipe(vram_gb=args.vram, recipe=args.recipe, overrides=overrides)
        if not recipe.model.name_or_path:
            raise UserError("no model given; pass --model HUB_ID_OR_PATH")
        if not recipe.data.path:
            raise UserError("no training data given; pass --data FILE.jsonl")
        if not Path(recipe.data.path).is_file():
            raise UserError(f"data file {recipe.data.path} does not exist; pass --data PATH to a JSONL file")
        run_dir = prepare_run_dir(recipe, args.name, resume=False)
    result = train(recipe, run_dir, resume=bool(args.resume), choice=choice)
    m = result.metrics
    print(
        f"done: {m['global_step']} steps, loss {m['first_loss']:.4f} → {m['last_loss']:.4f}; "
        f"run directory {result.run_dir}"
    )
    return 0
