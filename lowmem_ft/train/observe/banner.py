"""The plan on the console before step 1: what the run chose, in a few lines, the same for every method.

The planner decides the weights' storage, the micro batch, the accumulation, the sequence length and the savers, and
predicts a peak against the budget; all of it lands in `plan.json`, `run.json` and the trackers. `RunView` gathers
what a user needs to see of it (and of the run's own facts: trainable parameters, devices, where its files go) into
one typed record, and `lines` renders it: a training method (SFT today, the preference methods later) passes its name
and the same facts, so every method's banner reads alike. `PlanBanner` prints it once per launch, on the process that
writes the run directory (rank 0), when training begins — after the trackers have started, so W&B's run is known.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import TrainerCallback

from lowmem_ft.choosing import Choice
from lowmem_ft.console import quiet
from lowmem_ft.memory.savers import LONG_CONTEXT_SAVERS
from lowmem_ft.recipe.schema import Recipe

GB = 1024**3

# Recipe memory keys that save memory at some cost, in the order the banner names them (what each is called there);
# the long-context savers' names are their records' (`lowmem_ft.memory.savers`).
SAVERS = {
    "gradient_checkpointing": "gradient checkpointing",
    "activation_offloading": "activation offloading",
    "chunked_loss": "chunked loss",
    **{saver.name: saver.label for saver in LONG_CONTEXT_SAVERS},
}


def savers_on(recipe: Recipe) -> list[str]:
    """The memory savers the recipe turns on, named as the banner names them; a paged optimizer counts as one."""
    on = [name for key, name in SAVERS.items() if getattr(recipe.memory, key, False)]
    if recipe.optimizer.name.startswith("paged"):
        on.append(f"paged optimizer ({recipe.optimizer.name})")
    return on


def weights_text(recipe: Recipe) -> str:
    m = recipe.model
    if m.quantization == "nf4":
        return f"4-bit NF4{' (double quant)' if m.double_quant else ''}, compute {m.compute_dtype}"
    if m.quantization == "int8":
        return f"8-bit int8, compute {m.compute_dtype}"
    return f"16-bit {m.compute_dtype}" if m.compute_dtype != "float32" else "32-bit float32"


def count(n: int) -> str:
    """A parameter count people read at a glance: 1.23M, 0.49B (exact below ten thousand)."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= 10 * size or (unit != "K" and n >= size):
            return f"{n / size:.2f}{unit}"
    return f"{n:,}"


