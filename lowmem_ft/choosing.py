"""Choosing the recipe a run uses: the tier recipes, a recipe as a memory `Setup`, and a `Plan` applied back.

The one seam between the recipe (`lowmem_ft.recipe`, what the user wrote) and the memory model
(`lowmem_ft.memory`, pure arithmetic that knows no recipe): `choose_recipe` starts from the tier recipe for the
VRAM target (or the user's recipe), maps it to a `Setup`, decides the sequence length from the data's length profile,
lets the planner search, and applies the plan back onto the recipe with `dataclasses.replace`. It returns the
recipe and a typed `Choice` — how the recipe was chosen — which the run directory keeps (`run.json`, `plan.json`).
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from lowmem_ft import calibrated
from lowmem_ft.errors import UserError
from lowmem_ft.memory.estimate import CUDA_CONTEXT_BYTES, GB, Device, Setup, estimate
from lowmem_ft.memory.host import host_over
from lowmem_ft.memory.lengths import longest_length, round_seq_len
from lowmem_ft.memory.planner import Plan, Request, Requested, check, max_seq_len, plan
from lowmem_ft.memory.target import Target
from lowmem_ft.method_planning import planning
from lowmem_ft.recipe.load import merge, resolve, shipped_recipes, to_dict
from lowmem_ft.recipe.schema import KEYS, Recipe
from lowmem_ft.vision.setup import with_images

if TYPE_CHECKING:
    from lowmem_ft.data.profile import LengthProfile

log = logging.getLogger(__name__)

# Recipe key → the planner's name for it (a `Setup` field, or a figure the `Request` / `Plan` carry beside the
# setup), from the keys' declaration (`lowmem_ft.recipe.schema`, `planner=`).
RECIPE_KNOBS = {path: key.planned.name for path, key in KEYS.items() if key.planned is not None}
SETUP_FIELDS = frozenset(f.name for f in fields(Setup))
# What the planner's request and plan carry beside the setup (gradient_accumulation, eval_batch_size): a plan's own
# figure is the one applied back.
BESIDE_SETUP = frozenset(f.name for f in fields(Plan)) & frozenset(f.name for f in fields(Request))


# -- tiers -------------------------------------------------------------------------------------------------------
def tier_recipes() -> dict[float, str]:
    """Shipped tier recipes by their size in GB (`8gb.yaml` → 8.0)."""
    tiers = {}
    for name in shipped_recipes():
        match = re.fullmatch(r"(\d+(?:\.\d+)?)gb", name)
        if match:
            tiers[float(match.group(1))] = name
    return dict(sorted(tiers.items()))


def tier_for_vram(vram_gb: float, strict: bool = True) -> str:
    """The largest shipped tier not above `vram_gb` (the smallest tier when none is and not `strict`)."""
    tiers = tier_recipes()
    fitting = [size for size in tiers if size <= vram_gb]
    if not fitting and not strict:
        return tiers[min(tiers)]
    if not fitting:
        smallest = min(tiers)
        raise UserError(
            f"--vram {vram_gb:g}: no recipe tier fits under {vram_gb:g} GB (smallest is {smallest:g} GB); "
            "pass --recipe FILE with a smaller configuration"
        )
    return tiers[max(fitting)]


def start_recipe(vram_gb: float, recipe: str | None, overrides: dict, origins: dict | None = None) -> Recipe:
    """Where planning starts: `--recipe` if given, else the tier for `vram_gb`, with the overrides applied.

    A tier's storage is only a starting point: a full fine-tune (`adapter.kind=full`) starts from 16-bit weights
    unless the user fixed `model.quantization` too.
    """
    planned_defaults: dict[str, Any] = {}
    full = overrides.get("adapter", {}).get("kind") == "full"
    if recipe is None and full and "quantization" not in overrides.get("model", {}):
        planned_defaults = {"model": {"quantization": "none"}}
    resolved = resolve(recipe or tier_for_vram(vram_gb, strict=False), merge(planned_defaults, overrides), origins)
    return with_saved_adapter(resolved, overrides, origins)


# -- an existing adapter -----------------------------------------------------------------------------------------
# The planner's names of the knobs an adapter loaded from disk fixes: its kind, rank, dropout, target modules, DoRA
# and init (done already).
ADAPTER_KNOBS = frozenset({"adapter", "lora_r", "lora_dropout", "lora_targets", "use_dora", "adapter_init"})


def with_saved_adapter(recipe: Recipe, overrides: dict, origins: dict[str, str] | None = None) -> Recipe:
    """The recipe with the shape of the adapter it continues (`adapter.name_or_path`): that adapter's r, alpha,
    dropout and target modules replace the section's, and its base is the model when none is given. A key the user
    set to another value is an error (the adapter's weights decide it); a base of another name is a warning (the
    shapes are checked against the model before training)."""
    name = recipe.adapter.name_or_path
    if not name:
        return recipe
    from lowmem_ft.adapter import locate

    saved = locate(name)
    origins = origins or {}
    given = overrides.get("adapter", {})
    section = saved.section()
    clashes = [
        f"{origins.get(f'adapter.{key}', '--set')} adapter.{key}={given[key]!r}"
        for key, value in section.items()
        if key in given and given[key] != value
    ]
    if clashes:
        shape = ", ".join(f"{k}={v}" for k, v in section.items())
        raise UserError(f"--adapter {name} has {shape}; {'; '.join(clashes)} contradicts it: drop it")
    model = recipe.model
    if not model.name_or_path and saved.base:
        model = replace(model, name_or_path=saved.base)
        _say_once(logging.INFO, f"model: {saved.base}, the base --adapter {name} was trained on")
    elif model.name_or_path and not saved.same_base(model.name_or_path):
        _say_once(
            logging.WARNING,
            f"--adapter {name} was trained on {saved.base}, not {model.name_or_path}; continuing on "
            f"{model.name_or_path} (its matrices are checked against that model's layers)",
        )
    for note in saved.uncounted:
        _say_once(logging.WARNING, f"--adapter {name} trains {note}, which the memory plan does not count")
    changed = [
        f"{k} {getattr(recipe.adapter, k)!r} → {v!r}" for k, v in section.items() if getattr(recipe.adapter, k) != v
    ]
    if changed:  # the recipe file's values give way to the adapter's: say so
        _say_once(logging.INFO, f"adapter: {', '.join(changed)}, as the adapter {name} has them")
    return replace(recipe, model=model, adapter=replace(recipe.adapter, **section))


_SAID: set[str] = set()


def _say_once(level: int, message: str) -> None:
    """Log a message once per process: a command resolves its recipe more than once (profile, then plan)."""
    if message not in _SAID:
        _SAID.add(message)
        log.log(level, message)


def _check_plannable(arch, model: str, recipe: Recipe, gpus: int = 1) -> None:
    """Refuse what the memory model cannot describe (one line, with the real parameter counts): a mixture of experts
    of a family it does not describe (`MOE_PLANNED`: their blocks were measured, devkit/harness/moe.py), full
    fine-tuning of one (trainable expert stacks are not measured), dense layers among its sparse ones, several
    devices, or a config that keeps every layer's router logits."""
    if not arch.experts:
        return
    head = f"model {model}: a mixture of {arch.experts} experts"
    from lowmem_ft.memory.arch import MOE_PLANNED

    if arch.moe is None:
        raise UserError(
            f"{head} ({arch.model_type}: {arch.total_params / 1e9:.1f}B parameters, of which the memory model counts "
            f"one dense MLP per layer); lowmem-ft plans the mixtures of {', '.join(MOE_PLANNED)} only, so it cannot "
            "plan this one for --vram; train it with --recipe and no --vram, sized yourself"
        )
    if recipe.adapter.kind == "full":
        raise UserError(
            f"{head}: full fine-tuning trains the expert stacks ({arch.total_params / 1e9:.1f}B parameters), whose "
            "memory lowmem-ft has not measured; plan LoRA or QLoRA (--set adapter.kind=lora)"
        )
    if arch.moe.dense_layers:
        raise UserError(
            f"{head}: layers {list(arch.moe.dense_layers[:8])} have a dense MLP among the sparse ones "
            "(decoder_sparse_step / mlp_only_layers), which the memory model does not describe; train it with "
            "--recipe and no --vram, sized yourself"
        )
    if gpus > 1:
        raise UserError(
            f"{head}: lowmem-ft plans a mixture of experts on one device only (the sharded strategies' units do not "
            "count the expert stacks yet); plan it with --gpus 1, or train it with --recipe and no --vram"
        )
    if arch.moe.router_logits_kept:
        raise UserError(
            f"{head}: its config sets output_router_logits, so every layer's router logits and the auxiliary loss "
            "stay in memory, which lowmem-ft does not plan; set output_router_logits to false in config.json"
        )


