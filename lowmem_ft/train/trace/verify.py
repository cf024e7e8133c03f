"""`--verify`: the chosen recipe's training step traced at full size (`lowmem_ft.train.trace.step`), beside the memory
model's prediction of the same phases, and what the planner does when the trace does not fit.

The trace counts live tensor bytes on the CPU, so it is compared with the memory model's CPU form of the same
setup (`phase_peak_bytes`, no device overheads): the two differ only where the memory model misses something the
installed libraries do. What the trace cannot see — the CUDA context, cuBLAS workspaces, the caching allocator's
rounding, and which tensors a CUDA run keeps in host memory (offloaded layer inputs, paged states) — stays the plan's:
whether the plan still fits is decided on the plan's peak corrected by what the trace found
(`plan peak + traced peak − predicted peak`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lowmem_ft.memory.arch import Architecture
from lowmem_ft.memory.estimate import GB, phase_peak_bytes
from lowmem_ft.recipe.schema import Recipe

PHASES = ("static", "forward", "backward", "optimizer step", "eval")


@dataclass
class Verification:
    """Traced and predicted bytes per phase (CPU form), the trace's wall time, and the plan's device overheads."""

    traced: dict[str, int]
    predicted: dict[str, float]
    seconds: float
    plan_peak: float | None = None  # the plan's (device) peak, bytes
    how: str = "traced whole"  # or from which depths it was extrapolated (`Trace.how`)
    notes: list[str] = field(default_factory=list)

    @property
    def traced_peak(self) -> int:
        return max(self.traced.values())

    @property
    def predicted_peak(self) -> float:
        return max(self.predicted.values())

    @property
    def error(self) -> float:
        """(predicted − traced) / traced of the peaks."""
        return (self.predicted_peak - self.traced_peak) / self.traced_peak

    @property
    def device_peak(self) -> float:
        """The plan's peak corrected by the trace (plus what the memory model missed, minus what it overcounted):
        what the plan's budget is compared with."""
        base = self.plan_peak if self.plan_peak is not None else self.predicted_peak
        return base + self.traced_peak - self.predicted_peak

    def lines(self) -> list[str]:
        out = []
        for phase in PHASES:
            if phase in self.traced:
                t, p = self.traced[phase], self.predicted[phase]
                out.append(f"  {phase:15} traced {t / GB:7.2f} GB  predicted {p / GB:7.2f} GB  ({(p - t) / t:+.1%})")
        out.append(
            f"traced {self.traced_peak / GB:.2f} GB, predicted {self.predicted_peak / GB:.2f} GB ({self.error:+.1%}) "
            f"— live tensor bytes on the CPU, installed library versions; {self.how} in {self.seconds:.0f} s"
        )
        out.extend(f"note: {note}" for note in self.notes)
        return out


def verify(recipe: Recipe, arch: Architecture, plan_peak_bytes: float | None = None, plan=None) -> Verification:
    """Trace `recipe`'s step (with an evaluation forward at its eval batch) and predict the same phases; a plan
    for several devices (`plan.gpus` > 1): one rank's step (`lowmem_ft.train.trace.sharded`)."""
    from lowmem_ft.train.args import eval_batch_size
    from lowmem_ft.train.trace.step import trace

    if plan is not None and plan.gpus > 1:
        from lowmem_ft.train.trace.sharded import traced_rank

        rank, predicted, how, notes = traced_rank(recipe, arch, plan)
        return Verification(rank.phases, predicted, rank.seconds, plan_peak_bytes, how=how, notes=notes)
    result = trace(recipe, eval_rows=eval_batch_size(recipe))
    predicted = predict(recipe, arch)
    notes = []
    if result.images is not None:  # the plan priced this many patches a sample: the trace must have fed them
        priced = image_patches(recipe, arch)
        if priced != result.images.patches:
            notes.append(f"the plan priced {priced} image patches a sample, the traced sample had "
                         f"{result.images.patches}")  # fmt: skip
    return Verification(result.phases, predicted, result.seconds, plan_peak_bytes, how=result.how(), notes=notes)


def image_patches(recipe: Recipe, arch: Architecture) -> int:
    """The image patches of one sample the plan priced (`lowmem_ft.vision.setup.plan_patches`: the data's most at
    the recipe's resolution cap, else one image as large as the cap allows); 0 for a text step."""
    from lowmem_ft.vision.setup import plan_patches, run_profile, vision_of

    if arch.vision is None or vision_of(recipe) is None:
        return 0
    return plan_patches(arch, recipe, run_profile(recipe) if recipe.data.path else None)


def predict(recipe: Recipe, arch: Architecture) -> dict[str, float]:
    """The memory model's CPU form of the phases `verify` traces (eval at the recipe's eval batch; none for an
    image step, whose run evaluates nothing)."""
    from dataclasses import replace

    from lowmem_ft.choosing import setup_from_recipe
    from lowmem_ft.train.args import eval_batch_size

    # on the CPU nothing is offloaded (`lowmem_ft.train.model._offload`: no accelerator), in the trace as in a CPU run
    s = replace(setup_from_recipe(recipe, device="cpu"), activation_offloading=False)
    patches = image_patches(recipe, arch)
    if patches:
        # the image step the plan priced; its micro batches are all full (the tower runs in each), and the traced
        # step holds two at a time, the running one and the loader's next (`step.run_step`): a window of one
        s = replace(s, image_patches=patches, gradient_accumulation=1)
        return {p: phase_peak_bytes(arch, s, p) for p in PHASES if p != "eval"}
    predicted = {p: phase_peak_bytes(arch, s, p) for p in PHASES if p != "eval"}
    predicted["eval"] = phase_peak_bytes(arch, replace(s, micro_batch_size=eval_batch_size(recipe)), "eval")
    return predicted


def margin_override(margin_gb: float) -> dict:
    """The recipe keys of a step down: a safety margin raised by the trace's excess."""
    return {"memory": {"safety_margin_gb": round(margin_gb, 2)}}


def verified(recipe: Recipe, choice, plan_again, say, tries: int = 3):
    """Trace the plan `choice` made for `recipe`; while the traced peak (with the plan's device overheads) is over
    the budget, step down — plan again with the safety margin raised by the excess (`plan_again(margin_gb)` →
    (recipe, choice)) — and say so. Returns (recipe, choice, verification) of the last plan traced."""
    from lowmem_ft.memory.arch import load_architecture

    arch = load_architecture(recipe.model.name_or_path, recipe.model.trust_remote_code)
    for attempt in range(tries):
        plan = choice.plan
        result = verify(recipe, arch, plan.estimate.peak_bytes if plan is not None else None, plan)
        for line in result.lines():
            say(line)
        if plan is None or result.device_peak <= plan.budget_gb * GB or attempt == tries - 1:
            if plan is not None and result.device_peak > plan.budget_gb * GB:
                say(f"the trace is still over the budget after {tries} plans; lower --vram's demands (--seq-len)")
            return recipe, choice, result
        excess = (result.device_peak - plan.budget_gb * GB) / GB
        margin = plan.margin_gb + excess + 0.05  # a little more than the excess: the next plan lands below it
        say(
            f"the trace puts the plan's peak at {result.device_peak / GB:.2f} GB (predicted {plan.estimate.peak_gb:.2f}), "
            f"over the budget of {plan.budget_gb:.2f} GB by {excess:.2f} GB: stepping down (planning again with a "
            f"safety margin of {margin:.2f} GB)"
        )
        recipe, choice = plan_again(margin)
    return recipe, choice, result
