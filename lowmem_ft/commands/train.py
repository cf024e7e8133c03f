"""`lowmem-ft train`: parse the flags once into a `TrainRequest`, prepare the run (`lowmem_ft.preparing`), then train
in this process or launch one per GPU."""

from __future__ import annotations

import argparse
from typing import get_args

from lowmem_ft.commands import flags
from lowmem_ft.errors import UserError
from lowmem_ft.memory.planner import Requested


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="fine-tune a model on your data within a VRAM target",
        description="Fine-tune MODEL on DATA. With --vram the recipe is chosen for that much GPU memory; "
        "--recipe uses a shipped recipe (8gb, 24gb, 40gb) or a YAML file; --set section.key=value overrides any key.",
    )
    _add_inputs(p)
    k = p.add_argument_group("common recipe keys (each the same as its --set)")
    flags.add_key_flags(k, "--seq-len", "--max-steps", "--epochs", "--lr", "--output-dir", "--report-to")
    h = p.add_argument_group("adapters and the Hub")
    flags.add_key_flags(h, "--adapter")
    flags.add_push_to_hub(h, "the adapter (or model)", "when training ends")
    e = p.add_argument_group("evaluation when training ends (`lowmem-ft eval` on the run)")
    e.add_argument("--eval-tasks", metavar="NAME,…|FILE.yaml", help="lm-eval tasks to run on the finished run")
    e.add_argument("--eval-limit", type=flags.count, metavar="N", help="at most N examples per eval task")
    e.add_argument("--eval-compare-base", action="store_true", help="also evaluate the base and print the deltas")
    _add_launch(p)
    p.set_defaults(func=run)


def _add_inputs(p: argparse.ArgumentParser) -> None:
    """What to train and on what: model, data, the VRAM target or recipe, the run's name and state."""
    flags.add_key_flags(p, "--model", "--data")
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
        "installed library versions; about a minute of CPU time at any depth), planning again if it is over the budget",
    )
    p.add_argument("--recipe", metavar="NAME_OR_FILE", help="shipped recipe name or YAML file")
    flags.add_key_flags(p, "--host-ram")
    flags.add_set(p, "override one recipe key; repeatable (e.g. --set training.max_steps=100)")
    p.add_argument(
        "--name",
        type=flags.run_name,
        help="run name (a name, not a path); the run goes to <training.output_dir>/<name> (default: model-timestamp)",
    )
    p.add_argument(
        "--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its newest complete checkpoint"
    )
    flags.add_key_flags(
        p, "--method", "--eval-data", "--format", "--skip-bad-lines", "--trust-remote-code", "--no-wandb"
    )
    p.add_argument(
        "--reward-fn",
        dest="reward_fns",
        action="append",
        default=[],
        metavar="PATH.py:NAME[:WEIGHT]",
        help="--method grpo: a reward function of yours, NAME in the Python file PATH.py, with an optional weight; "
        "repeatable. Named here only (never in a recipe): the file's code runs in this process",
    )


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


def request_of(args: argparse.Namespace):
    """The command line as a `TrainRequest`: `--set` items merged with the keys' own flags (the flags win)."""
    from lowmem_ft.preparing import TrainRequest
    from lowmem_ft.recipe.load import merge, parse_overrides

    keys, origins = flags.key_overrides(args)
    return TrainRequest(
        overrides=merge(parse_overrides(args.overrides), keys),
        origins=origins,
        vram_gb=args.vram,
        recipe=args.recipe,
        name=args.name,
        resume=args.resume,
        gpus=args.gpus or 1,
        nodes=args.nodes,
        strategy=args.strategy,
        offload=args.offload,
        accelerate_args=tuple(args.accelerate_args),
        verify=args.verify,
        reward_fns=tuple(args.reward_fns),
    )