def _check_adapter_fits(arch, recipe: Recipe) -> None:
    """An adapter whose matrices do not fit the model's layers is one line, before any data or weight is read."""
    if not recipe.adapter.name_or_path:
        return
    from lowmem_ft.adapter import locate

    saved = locate(recipe.adapter.name_or_path)
    misfit = saved.misfit({lin.name: (lin.in_features, lin.out_features) for lin in arch.linears}, arch.num_layers)
    if misfit:
        raise UserError(
            f"--adapter {saved.source} does not fit {recipe.model.name_or_path}: {misfit}; pass the --model it was "
            f"trained on ({saved.base or 'see its adapter_config.json'})"
        )


def _adapter_reason(p: Plan, recipe: Recipe, origins: dict[str, str] | None) -> Plan:
    """The plan's adapter line names the adapter it counts when one is loaded."""
    a = recipe.adapter
    if not a.name_or_path:
        return p
    where = (origins or {}).get("adapter.name_or_path", "adapter.name_or_path")
    why = f"lora, rank {a.r} on {', '.join(a.target_modules)}: the adapter loaded from {where} {a.name_or_path}"
    return replace(p, reasons={**p.reasons, "adapter": why})


# -- recipe ⇄ setup ----------------------------------------------------------------------------------------------
def planner_values(recipe: Recipe) -> dict[str, Any]:
    """Each key that feeds the planner, as the planner names and spells it; of two keys feeding one knob (chunked_loss,
    full_logits_loss → loss_impl), the one off its default gives it (a recipe with both on is refused)."""
    values: dict[str, Any] = {}
    for key, p in ((k, k.planned) for k in KEYS.values() if k.planned is not None):
        if p.name not in values or p.to_planner(key.of(recipe)) != p.to_planner(key.default):
            values[p.name] = p.to_planner(key.of(recipe))
    return values