@dataclass(frozen=True)
class RunView:
    """What the banner shows of one launch: the method and the recipe it runs, how the recipe was chosen (`choice`),
    and the run's own facts (parameters, devices, steps, host memory, where its files and tracker runs are)."""

    method: str
    recipe: Recipe
    choice: Choice
    trainable_params: int
    total_params: int
    world_size: int = 1
    max_steps: int | None = None
    host_gb: float | None = None  # the plan's host memory per process (offloaded parts), when a plan was made
    machine_ram_gb: float | None = None
    run_dir: str = ""
    trackers: tuple[str, ...] = ()  # "W&B offline: <dir>", "TensorBoard: <dir>", …
    images: str = ""  # image chats: images per batch, tokens per image, the resolution cap (`lowmem_ft.vision`)
    batch: str = ""  # what a step's batch is, where the method says it (GRPO's round); else sequences per step

    def lines(self) -> list[str]:
        r = self.recipe
        mem = r.memory
        head = f"plan: {self.method} of {r.model.name_or_path}, {self._how()}"
        effective = mem.micro_batch_size * mem.gradient_accumulation * self.world_size
        devices = f"{self.world_size} device{'s' if self.world_size != 1 else ''}"
        steps = f", {self.max_steps} steps" if self.max_steps else ""
        out = [
            head,
            f"  weights  {weights_text(r)}",
            f"  adapter  {self._adapter()}",
            f"  batch    {mem.micro_batch_size} micro × {mem.gradient_accumulation} accumulation × {devices} = "
            + (self.batch or f"{effective} sequences per step, ≤ {mem.max_seq_len} tokens each")
            + steps,
            f"  savers   {', '.join(savers_on(r)) or 'none'}",
            f"  memory   {self._memory()}",
        ]
        if self.choice.target is not None and self.choice.target.calibration:  # used, or why a stale one is not
            out.append(f"  margin   {self.choice.target.calibration}")
        if self.images:
            out.insert(4, f"  images   {self.images}")
        host = self._host()
        if host:
            out.append(f"  host     {host}")
        out.append(f"  run      {self.run_dir}")
        out.extend(f"  tracker  {t}" for t in self.trackers)
        return out

    def _how(self) -> str:
        c = self.choice
        if c.how == "plan":
            return f"planned for --vram {c.target.vram_gb:g} from recipe {c.recipe}"
        if c.how == "resume":
            return "resumed with its own recipe"
        return f"recipe {c.recipe}" + (f" checked against --vram {c.target.vram_gb:g}" if c.target else "")

    def _adapter(self) -> str:
        a = self.recipe.adapter
        share = f"{100 * self.trainable_params / self.total_params:.2f} %" if self.total_params else "?"
        trained = f"{count(self.trainable_params)} trainable of {count(self.total_params)} ({share})"
        if a.kind == "full":
            return f"none: full fine-tune, {trained}"
        loaded = f", continued from {a.name_or_path}" if a.name_or_path else ""
        kind = "DoRA" if a.use_dora else "LoRA"
        init = f", {a.init} init" if a.init != "default" else ""
        return f"{kind} rank {a.r} (alpha {a.alpha}{init}) on {', '.join(a.target_modules)}: {trained}{loaded}"

    def _memory(self) -> str:
        c = self.choice
        if c.target is None:
            return "not planned (no --vram): the recipe as given, the guard steps down if memory runs out"
        t = c.target
        per = " per device" if t.gpus > 1 else ""
        calibrated = f" − {t.calibration_gb:.2f} GB calibrated" if t.calibration_gb else ""
        budget = f"the {t.budget_gb:.2f} GB budget{per} ({t.vram_gb:g} GB − {t.margin_gb:g} GB margin{calibrated})"
        if c.predicted_peak_gb is None:
            return f"no prediction against {budget}"
        verdict = "fits" if c.predicted_peak_gb <= t.budget_gb else "OVER the budget: the guard steps down"
        return f"predicted peak {c.predicted_peak_gb:.2f} GB of {budget}: {verdict}"

    def _host(self) -> str:
        if self.host_gb is None and self.machine_ram_gb is None:
            return ""
        t = self.choice.target
        if t is not None and t.host_ram_gb is not None:  # the planner's host budget: what the plan was fitted under
            ram = (
                f"host budget {t.host_budget_gb:.1f} GB ({t.host_ram_gb:.1f} GB available − "
                f"{t.host_margin_gb:g} GB margin)"
            )
        else:
            ram = f"this machine has {self.machine_ram_gb:.1f} GB" if self.machine_ram_gb is not None else ""
        if self.host_gb is None:
            return f"not planned; {ram}"
        per = " per process" if self.world_size > 1 else ""
        kept = (
            f"{self.host_gb:.2f} GB{per} planned in host memory (offloaded parts)"
            if self.host_gb
            else ("nothing offloaded to host memory")
        )
        return f"{kept}; {ram}" if ram else kept


def tracker_lines(report_to: list[str], run_dir: str, tensorboard_dir: str | None = None) -> list[str]:
    """Where each tracker's run lives, read from the started trackers (W&B's run exists once training begins)."""
    out = []
    if "wandb" in report_to:
        try:
            import wandb

            run = wandb.run
        except ImportError:
            run = None
        if run is not None:
            offline = run.settings.mode in ("offline", "dryrun") or not run.url
            where = f"offline in {run.dir.removesuffix('/files')}" if offline else run.url
            out.append(f"W&B {where}" + (" (upload later with `wandb sync`)" if offline else ""))
    if "tensorboard" in report_to and tensorboard_dir:
        out.append(f"TensorBoard {tensorboard_dir}")
    if "trackio" in report_to:
        out.append("trackio (project logging.wandb_project)")
    if not report_to:
        out.append(f"none (the run's logs are in {run_dir})")
    return out


def machine_ram_gb() -> float | None:
    try:
        import psutil
    except ImportError:
        return None
    return psutil.virtual_memory().total / GB


class PlanBanner(TrainerCallback):
    """Prints the run's `RunView` when training begins, on the main process only, once (not under --quiet).

    `view` is the run's record less what only the started trainer knows (steps, trackers' runs): those it fills in
    from `state` and the trackers at `on_train_begin`, which runs after transformers' tracker callbacks.
    """

    def __init__(self, view: RunView, *, tensorboard_dir: str | None = None):
        self.view, self.tensorboard_dir = view, tensorboard_dir
        self.printed: list[str] | None = None

    def on_train_begin(self, args, state, control, **kwargs: Any):
        if not state.is_world_process_zero or self.printed is not None:
            return
        from dataclasses import replace

        view = replace(
            self.view,
            max_steps=state.max_steps,
            trackers=tuple(tracker_lines(list(args.report_to or []), self.view.run_dir, self.tensorboard_dir)),
        )
        self.printed = view.lines()
        if not quiet():
            print("\n".join(self.printed), flush=True)
