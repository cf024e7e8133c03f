"""Preparing a training run: what `lowmem-ft train` was asked, made into a run ready to start.

The one idea: `prepare` is the one path from a `TrainRequest` (the command line, parsed once) to a `Prepared` run —
a run continued from its newest complete checkpoint (`--resume`) or a new one whose recipe is chosen
(`lowmem_ft.choosing`), what it reads and writes checked once before any work, several processes planned
(`lowmem_ft.train.distributed.launch`), and its run directory made and locked. The ranks of a launched run take the same path
back (`prepare_launched`). The command only parses, calls this, and trains or launches.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lowmem_ft.choosing import Choice, asked, check_positions, choose_recipe, model_positions, origin_of
from lowmem_ft.errors import UserError
from lowmem_ft.recipe.schema import METHOD_INPUTS
from lowmem_ft.rundir import RunDir

if TYPE_CHECKING:
    from lowmem_ft.memory.planner import Requested
    from lowmem_ft.recipe.schema import Recipe
    from lowmem_ft.train.distributed.launch import LaunchPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainRequest:
    """What `train` was asked. `overrides`: the recipe keys set on the command line (`--set` and the keys' flags,
    the flags winning); `origins`: the flag behind each key set by one (`{"memory.max_seq_len": "--seq-len"}`), so
    an error names what the user typed."""

    overrides: dict[str, Any] = field(default_factory=dict)
    origins: dict[str, str] = field(default_factory=dict)
    vram_gb: float | None = None
    recipe: str | None = None
    name: str | None = None
    resume: str | None = None
    gpus: int = 1
    nodes: int = 1
    strategy: Requested = "auto"
    offload: bool = False
    accelerate_args: tuple[str, ...] = ()
    verify: bool = (
        False  # trace the plan's step at full size before any weight is read (`lowmem_ft.train.trace.verify`)
    )
    reward_fns: tuple[str, ...] = ()  # GRPO's --reward-fn entries (files named on the command line only)

    def __post_init__(self) -> None:
        if self.resume and "adapter.name_or_path" in self.origins:
            raise UserError(
                "--adapter starts a new run from an adapter, --resume continues a run's checkpoint: give one"
            )

    @property
    def launched(self) -> bool:
        """Whether the run needs several processes (`accelerate launch`)."""
        return self.gpus > 1 or self.nodes > 1


@dataclass(frozen=True)
class Prepared:
    """A run ready to start: its recipe, how that was chosen, its run directory (locked), whether it continues a
    checkpoint, and for several processes the launch plan."""

    recipe: Recipe
    choice: Choice
    run: RunDir
    resumed: bool = False
    launch: LaunchPlan | None = None


def prepare(request: TrainRequest) -> Prepared:
    """The run `request` asks for: continued or chosen, inputs checked, launch planned, run directory made."""
    if request.resume:
        run, recipe, choice = resume(request.resume, request.overrides, lock=True)
    else:
        run, (recipe, choice) = None, choose(request)
    from lowmem_ft.recipe.rewards import rewards_problem

    problem = rewards_problem(recipe.training.method, recipe.grpo.rewards, request.reward_fns)
    if problem:  # before a run directory is made or any rank launched
        if run is not None:
            run.unlock()
        raise UserError(problem)
    plan = None
    if request.launched:  # refused before a new run directory is made
        from lowmem_ft.train.distributed.launch import plan_launch

        if request.vram_gb is None and not request.resume and METHOD_INPUTS[recipe.training.method].data_format:
            # not planned, so the data was not read yet: the method's rows (pairs, KTO labels, GRPO prompts) are
            # checked here, once, not by every rank after the launch
            from lowmem_ft.data import length_profile

            length_profile(recipe)

        plan = plan_launch(recipe, gpus=request.gpus, nodes=request.nodes, strategy=request.strategy,
                           offload=request.offload, accelerate_args=list(request.accelerate_args), planned=choice)  # fmt: skip
    resumed = run is not None
    run = run or RunDir.new(recipe.training.output_dir, request.name, recipe.model.name_or_path)
    return Prepared(recipe, choice, run, resumed, plan)


def resume(path: str | Path, overrides: dict | None = None, lock: bool = False) -> tuple[RunDir, Recipe, Choice]:
    """The one resume path (`--resume`, and a relaunch of `--gpus` ranks): the run's recipe (with any new `--set`) and
    how it was chosen, continued from its newest complete checkpoint. `lock`: hold the run directory first
    (`--resume`; the ranks of a launch run under their launcher's lock).

    A run directory is data: its recipe.yaml cannot turn on model.trust_remote_code, only this command line can
    (`--trust-remote-code` in `overrides`; `lowmem_ft.recipe.load` drops the file's)."""
    run = RunDir.existing(path)
    if lock:
        run.lock()  # a run still going is said as such, before its checkpoints are looked at
    run.refuse_finished()  # continuing would train past its last step and rewrite its weights
    recipe = run.read_recipe(overrides)
    refuse_method_change(run, recipe, overrides or {})
    run.resumable()
    check_inputs(recipe, run.path)
    # the plan of the original run (prediction, VRAM, margin) carries on
    choice = run.read_choice() or Choice("recipe", str(run.recipe_file), recipe.model.name_or_path)
    return run, recipe, choice.resumed(str(run.recipe_file))


def refuse_method_change(run: RunDir, recipe: Recipe, overrides: dict) -> None:
    """A resume continues the run's own checkpoint with its own method: `--method` (or training.method) naming
    another would continue an SFT checkpoint as DPO (its optimizer state, its step count, its data order) while the
    banner says the run resumed — refused in one line, with the way that works (a new run from the adapter)."""
    given = (overrides.get("training") or {}).get("method") if isinstance(overrides.get("training"), dict) else None
    if given is None:
        return
    saved = run.read_recipe({"model": {"trust_remote_code": recipe.model.trust_remote_code}}).training.method
    if given != saved:
        run.unlock()
        kept = run.last_checkpoint()
        start = (f": lowmem-ft train --method {given} --adapter {kept} --data ... --vram ..." if kept is not None
                 else " once it has a checkpoint")  # fmt: skip
        raise UserError(
            f"--resume {run.path}: the run trains --method {saved}, not {given}; a resume continues its checkpoint "
            f"as it was — to train {given} from where it got to, start a new run from its adapter{start}"
        )


def planned(
    request: TrainRequest, check: Callable[[Recipe], None], say: Callable[[str], None] = print, show=None
) -> tuple[Recipe, Choice]:
    """The recipe `request` asks for and the record of why: the one choosing path of `train` and `plan`.

    With --vram, the data's token-length profile (when the recipe has data) is read after the recipe planning starts
    from is checked — the --vram above its margin, then `check` (train: every input the run reads and writes;
    plan: the model's config and the data) — and the planner gets the same arguments either way: the world size over
    `gpus` × `nodes` (the plan is per device), each node's host RAM holding its own `gpus` processes. `--verify`
    traces the plan's step at full size and plans again while it is over the budget; `say` prints its progress and
    `show(recipe, choice)` each plan it traces (plan's table)."""
    profile, overrides, why = None, request.overrides, None

    def plan(overrides: dict, profile_=None) -> tuple[Recipe, Choice]:
        return choose_recipe(
            vram_gb=request.vram_gb,
            recipe=request.recipe,
            overrides=overrides,
            origins=request.origins,
            profile=profile_ or profile,
            gpus=request.gpus * request.nodes,  # the plan is per device; the world size divides the shards
            nodes=request.nodes,  # ... and each node's host RAM holds its own --gpus processes
            strategy=request.strategy,
            offload=request.offload or None,  # not given: the planner may offload as its last step
        )

    if request.vram_gb is not None:  # image chats: the resolution cap is chosen with the plan (`choose_cap`)
        overrides, profile, why = _data_profile(request, check, plan)
        if why:
            log.info("images: %s", why)
    recipe, choice = plan(overrides)
    if request.vram_gb is not None and why:  # the image cap's reason, beside the planner's own (`plan` prints it)
        choice.reasons["vision.max_pixels"] = why
    if request.verify:
        recipe, choice = _verify(request, recipe, choice, plan, overrides, say, show)
    return recipe, choice


def _verify(request: TrainRequest, recipe: Recipe, choice: Choice, plan, overrides, say, show) -> tuple[Recipe, Choice]:
    """--verify: the plan's step traced at full size before any weight is read; over the budget, planned again."""
    from lowmem_ft.recipe.load import merge
    from lowmem_ft.train.trace.verify import margin_override, verified

    if request.vram_gb is None:
        raise UserError("--verify traces the plan's step: give --vram GB")
    show = show or (lambda recipe, choice: None)
    show(recipe, choice)
    say(f"tracing the training step of the plan at full size on the CPU (no weights): {recipe.model.name_or_path}")

    def again(margin: float) -> tuple[Recipe, Choice]:
        new_recipe, new_choice = plan(merge(overrides, margin_override(margin)))
        show(new_recipe, new_choice)
        return new_recipe, new_choice

    recipe, choice, _ = verified(recipe, choice, again, say)
    return recipe, choice


def choose(request: TrainRequest) -> tuple[Recipe, Choice]:
    """The recipe for a new run and the record of why (`planned`, every input checked), then what `train` does with
    a recipe as given: its length checked within the model's positions; over the host RAM refused (no guard steps
    down from an OOM-killed host); over the VRAM budget warned about (the guard steps down if memory runs out)."""
    recipe, choice = planned(request, check_inputs)
    if request.vram_gb is None:  # not planned: the recipe's length as given, within the model's positions
        check_inputs(recipe)
        length, model = recipe.memory.max_seq_len, recipe.model.name_or_path
        origin = origin_of("memory.max_seq_len", request.overrides, request.origins)
        where = asked("memory.max_seq_len", length, origin, request.recipe)
        check_positions(length, model_positions(model), model, where)
    elif choice.plan is not None and not choice.plan.host_fits:
        why = choice.reasons.get("host_ram") or choice.plan.unfit_reason()
        raise UserError(f"recipe {request.recipe}: {why}")
    elif choice.fits is False:  # --recipe R --vram N: used as given
        log.warning(
            "recipe %s is predicted to need %.1f GB, over the --vram %g budget of %.1f GB (margin %g GB); drop "
            "--recipe to let the planner choose, or see `lowmem-ft plan --vram %g --model %s --recipe %s`",
            request.recipe, choice.predicted_peak_gb, request.vram_gb, choice.target.budget_gb,
            choice.target.margin_gb, request.vram_gb, recipe.model.name_or_path, request.recipe,
        )  # fmt: skip
    return recipe, choice


def _data_profile(request: TrainRequest, check: Callable[[Recipe], None], plan) -> tuple[dict, Any, str | None]:
    """(overrides, the data's token-length profile, why the image cap) for the planner to choose max_seq_len
    (tokenized once, cached for training), after the inputs of the recipe planning starts from are checked: the
    model, data and output directory are the ones the planned recipe keeps. No profile when the recipe has no data
    (`plan` without --data). Image chats: with their image tokens, at the resolution cap chosen with the plan
    (`lowmem_ft.vision.setup.choose_cap`)."""
    from lowmem_ft.choosing import start_recipe, target_for
    from lowmem_ft.vision.setup import choose_cap

    start = start_recipe(request.vram_gb, request.recipe, request.overrides, request.origins)
    target_for(request.vram_gb, start)  # --vram above the recipe's margin, before the data is tokenized
    check(start)
    if not (start.data.path or start.data.mix):
        return request.overrides, None, None
    return choose_cap(start, request.overrides, plan)


def check_plan_inputs(recipe: Recipe) -> None:
    """What `plan` reads: the model's config (no weights: a Hub id from the offline catalog will do) and, when the
    recipe has data, every source of it (resolved, nothing read yet)."""
    from lowmem_ft.checks import check_model
    from lowmem_ft.data import check_source

    check_model(recipe.model.name_or_path, "model", weights=False)
    if recipe.data.path or recipe.data.mix:
        check_source(recipe)


def check_inputs(recipe: Recipe, run_dir: Path | None = None, flag: str = "--resume") -> None:
    """What the run reads and where it writes, checked before any work: the model (a local directory complete, its
    config loadable without code unless --trust-remote-code), every data source (resolved, nothing read yet), and
    the run directory (`run_dir`, given by `flag`) or training.output_dir it will be made in, writable."""
    from lowmem_ft.checks import check_model, check_writable
    from lowmem_ft.data import check_source
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


def prepare_launched(path: str | Path, trust_remote_code: bool) -> Prepared:
    """One process of a launched run, in the run directory its launcher prepared. A relaunch by hand after a crash
    continues from the last checkpoint, through the same resume path as `--resume`. Its recipe.yaml cannot turn on
    model.trust_remote_code: the launching command passes --trust-remote-code on the ranks' command line."""
    run = RunDir(path)
    info = run.read_launch()
    overrides = {"model": {"trust_remote_code": True}} if trust_remote_code else {}
    if run.last_checkpoint() is not None:
        run, recipe, choice = resume(run.path, overrides)
        return Prepared(recipe, choice, run, resumed=True)
    recipe = run.read_recipe(overrides)
    check_inputs(recipe, run.path, "--run-dir")
    return Prepared(recipe, Choice.from_dict(info["choice"]), run)