def setup_from_recipe(recipe: Recipe, device: Device = "cuda") -> Setup:
    """The memory-relevant knobs of a `Recipe`: every `Setup` field a recipe key feeds is filled from the recipe, so
    the schema's defaults are the planner's too (`Setup`'s own defaults never reach a plan)."""
    from lowmem_ft.cuda_alloc import run_setting

    values = planner_values(recipe)
    chosen = {name: value for name, value in values.items() if name in SETUP_FIELDS}
    return Setup(**chosen, device=device, allocator=run_setting())  # the allocator `train` would set up here


def request_for(recipe: Recipe, target: Target, **kw: Any) -> Request:
    """The planner's request starting from `recipe`: its setup, and the figures the request carries beside it."""
    beside = {name: value for name, value in planner_values(recipe).items() if name in BESIDE_SETUP}
    method = planning(recipe.training.method)  # the planner speaks rows: 2 per pair (lowmem_ft.method_planning)
    start = method.setup(setup_from_recipe(recipe))
    if method.trainer_loss:
        # the method's trainer computes its own loss (TRL's fused head for DPO and GRPO, full logits for ORPO /
        # SimPO): the planner must not swap in the chunked loss, which these runs have not been checked with
        kw["fixed"] = frozenset(kw.get("fixed", frozenset())) | {"loss_impl"}
        kw["loss_by"] = method.name
    return Request(start, target, **beside, **kw, **method.request(recipe))


def grpo_shape(recipe: Recipe, prompt_len: int = 0):
    """A GRPO recipe's round (`memory.grpo.GrpoShape`): P is the data's longest prompt when known, else
    grpo.max_prompt_length."""
    from lowmem_ft.memory.grpo import GrpoShape

    g = recipe.grpo
    return GrpoShape(
        prompt_len=prompt_len or g.max_prompt_length or recipe.memory.max_seq_len,
        completion_len=g.max_completion_length,
        num_generations=g.num_generations,
        steps_per_generation=g.steps_per_generation or None,
        beta=g.beta,
    )


def fixed_knobs(overrides: dict[str, Any]) -> frozenset[str]:
    """The planner's names of the recipe keys the user set (`--set`, flags): the knobs it must not change."""
    given = {f"{section}.{key}" for section, values in overrides.items() if isinstance(values, dict) for key in values}
    return frozenset(name for key, name in RECIPE_KNOBS.items() if key in given)


