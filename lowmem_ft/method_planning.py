"""How each training method is planned: one `MethodPlanning` record per `training.method`, read by the choosing path
(`lowmem_ft.choosing`), `plan`'s printout and the CPU yardstick (`lowmem_ft.train.measure.exact`). What a method
takes from the recipe (its data format, a reference) is the recipe's `lowmem_ft.recipe.schema.MethodInputs`.

The one idea: the planner speaks one language — rows of a `Setup`, SFT's loss unless told otherwise — and a method
is a translation into it and back: its recipe samples as planner rows (a preference pair is two rows), the knobs its
TRL trainer fixes (no dropout, its own loss) kept as the recipe has them, the length lowered until one sample fits
where the user did not fix it, and GRPO's round planned phase by phase (`lowmem_ft.memory.grpo_plan`). The memory
each method adds is the memory model's (`lowmem_ft.memory.preference`, `lowmem_ft.memory.grpo`); training a method
is `lowmem_ft.train.methods`. Like those, this registry is keyed by the recipe's method names (a test keeps them equal).

Pure arithmetic over the recipe: no torch (`plan` stays instant).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lowmem_ft.memory.records import Setup


def _grpo_lines(result, r) -> list[str]:
    """A GRPO step's phases, each one's predicted peak, the largest marked (`lowmem_ft.memory.grpo_plan`)."""
    from lowmem_ft.memory.grpo_plan import phase_lines

    g = r.grpo
    rows = r.memory.micro_batch_size * (g.steps_per_generation or r.memory.gradient_accumulation)
    head = (
        f"GRPO phases (a round of {rows} completions, {g.num_generations} per prompt, up to "
        f"{g.max_completion_length} tokens each):"
    )
    return [head, *(f"  {line}" for line in phase_lines(result.estimate))]


def _preference_lines(result, r) -> list[str]:
    """The preference run's rows and reference strategy, with why (`lowmem_ft.memory.preference`)."""
    from lowmem_ft.memory.arch import load_architecture
    from lowmem_ft.memory.preference import plan_lines

    arch = load_architecture(r.model.name_or_path, r.model.trust_remote_code)
    return plan_lines(
        arch, result.estimate.setup, r.training.method, given=r.preference.reference,
        budget_bytes=result.budget_gb * 1e9, policy_peak_bytes=result.estimate.peak_bytes,
    )  # fmt: skip


@dataclass(frozen=True)
class MethodPlanning:
    """What planning `name` does beyond SFT's planning."""

    name: str
    # the method's setup from the recipe's: rows stacked, the dropout and loss its trainer fixes
    setup: Callable[[Setup], Setup] = lambda s: s
    rows_per_sample: int = 1  # planner rows per recipe sample: a pair is 2 (chosen, rejected)
    # its TRL trainer computes the loss and sets the dropout: loss_impl and lora_dropout are kept as the recipe has
    # them, and the reason line says whose loss it is
    trainer_loss: bool = False
    # a length the user did not fix is lowered until one sample (with its reference pass) fits
    lowers_length: bool = False
    # planned round by round: generation, scoring and training phases (`lowmem_ft.memory.grpo_plan`)
    rounds: bool = False
    # a step's phases are a preference step's: SFT's at the rows it runs, plus its reference pass and loss
    # (`lowmem_ft.memory.preference.phase_peak`)
    preference_step: bool = False
    # the planner's request keys beyond SFT's: the preference method and its reference
    request: Callable[[Any], dict[str, Any]] = lambda recipe: {}
    # what `plan` prints of the method beside the table, from the plan and the recipe
    lines: Callable[[Any, Any], list[str]] = lambda plan, recipe: []

    def samples(self, rows: int) -> int:
        """A planned micro batch of `rows` as the recipe's samples (pairs for a paired method)."""
        return rows // self.rows_per_sample


def _preference(name: str) -> MethodPlanning:
    from lowmem_ft.memory import preference

    return MethodPlanning(
        name,
        setup=lambda s: preference.method_setup(name, s),  # type: ignore[arg-type]
        rows_per_sample=preference.rows_per_micro_batch(name, 1),  # type: ignore[arg-type]
        trainer_loss=True,
        lowers_length=True,
        preference_step=True,
        request=lambda recipe: {"method": name, "reference": recipe.preference.reference},
        lines=_preference_lines,
    )


def _grpo() -> MethodPlanning:
    from lowmem_ft.memory import grpo

    # b completions per micro-step; TRL's own loss from its log-probs, no dropout
    return MethodPlanning("grpo", setup=grpo.method_setup, trainer_loss=True, rounds=True, lines=_grpo_lines)


PLANNING: dict[str, MethodPlanning] = {
    "sft": MethodPlanning("sft"),
    **{name: _preference(name) for name in ("dpo", "orpo", "simpo", "kto")},
    "grpo": _grpo(),
}


def planning(method: str) -> MethodPlanning:
    """The planning record of `training.method`."""
    return PLANNING[method]
