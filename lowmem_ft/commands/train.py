"""`lowmem-ft train`: parse, choose the recipe, build, run, save — the logic lives in library modules."""

from __future__ import annotations

import argparse
from typing import get_args

from lowmem_ft.commands import flags
from lowmem_ft.memory.planner import Requested
from lowmem_ft.recipe.load import merge, parse_overrides
from lowmem_ft.recipe.schema import DataFormat, Tracker


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="fine-tune a model on your data within a VRAM target",
        description="Fine-tune MODEL on DATA. With --vram the recipe is chosen for that much GPU memory; "
        "--recipe uses a shipped recipe (8gb, 24gb, 40gb) or a YAML file; --set section.key=value overrides any key.",
    )
    _add_inputs(p)
    _add_recipe_keys(p)
    _add_adapters(p)
    _add_launch(p)
    p.set_defaults(func=run)


def _add_inputs(p: argparse.ArgumentParser) -> None:
    """What to train and on what: model, data, the VRAM target or recipe, the run's name and state."""
    p.add_argument("--model", help="hub id or local directory of the base model (model.name_or_path)")
    p.add_argument(
        "--data",
        help="training data: a JSONL / JSON / Parquet / CSV file, a directory of them, a save_to_disk directory "
        "or a Hub id (data.path)",
    )
    p.add_argument(
        "--vram",
        type=flags.vram_gb,
        metavar="GB",
        help="GPU memory to fit in, in GB (e.g. 8, 24, 40); on a bigger card the process is capped at GB",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="with --vram: trace the plan's training step at full size on the CPU before loading weights (the "
        "installed library versions; a minute or more for a 7B model), planning again if it is over the budget",
    )
    p.add_argument("--recipe", metavar="NAME_OR_FILE", help="shipped recipe name or YAML file")
    flags.add_set(p, "override one recipe key; repeatable (e.g. --set training.max_steps=100)")
    p.add_argument(
        "--name",
        type=flags.run_name,
        help="run name (a name, not a path); the run goes to <training.output_dir>/<name> (default: model-timestamp)",
    )
    p.add_argument(
        "--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its newest complete checkpoint"
    )
    p.add_argument("--eval-data", help="evaluation data, any source --data takes (data.eval_path)")
    p.add_argument(
        "--format",
        choices=[f for f in get_args(DataFormat) if f != "auto"],
        help="force the data format (data.format); default: detect it",
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


def _add_recipe_keys(p: argparse.ArgumentParser) -> None:
    k = p.add_argument_group("common recipe keys (each the same as its --set)")
    for dest, (key, flag, metavar, what) in SET_FLAGS.items():
        k.add_argument(flag, dest=dest, metavar=metavar, help=f"{what} ({key})")
    k.add_argument(
        "--report-to",
        nargs="+",
        choices=get_args(Tracker),
        metavar="TRACKER",
        help=f"trackers for metrics, recipe and plan: {', '.join(get_args(Tracker))} (logging.report_to)",
    )


def _add_adapters(p: argparse.ArgumentParser) -> None:
    h = p.add_argument_group("adapters and the Hub")
    h.add_argument(
        "--adapter",
        metavar="PATH_OR_ID",
        help="continue training this LoRA adapter (a directory, runs/NAME, or a Hub id); the plan counts its rank "
        "and target modules (adapter.name_or_path)",
    )
    flags.add_push_to_hub(h, "the adapter (or model)", "when training ends")


def _add_launch(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("several GPUs (through accelerate launch)")
    g.add_argument(
        "--gpus", type=flags.count, metavar="N", help="processes per node, one per GPU (CPU processes without CUDA)"
    )
    g.add_argument(
        "--nodes", type=flags.count, default=1, metavar="N", help="machines; run the printed command on each"
    )
    g.add_argument(
        "--strategy",
        default="auto",
        choices=get_args(Requested),
        help="ddp: a full copy per GPU; fsdp / zero3: weights, gradients, optimizer sharded; zero2: optimizer and "
        "gradients sharded (default auto)",
    )
    g.add_argument("--offload", action="store_true", help="keep optimizer states (FSDP: parameters too) in host RAM")
    g.add_argument(
        "--accelerate-arg",
        dest="accelerate_args",
        action="append",
        default=[],
        metavar="ARG",
        help="passed to accelerate launch as is; repeatable (e.g. --accelerate-arg=--main_process_ip=10.0.0.1)",
    )
    # what the processes `--gpus` launches run (train in a prepared run directory): internal, not in --help
    g.add_argument("--run-dir", help=argparse.SUPPRESS)


# Flags that are exactly `--set` of one recipe key (values parsed and checked as --set's, errors naming the flag):
# argparse dest → (recipe key, flag, metavar, help).
SET_FLAGS = {
    "seq_len": ("memory.max_seq_len", "--seq-len", "N", "longest sequence in tokens; fixed, not sized from the data"),
    "max_steps": ("training.max_steps", "--max-steps", "N", "optimizer steps to run (-1: run --epochs passes)"),
    "epochs": ("training.epochs", "--epochs", "N", "passes over the data"),
    "lr": ("optimizer.lr", "--lr", "LR", "peak learning rate"),
    "output_dir": ("training.output_dir", "--output-dir", "DIR", "parent directory of run directories"),
}
# The other flags behind a recipe key (dest → key, flag): --adapter's value is a path, --report-to's a list.
VALUE_FLAGS = {"adapter": ("adapter.name_or_path", "--adapter"), "report_to": ("logging.report_to", "--report-to")}


def key_flags(args: argparse.Namespace) -> tuple[dict, dict[str, str]]:
    """The recipe keys set by SET_FLAGS and VALUE_FLAGS, as overrides, and the flag behind each (for errors)."""
    items = [f"{key}={getattr(args, dest)}" for dest, (key, *_) in SET_FLAGS.items() if getattr(args, dest) is not None]
    overrides = parse_overrides(items)  # the same YAML scalars as --set: 2e-4, 100, -1
    for dest, (key, _) in VALUE_FLAGS.items():
        value = getattr(args, dest)
        if value is not None:
            section, name = key.split(".")
            overrides.setdefault(section, {})[name] = value
    given = {**{dest: f[:2] for dest, f in SET_FLAGS.items()}, **VALUE_FLAGS}
    origins = {key: flag for dest, (key, flag) in given.items() if getattr(args, dest) is not None}
    return overrides, origins


# The flag behind each recipe key a flag sets: errors about the value name the flag the user typed.
FLAG_KEYS = {
    "model.name_or_path": "--model",
    "model.trust_remote_code": "--trust-remote-code",
    "data.path": "--data",
    "data.eval_path": "--eval-data",
    "data.format": "--format",
    "data.skip_bad_lines": "--skip-bad-lines",
    "logging.wandb_mode": "--no-wandb",
}


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
    return merge(merge(overrides, flags), key_flags(args)[0])


def flag_origins(args: argparse.Namespace) -> dict[str, str]:
    """The flags the user gave, by the recipe key each sets (for error messages)."""
    given = {"--model": args.model, "--trust-remote-code": args.trust_remote_code, "--data": args.data,
             "--eval-data": args.eval_data, "--format": args.format, "--skip-bad-lines": args.skip_bad_lines,
             "--no-wandb": args.no_wandb}  # fmt: skip
    return {key: flag for key, flag in FLAG_KEYS.items() if given[flag]} | key_flags(args)[1]


def run(args: argparse.Namespace) -> int:
    import os

    from lowmem_ft.train.run import train

    if args.no_wandb:  # the explicit flag beats a WANDB_MODE in the environment (launched ranks inherit it)
        os.environ["WANDB_MODE"] = "disabled"
    if args.run_dir:
        return _run_launched(args.run_dir, args.trust_remote_code)
    if args.resume and args.adapter:
        from lowmem_ft.errors import UserError

        raise UserError("--adapter starts a new run from an adapter, --resume continues a run's checkpoint: give one")
    # an upload that cannot happen fails now, before any data or model work, not after training
    hub_repo = _hub_preflight(args)
    overrides = flag_overrides(args)
    if args.resume:
        run_dir, recipe, choice = resume(args.resume, overrides, lock=True)
    else:
        run_dir, (recipe, choice) = None, choose(args, overrides)
    if (args.gpus or 1) > 1 or args.nodes > 1:
        return _launch(args, recipe, choice, run_dir, hub_repo)
    run_dir = run_dir or new_run(recipe, args.name)
    result = train(recipe, run_dir, choice=choice, resume=bool(args.resume))
    _print_done(result.metrics, result.run_dir)
    _push(result.run_dir, hub_repo)
    return 0


def _hub_preflight(args: argparse.Namespace):
    if not args.push_to_hub:
        return None
    from lowmem_ft.hub import preflight

    return preflight(args.push_to_hub, private=args.hub_private)


def _push(run_dir, hub_repo) -> None:
    if hub_repo is None:
        return
    from lowmem_ft.hub import push_run
    from lowmem_ft.rundir import RunDir

    print(f"pushed to {push_run(RunDir(run_dir), hub_repo)}")


def new_run(recipe, name: str | None):
    """The run directory of a new run: `<training.output_dir>/<name>`."""
    from lowmem_ft.rundir import RunDir

    return RunDir.new(recipe.training.output_dir, name, recipe.model.name_or_path)


def resume(path, overrides: dict | None = None, lock: bool = False):
    """The one resume path (`--resume`, and a relaunch of `--gpus` ranks): the run's recipe (with any new `--set`) and
    how it was chosen, continued from its newest complete checkpoint. `lock`: hold the run directory first
    (`--resume`; the ranks of a launch run under their launcher's lock).

    A run directory is data: its recipe.yaml cannot turn on model.trust_remote_code, only this command line can
    (`--trust-remote-code` in `overrides`; `lowmem_ft.recipe.load` drops the file's)."""
    from lowmem_ft.errors import UserError
    from lowmem_ft.planning import Choice
    from lowmem_ft.rundir import RunDir

    run = RunDir.existing(path)
    if lock:
        run.lock()  # a run still going is said as such, before its checkpoints are looked at
    recipe = run.read_recipe(overrides)
    point = run.resume_point()
    if point.checkpoint is None:
        run.unlock()
        raise UserError(
            f"--resume {run.path}: {point.describe()}, nothing to continue; start the run again without --resume "
            "(same --name)"
        )
    _check_inputs(recipe, run.path)
    # the plan of the original run (prediction, VRAM, margin) carries on
    choice = (run.read_choice() or Choice("recipe", str(run.recipe_file), recipe.model.name_or_path)).resumed(
        str(run.recipe_file)
    )
    return run, recipe, choice


def _verify(args: argparse.Namespace, recipe, choice, plan, overrides: dict):
    """--verify: trace the plan's step at full size before any weight is read; over the budget, plan again."""
    from lowmem_ft.commands.plan import margin_override
    from lowmem_ft.errors import UserError
    from lowmem_ft.recipe.load import merge
    from lowmem_ft.train.verify import verified

    if args.vram is None or (args.gpus or 1) * args.nodes > 1:
        raise UserError("--verify traces the plan for one device: give --vram GB (and no --gpus / --nodes)")
    print(f"tracing the training step of the plan at full size on the CPU (no weights): {recipe.model.name_or_path}")
    recipe, choice, _ = verified(recipe, choice, lambda margin: plan(merge(overrides, margin_override(margin))), print)
    return recipe, choice


def choose(args: argparse.Namespace, overrides: dict):
    """The recipe for a new run and the record of why: planned for --vram from the data's length profile."""
    import logging

    from lowmem_ft.planning import choose_recipe

    origins = flag_origins(args)
    profile = _data_profile(args, overrides, origins) if args.vram is not None else None

    def plan(overrides: dict):
        return choose_recipe(
            vram_gb=args.vram,
            recipe=args.recipe,
            overrides=overrides,
            origins=origins,
            profile=profile,
            gpus=(args.gpus or 1) * args.nodes,  # the plan is per device; the world size divides the shards
            strategy=args.strategy,
            offload=args.offload or None,  # not given: the planner may offload as its last step
        )

    recipe, choice = plan(overrides)
    if getattr(args, "verify", False):
        recipe, choice = _verify(args, recipe, choice, plan, overrides)
    _check_inputs(recipe)
    if args.vram is None:  # not planned: the recipe's length as given, within the model's positions
        _check_length(recipe, overrides, args.recipe)
    elif choice.fits is False:  # --recipe R --vram N: used as given; the guard steps down if memory runs out
        logging.getLogger(__name__).warning(
            "recipe %s is predicted to need %.1f GB, over the --vram %g budget of %.1f GB (margin %g GB); drop "
            "--recipe to let the planner choose, or see `lowmem-ft plan --vram %g --model %s --recipe %s`",
            args.recipe, choice.predicted_peak_gb, args.vram, choice.target.budget_gb, choice.target.margin_gb,
            args.vram, recipe.model.name_or_path, args.recipe,
        )  # fmt: skip
    return recipe, choice


def _check_inputs(recipe, run_dir=None, flag: str = "--resume") -> None:
    """What the run reads and where it writes, checked before any work: the model (a local directory complete, its
    config loadable without code unless --trust-remote-code), every data source (resolved, nothing read yet), and
    the run directory (`run_dir`, given by `flag`) or training.output_dir it will be made in, writable."""
    from pathlib import Path

    from lowmem_ft.checks import check_model, check_writable
    from lowmem_ft.data import check_source
    from lowmem_ft.errors import UserError
    from lowmem_ft.train.model import load_config

    if not recipe.model.name_or_path:
        raise UserError("no model given; pass --model HUB_ID_OR_PATH")
    check_model(recipe.model.name_or_path, "model")
    load_config(recipe)
    check_source(recipe)
    if run_dir is None:
        check_writable(Path(recipe.training.output_dir), "training.output_dir")
    else:
        check_writable(Path(run_dir), flag)


def _check_length(recipe, overrides: dict, recipe_name: str | None) -> None:
    from lowmem_ft.planning import check_positions, model_positions

    length = recipe.memory.max_seq_len
    given = "max_seq_len" in overrides.get("memory", {})
    asked = f"--set memory.max_seq_len={length}" if given else f"memory.max_seq_len of recipe {recipe_name}"
    check_positions(length, model_positions(recipe.model.name_or_path), recipe.model.name_or_path, asked)


def _data_profile(args: argparse.Namespace, overrides: dict, origins: dict[str, str]):
    """The data's token-length profile, for the planner to choose max_seq_len (tokenized once, cached for training)."""
    from lowmem_ft.data import length_profile
    from lowmem_ft.planning import start_recipe, target_for

    start = start_recipe(args.vram, args.recipe, overrides, origins)
    target_for(args.vram, start)  # --vram above the recipe's margin, before the data is tokenized
    _check_inputs(start)
    return length_profile(start)


def _print_done(m: dict, run_dir) -> None:
    print(f"done: {m['global_step']} steps, {_loss_line(m)}; run directory {run_dir}")


def _loss_line(m: dict) -> str:
    """The logged training loss at its first and last logged steps — or the one logged step, beside the run's mean
    (`train_loss`), when the run was shorter than training.logging_steps."""
    first, last = m.get("first_loss"), m.get("last_loss")
    if first is None:
        mean = m.get("train_loss")
        return "no loss logged" + (f" (mean {mean:.4f})" if isinstance(mean, int | float) else "")
    at = m.get("first_loss_step"), m.get("last_loss_step")
    if at[0] is None or at[0] != at[1]:
        steps = f" (steps {at[0]} → {at[1]})" if at[0] is not None else ""
        return f"loss {first:.4f} → {last:.4f}{steps}"
    mean = m.get("train_loss")
    return f"loss {first:.4f} at step {at[0]}, the only logged step" + (
        f" (mean over the run {mean:.4f})" if isinstance(mean, int | float) else ""
    )


def _launch(args: argparse.Namespace, recipe, choice, run_dir, hub_repo=None) -> int:
    """--gpus N: check, write the run directory's launch files, print the relaunch command, run accelerate."""
    import shlex
    import signal

    from lowmem_ft.errors import Interrupted, UserError
    from lowmem_ft.train import launch

    plan = launch.plan_launch(
        recipe,
        gpus=args.gpus or 1,
        nodes=args.nodes,
        strategy=args.strategy,
        offload=args.offload,
        accelerate_args=args.accelerate_args,
        planned=choice,
    )
    resumed = run_dir is not None
    run_dir = run_dir or new_run(recipe, args.name)  # locked (new or resumed) while the ranks, its children, run
    cmd = launch.prepare(run_dir, recipe, plan, choice, resumed)
    where = "CPU processes (gloo)" if plan.cpu else "GPUs"
    print(f"{plan.strategy} on {plan.world_size} {where}: {plan.reason}")
    print(f"relaunch by hand: {shlex.join(cmd)}")
    try:
        code = launch.run(cmd)
    finally:
        run_dir.unlock()
    if code != 0:
        status = run_dir.read_status()
        if status is not None and status.state == "interrupted":  # rank 0's line, and its exit code (130 / 143)
            raise Interrupted(status.reason or "interrupted", getattr(signal, status.signal or "SIGINT"))
        raise UserError(f"accelerate launch exited with code {code}; the processes' output above says why")
    _push(run_dir.path, hub_repo)  # once, from this process, after every rank finished
    return 0  # rank 0 printed the "done" line


def _run_launched(path, trust_remote_code: bool) -> int:
    """One process of a launched run: train in the prepared run directory. A relaunch by hand after a crash
    continues from the last checkpoint, through the same resume path as `--resume`. Its recipe.yaml cannot turn on
    model.trust_remote_code: the launching command passes --trust-remote-code on the ranks' command line."""
    from lowmem_ft.planning import Choice
    from lowmem_ft.rundir import RunDir
    from lowmem_ft.train.run import train

    run = RunDir(path)
    info = run.read_launch()
    checkpoint = run.last_checkpoint()
    overrides = {"model": {"trust_remote_code": True}} if trust_remote_code else {}
    if checkpoint is not None:
        run, recipe, choice = resume(run.path, overrides)
    else:
        recipe, choice = run.read_recipe(overrides), Choice.from_dict(info["choice"])
        _check_inputs(recipe, run.path, "--run-dir")
    result = train(recipe, run, choice=choice, resume=checkpoint is not None)
    if result.is_main:
        _print_done(result.metrics, run.path)
    return 0