def apply_plan(recipe: Recipe, p: Plan) -> Recipe:
    """The recipe with the plan's knobs: every key that feeds the planner takes the plan's value back (a knob the
    planner left alone comes back as it went in)."""
    sections: dict[str, dict[str, Any]] = {}
    for key in KEYS.values():
        if key.planned is not None:
            name = key.planned.name
            value = getattr(p, name) if name in BESIDE_SETUP else getattr(p.setup, name)
            if name in ("micro_batch_size", "lora_dropout", "loss_impl"):
                value = _method_value(recipe, name, value)
            sections.setdefault(key.section, {})[key.name] = key.planned.from_planner(value)
    return replace(recipe, **{section: replace(getattr(recipe, section), **v) for section, v in sections.items()})


def _method_value(recipe: Recipe, name: str, planned: Any) -> Any:
    """A planned knob back in the recipe's terms: rows → the method's samples (a pair is two rows; one row holds no
    pair), and the dropout and loss a method's trainer fixes (`method_planning`) left as given."""
    method = planning(recipe.training.method)
    if name != "micro_batch_size":
        return getattr(setup_from_recipe(recipe), name) if method.trainer_loss else planned
    if planned < method.rows_per_sample:  # the planner searches whole pairs: only a micro batch the user fixed
        raise UserError(
            f"--method {method.name}: one pair (2 rows: chosen and rejected) does not fit the budget; "
            "lower --seq-len, or a larger --vram"
        )
    return method.samples(planned)


# -- the record of the choice -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Choice:
    """How a run's recipe was chosen: `plan` (for --vram, from the tier `recipe`), `recipe` (as given, checked
    against --vram when there is one) or `resume` (the run's own recipe.yaml, with the original plan's figures).

    `plan` is the full plan (for plan.json) where one was made in this process; the other fields are what the run
    needs from it and what run.json keeps, so a resumed run has them too.
    """

    how: Literal["plan", "recipe", "resume"]
    recipe: str
    model: str = ""
    target: Target | None = None
    predicted_peak_gb: float | None = None
    fits: bool | None = None
    strategy: str = "single"
    offload: bool = False
    reasons: dict[str, str] = field(default_factory=dict)
    plan: Plan | None = field(default=None, compare=False)

    @classmethod
    def of_plan(cls, how: Literal["plan", "recipe"], recipe: str, model: str, p: Plan) -> Choice:
        return cls(how, recipe, model, p.target, round(p.estimate.peak_gb, 3), p.fits, p.strategy, p.offload,
                   dict(p.reasons), p)  # fmt: skip

    def resumed(self, recipe: str) -> Choice:
        return replace(self, how="resume", recipe=recipe, plan=None)

    def to_dict(self) -> dict[str, Any]:
        """The `choice` of run.json; `budget_gb` = vram − margin, as everywhere."""
        target = self.target.to_dict() if self.target is not None else {"vram_gb": None}
        return {"how": self.how, "recipe": self.recipe, "model": self.model, **target,
                "predicted_peak_gb": self.predicted_peak_gb, "fits": self.fits, "strategy": self.strategy,
                "offload": self.offload, "reasons": dict(self.reasons)}  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Choice:
        """The record run.json keeps; a ValueError / TypeError when its figures are not what a run wrote."""
        target, peak = Target.from_dict(data), data.get("predicted_peak_gb")
        if target is not None and not (math.isfinite(target.vram_gb) and target.vram_gb > target.margin_gb >= 0):
            raise ValueError(f"vram_gb {target.vram_gb} with safety_margin_gb {target.margin_gb} is no memory target")
        if peak is not None and (isinstance(peak, bool) or not isinstance(peak, (int, float))):
            raise ValueError(f"predicted_peak_gb {peak!r} is not a number")
        return cls(
            how=data.get("how", "recipe"),
            recipe=str(data.get("recipe", "")),
            model=str(data.get("model", "")),
            target=target,
            predicted_peak_gb=peak,
            fits=data.get("fits"),
            strategy=data.get("strategy") or "single",
            offload=bool(data.get("offload")),
            reasons=dict(data.get("reasons") or {}),
        )

    def plan_record(self, recipe: Recipe) -> dict[str, Any] | None:
        """plan.json and `plan --json`: the model, the full plan, and the recipe it gives."""
        if self.plan is None:
            return None
        out = {"model": self.model, "how": self.how, "from": self.recipe, **self.plan.to_dict(),
               "recipe": to_dict(recipe)}  # fmt: skip
        if "generation" in self.plan.estimate.phases:  # GRPO: each phase's peak (`memory.grpo_plan`)
            from lowmem_ft.memory.grpo_plan import phases_gb

            out["phases_gb"] = phases_gb(self.plan.estimate)
        return out