def run(args: argparse.Namespace) -> int:
    import os

    from lowmem_ft.preparing import prepare, prepare_launched
    from lowmem_ft.train.observe.progress import done_line
    from lowmem_ft.train.run import train

    if args.no_wandb:  # the explicit flag beats a WANDB_MODE in the environment (launched ranks inherit it)
        os.environ["WANDB_MODE"] = "disabled"
    rewards = _reward_fns(args.reward_fns)
    if args.run_dir:  # one process of a launched run
        ready = prepare_launched(args.run_dir, args.trust_remote_code)
        result = train(ready.recipe, ready.run, choice=ready.choice, resume=ready.resumed, reward_fns=rewards)
        if result.is_main:
            print(done_line(result.metrics, ready.run.path))
        return 0
    request = request_of(args)
    # an upload that cannot happen fails now, before any data or model work, not after training
    hub_repo = _hub_preflight(args)
    evaluation = _eval_preflight(args)  # an unknown task, or lm-eval missing, fails before training too
    ready = prepare(request)
    if ready.launch is not None:
        _launch(ready, tuple(args.reward_fns))
    else:
        result = train(ready.recipe, ready.run, choice=ready.choice, resume=ready.resumed, reward_fns=rewards)
        print(done_line(result.metrics, result.run_dir))
    if evaluation is not None:
        _evaluate(args, ready.run.path, evaluation)
    if hub_repo is not None:  # once, from this process, after every rank finished
        from lowmem_ft.hub import push_run

        print(f"pushed to {push_run(ready.run, hub_repo)}")
    return 0


def _eval_preflight(args: argparse.Namespace):
    """--eval-tasks resolved now (lm-eval installed, every task known): (TaskManager, names), or None."""
    if not args.eval_tasks:
        if args.eval_limit or args.eval_compare_base:
            raise UserError("--eval-limit / --eval-compare-base need --eval-tasks")
        return None
    from lowmem_ft.commands.eval import _require_lm_eval
    from lowmem_ft.evaluate.tasks import resolve

    _require_lm_eval()
    return resolve(args.eval_tasks)


def _evaluate(args: argparse.Namespace, run_dir, resolved) -> None:
    """`lowmem-ft eval RUN_DIR` with the tasks resolved before training (the same command, not a copy of it)."""
    from lowmem_ft.commands import eval as eval_command

    eval_args = argparse.Namespace(
        target=str(run_dir), tasks=args.eval_tasks, limit=args.eval_limit, compare_base=args.eval_compare_base,
        vram=args.vram, max_length=None, device="auto", include_path=None, base=None, resolved=resolved,
    )  # fmt: skip
    eval_command.run(eval_args)


def _reward_fns(entries: list[str]) -> list:
    """`--reward-fn` entries, parsed and their files imported now: a typo fails before any model is loaded."""
    from lowmem_ft.train.methods.rewards import load_user_function, parse_reward_fn

    specs = [parse_reward_fn(entry) for entry in entries]
    for spec in specs:
        load_user_function(spec)
    return specs


def _hub_preflight(args: argparse.Namespace):
    if not args.push_to_hub:
        return None
    from lowmem_ft.hub import preflight

    return preflight(args.push_to_hub, private=args.hub_private)


def _launch(ready, reward_fns: tuple[str, ...] = ()) -> None:
    """--gpus N: write the run directory's launch files, print the relaunch command, run accelerate (rank 0 prints
    the "done" line); the run directory stays locked while the ranks, its children, run."""
    import shlex

    from lowmem_ft.train.distributed import launch

    plan, run_dir = ready.launch, ready.run
    cmd = launch.prepare(run_dir, ready.recipe, plan, ready.choice, ready.resumed, reward_fns)
    where = "CPU processes (gloo)" if plan.cpu else "GPUs"
    print(f"{plan.strategy} on {plan.world_size} {where}: {plan.reason}")
    print(f"relaunch by hand: {shlex.join(cmd)}")
    try:
        launch.settle(run_dir, plan, launch.run(cmd))  # which rank ended a failed launch, and how, in one line
    finally:
        run_dir.unlock()