# -- the target and the length ----------------------------------------------------------------------------------
def target_for(vram_gb: float, recipe: Recipe, gpus: int = 1, nodes: int = 1) -> Target:
    """The memory target of `--vram` for `recipe`: a finite VRAM above the safety margin the recipe keeps free."""
    margin = recipe.memory.safety_margin_gb
    if not math.isfinite(vram_gb):
        raise UserError(f"--vram {vram_gb:g}: not a finite number of GB")
    if vram_gb <= margin:
        smallest = margin + CUDA_CONTEXT_BYTES / GB
        raise UserError(
            f"--vram {vram_gb:g}: not above the recipe's {margin:g} GB safety margin (memory.safety_margin_gb), so "
            f"nothing is left to train in; the smallest sensible --vram is {smallest:g} (margin + "
            f"{CUDA_CONTEXT_BYTES / GB:g} GB CUDA context)"
        )
    added, said = calibrated.for_this_device()  # this GPU's calibration: only ever added to the margin
    return Target(vram_gb, margin, gpus, checked_host_ram_gb(recipe), recipe.memory.host_margin_gb, nodes, added, said)


def checked_host_ram_gb(recipe: Recipe) -> float:
    """`host_ram_gb`, refused in one line when it is not above `memory.host_margin_gb` (what the process itself keeps
    free): no plan can keep anything on such a host, and a negative budget says nothing useful."""
    ram, margin = host_ram_gb(recipe), recipe.memory.host_margin_gb
    if ram <= margin:
        given = recipe.memory.host_ram_gb
        where = f"--host-ram {given:g}" if given else f"this machine's {ram:.1f} GB of available RAM"
        raise UserError(
            f"{where}: not above the {margin:g} GB host margin (memory.host_margin_gb) the process itself needs, so "
            f"nothing is left for the run on the host; give --host-ram above {margin:g}, or lower "
            "memory.host_margin_gb"
        )
    return ram


def host_ram_gb(recipe: Recipe) -> float:
    """The host RAM a plan may use: `memory.host_ram_gb` (`--host-ram`) when set, else what this machine has
    available now."""
    return recipe.memory.host_ram_gb or detected_host_ram_gb()


def detected_host_ram_gb() -> float:
    """What this machine has available now, in GB: psutil's `available` (free memory plus what the kernel can
    reclaim without swapping)."""
    import psutil

    return psutil.virtual_memory().available / GB


def origin_of(path: str, overrides: dict, origins: dict[str, str] | None) -> str | None:
    """Who set recipe key `path`: its flag (`origins`), "--set", or None (the recipe file, or the defaults)."""
    section, _, name = path.partition(".")
    if (origins or {}).get(path):
        return origins[path]
    return "--set" if isinstance(overrides.get(section), dict) and name in overrides[section] else None


def asked(path: str, value: Any, origin: str | None, recipe: str | None) -> str:
    """Where the value of recipe key `path` was asked, as the user wrote it — `--seq-len 4096`,
    `--set memory.max_seq_len=4096` or `recipe 8gb` (`origin` as `origin_of` says): the one wording of it."""
    if origin == "--set":
        return f"--set {path}={value}"
    return f"{origin} {value}" if origin else f"recipe {recipe}"


def check_positions(length: int, positions: int, model: str, asked: str) -> None:
    """A max_seq_len the user asked for (`asked` says where) within the model's positions, when they are known."""
    if positions and length > positions:
        raise UserError(
            f"{asked}: max_seq_len {length} is beyond the {positions} positions of {model} "
            f"(max_position_embeddings in its config); use {positions} or less"
        )


def model_positions(name_or_path: str) -> int:
    """The model's max_position_embeddings from a local config.json or the offline catalog; 0 when unknown without
    asking the Hub."""
    from lowmem_ft.memory.arch import Architecture, catalog_entry, load_config_dict

    if not name_or_path or not (Path(name_or_path).is_dir() or catalog_entry(name_or_path)):
        return 0
    config, _ = load_config_dict(name_or_path)
    return Architecture.from_config(config, name=name_or_path).max_position_embeddings


def _length(
    arch, recipe: Recipe, fixed: frozenset[str], seq_len: int | None, profile, asked_by: str = "--set"
) -> tuple[int, str, bool]:
    """(max_seq_len to plan for, why, whether it came from the data and may be shortened to fit), within the model's
    positions: a length the user asked for beyond them is an error naming the limit; the data's or the tier
    recipe's is capped there (longer samples follow data.truncate), and the reason says so."""
    length, positions = recipe.memory.max_seq_len, arch.max_position_embeddings
    cap = round_seq_len(positions, up=False) if positions else 0
    if seq_len or "max_seq_len" in fixed:
        flag = "--seq-len" if seq_len else asked_by  # the flag that fixed it (`origins`), else --set
        check_positions(length, positions, arch.name or "the model", asked("memory.max_seq_len", length, flag, None))
        return length, f"{length} tokens, as {flag} asked", False
    if profile is not None and profile.p99 > 0:
        wanted = round_seq_len(profile.p99)
        if cap and wanted > cap:
            samples, tokens = profile.over(cap)
            why = (
                f"{cap} tokens: the model's {positions} positions (max_position_embeddings; p99 {profile.p99} is "
                f"beyond them); {samples} samples longer, {tokens} tokens beyond it (data.truncate={recipe.data.truncate})"
            )
            return cap, why, True
        covers = "every sample" if profile.max and wanted >= profile.max else "99 % of samples (longer ones truncate)"
        return wanted, f"{wanted} tokens covers {covers} (p99 {profile.p99}, max {profile.max})", True
    if cap and length > cap:
        return cap, f"{cap} tokens: the recipe's {length} capped at the model's {positions} positions", False
    return length, f"{length} tokens from the recipe", False


# -- host memory -------------------------------------------------------------------------------------------------
def with_host_ram(arch, p: Plan) -> Plan:
    """The plan with a `host_ram` reason line when its setup keeps memory on the host (offloaded layer inputs are
    pinned: they cannot be swapped out; host embeddings, paged and offloaded states): how much, against the host
    budget. A plan over it does not fit (`Plan.host_fits`); its line then says what would: the longest length
    whose host need fits, or the RAM this one needs."""
    t = p.target
    parts = ", ".join(f"{c.name} {c.gb:.2f}" for c in p.estimate.components if c.phase == "host" and c.bytes > 0)
    paged_only = all(c.name.startswith("paged") for c in p.estimate.components if c.phase == "host" and c.bytes > 0)
    if not parts or (paged_only and p.host_fits):
        return p  # bnb's paged states live on the device until evicted: counted, but no line of their own
    per = f" ({t.node_gpus} processes)" if t.node_gpus > 1 else ""
    budget = f"{t.host_budget_gb:.1f} GB host budget (RAM {t.host_ram_gb:.1f} − margin {t.host_margin_gb:g})"
    if p.host_fits:
        why = f"{p.host_need_gb:.1f} GB{per} ({parts}) of the {budget}"
    else:
        ram = math.ceil(p.host_need_gb + t.host_margin_gb)
        instead = [f"--host-ram {ram} (a machine with {ram} GB available)"]
        fit = _longest_host_fit(arch, p)
        if fit:
            instead.insert(0, f"--seq-len {fit}")
        why = f"{host_over(p.estimate, t)}; what fits: {' or '.join(instead)}"
    return replace(p, reasons={**p.reasons, "host_ram": why})


def _longest_host_fit(arch, p: Plan) -> int:
    """The longest max_seq_len below the plan's at which its setup's host need fits the host budget, else 0."""
    from lowmem_ft.memory.host import host_need_gb
    from lowmem_ft.memory.sharding import per_device_estimate

    def fits(length: int) -> bool:
        s = replace(p.setup, max_seq_len=length)
        est = per_device_estimate(arch, s, p.gpus, p.strategy, p.offload)[0] if p.gpus > 1 else estimate(arch, s)
        return host_need_gb(est, p.target.node_gpus) <= p.target.host_budget_gb

    return longest_length(fits, p.setup.max_seq_len - 1)


# -- choosing ----------------------------------------------------------------------------------------------------


def plan_setup(
    arch,
    recipe: Recipe,
    target: Target,
    fixed: frozenset[str],
    *,
    seq_len: int | None = None,
    profile: LengthProfile | None = None,
    strategy: Requested = "auto",
    offload: bool | None = None,
    origins: dict[str, str] | None = None,
) -> Plan:
    """The planner's answer for `recipe` as the start. When the data's p99 length (our own choice) does not fit, the
    longest length that does: longer samples then follow `data.truncate`, and the reason line says how many that
    cuts. `origins` names the flag that fixed a length (`--seq-len`), for the reason line."""
    asked_by = (origins or {}).get("memory.max_seq_len", "--set")
    length, why, from_data = _length(arch, recipe, fixed, seq_len, profile, asked_by)
    request = request_for(recipe, target, fixed=fixed, strategy=strategy, offload=offload, length_reason=why)
    request = with_images(arch, recipe, profile, replace(request, start=replace(request.start, max_seq_len=length)))
    try:
        return plan(arch, request)
    except UserError:
        # a length the user did not fix is lowered until the step fits: the data's p99, or for a preference run
        # (one pair is 2 rows, with the reference pass) the recipe's own length too
        lowers = planning(recipe.training.method).lowers_length
        lowerable = from_data or (lowers and "max_seq_len" not in fixed and not seq_len)
        fit = max_seq_len(arch, request, limit=length) if lowerable else 0
        if not fit:
            raise
    if from_data:
        samples, tokens = profile.over(fit)
        why = (
            f"{fit} tokens: the longest that fits (p99 {profile.p99} does not); {samples} samples longer, {tokens} "
            f"tokens beyond it (data.truncate={recipe.data.truncate})"
        )
    else:
        from lowmem_ft.memory.preference import lowered_length_reason

        why = lowered_length_reason(recipe.training.method, fit, length)  # type: ignore[arg-type]
    return plan(arch, replace(request, start=replace(request.start, max_seq_len=fit), length_reason=why))


def choose_recipe(
    *,
    vram_gb: float | None,
    recipe: str | None,
    overrides: dict,
    origins: dict[str, str] | None = None,
    seq_len: int | None = None,
    profile: LengthProfile | None = None,
    gpus: int = 1,
    strategy: Requested = "auto",
    offload: bool | None = None,
    nodes: int = 1,
) -> tuple[Recipe, Choice]:
    """The recipe a run uses and a record of why: `--recipe` as given (checked against --vram when there is one),
    else planned for `--vram` from the tier recipe.

    `overrides` (from `--set` and flags such as `--model`) always win over the file and are never changed by the
    planner; `origins` names the flag behind an override key, for error messages. `seq_len` (plan --seq-len) fixes
    `memory.max_seq_len`; otherwise, with `profile`, the planner sizes it from the data. With `gpus` > 1 the plan's
    figures are per device and its `strategy` / `offload` say how the run is sharded; `gpus` counts them all, over
    `nodes` machines (host RAM is per machine).
    """
    chosen, choice = _choose_recipe(vram_gb, recipe, overrides, origins, seq_len, profile, gpus, strategy, offload,
                                    nodes)  # fmt: skip
    check_method_rules(chosen, gpus, overrides, origins, recipe)
    return chosen, choice


def check_method_rules(
    r: Recipe, processes: int, overrides: dict | None, origins: dict[str, str] | None, recipe: str | None
) -> None:
    """The training method's own rules on the recipe a run uses, before any weight is read or any rank launched
    (`plan` and `train` both choose through here): KTO's micro batch (`memory.preference.micro_batch_problem`),
    GRPO's whole prompt groups per round (`memory.grpo_plan.round_problem`). The planner's choices meet them; a
    value the user fixed (a recipe, --set) may not, and is refused in one line naming where it was set."""
    method, m, overrides = r.training.method, r.memory, overrides or {}
    planned = planning(method)
    if not planned.rounds and not planned.preference_step:  # SFT: no rule of its own
        return
    mb = m.micro_batch_size
    where = asked("memory.micro_batch_size", mb, origin_of("memory.micro_batch_size", overrides, origins), recipe)
    if planned.rounds:
        from lowmem_ft.memory.grpo_plan import round_problem

        problem = round_problem(mb, r.grpo.steps_per_generation, m.gradient_accumulation, processes,
                                r.grpo.num_generations)  # fmt: skip
    else:
        from lowmem_ft.memory.preference import micro_batch_problem

        problem = micro_batch_problem(method, mb, where)
    if problem:
        raise UserError(problem)


def _choose_recipe(vram_gb, recipe, overrides, origins, seq_len, profile, gpus, strategy, offload, nodes):
    if recipe is None and vram_gb is None:
        raise UserError("say how much GPU memory to fit: --vram GB (e.g. --vram 24), or give --recipe NAME_OR_FILE")
    if seq_len:
        overrides = merge(overrides, {"memory": {"max_seq_len": seq_len}})
        origins = {**(origins or {}), "memory.max_seq_len": "--seq-len"}
    if vram_gb is None:
        resolved = with_saved_adapter(resolve(recipe, overrides, origins), overrides, origins)
        return resolved, Choice("recipe", str(recipe), resolved.model.name_or_path)
    start = start_recipe(vram_gb, recipe, overrides, origins)
    if not start.model.name_or_path:
        raise UserError("no model given; pass --model HUB_ID_OR_PATH")
    from lowmem_ft.memory.arch import load_architecture

    target = target_for(vram_gb, start, gpus, nodes)
    arch = load_architecture(start.model.name_or_path, start.model.trust_remote_code)
    _check_plannable(arch, start.model.name_or_path, start, target.gpus)
    _check_adapter_fits(arch, start)
    model = start.model.name_or_path
    if recipe is not None:
        length = start.memory.max_seq_len
        where = asked("memory.max_seq_len", length, origin_of("memory.max_seq_len", overrides, origins), recipe)
        check_positions(length, arch.max_position_embeddings, model, where)
        request = with_images(arch, start, profile, request_for(start, target, strategy=strategy, offload=offload))
        # a recipe as given may be predicted not to fit: `plan` refuses it, `train` warns and lets the guard step down
        checked = with_host_ram(arch, _adapter_reason(check(arch, request), start, origins))
        return start, Choice.of_plan("recipe", str(recipe), model, checked)
    if planning(start.training.method).rounds:
        return _choose_grpo(arch, start, target, recipe, overrides, profile, strategy, offload, vram_gb)
    fixed = fixed_knobs(overrides) | (ADAPTER_KNOBS if start.adapter.name_or_path else frozenset())
    planned = plan_setup(
        arch, start, target, fixed, seq_len=seq_len, profile=profile, strategy=strategy, offload=offload,
        origins=origins,
    )  # fmt: skip
    planned = with_host_ram(arch, _adapter_reason(planned, start, origins))
    return apply_plan(start, planned), Choice.of_plan("plan", tier_for_vram(vram_gb, strict=False), model, planned)


# The grpo keys the GRPO planner may change unless the user set them (`lowmem_ft.memory.grpo_plan`)
GRPO_KNOBS = ("steps_per_generation", "max_completion_length", "num_generations")


def _choose_grpo(arch, start: Recipe, target: Target, recipe: str | None, overrides: dict, profile,
                 strategy: Requested, offload: bool | None, vram_gb: float) -> tuple[Recipe, Choice]:  # fmt: skip
    """A GRPO run's recipe for --vram: the round planned phase by phase (`memory.grpo_plan`), P being the data's
    longest prompt within grpo.max_prompt_length; a recipe as given is checked the same way."""
    from lowmem_ft.memory.grpo_plan import grpo_estimate, plan_grpo

    g, longest = start.grpo, profile.max if profile is not None else 0
    prompt_len = min(longest, g.max_prompt_length) if longest and g.max_prompt_length else longest
    shape = grpo_shape(start, prompt_len)
    why = f"P {shape.prompt_len} + C {shape.completion_len} tokens: the longest prompt and completion"
    model = start.model.name_or_path
    if recipe is not None:
        request = request_for(start, target, strategy=strategy, offload=offload, length_reason=why)
        request = replace(request, start=replace(request.start, max_seq_len=shape.prompt_len + shape.completion_len))
        checked = check(arch, request)
        checked = replace(checked, estimate=grpo_estimate(arch, checked.setup, shape))
        return start, Choice.of_plan("recipe", str(recipe), model, checked)
    given = overrides.get("grpo", {}) if isinstance(overrides.get("grpo"), dict) else {}
    fixed = fixed_knobs(overrides) | {k for k in GRPO_KNOBS if k in given}
    request = request_for(start, target, fixed=fixed, strategy=strategy, offload=offload, length_reason=why)
    planned, chosen = plan_grpo(arch, request, shape, fixed)
    out = apply_plan(start, planned)
    grpo = replace(out.grpo, steps_per_generation=chosen.steps_per_generation or 0,
                   max_completion_length=chosen.completion_len, num_generations=chosen.num_generations)  # fmt: skip
    return replace(out, grpo=grpo), Choice.of_plan("plan", tier_for_vram(vram_gb, strict=False), model, planned)
