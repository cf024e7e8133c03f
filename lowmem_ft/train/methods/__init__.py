"""Training methods, one module each behind the `Method` protocol, found by name in `REGISTRY`.

The one idea: `FineTune` (`lowmem_ft.train.run`) builds every run the same way — trainer arguments, data, trainer —
and asks the run's `Method` for each method-specific part; no other module of `train` branches on a method's name.
Like TRL's `<method>_trainer.py` + `<method>_config.py` pairs, a method brings its TRL config, its data preparation
and its memory-safe trainer class; adding one is a module here and a line in `REGISTRY`.

- `sft`: supervised fine-tuning on TRL's `SFTTrainer` (`lowmem_ft.train.resilience.trainer.MemorySafeSFTTrainer`).
- `preference`: DPO, ORPO, SimPO and KTO on TRL's trainers, fed pairs (or KTO's labelled completions).
- `grpo`: GRPO on TRL's `GRPOTrainer`; `rewards` beside it holds the reward functions it scores completions with.

The registry names its modules instead of importing them: the method modules import TRL and torch, and
`--method`'s choices (`names`) are read by commands that must stay quick to start.

How a method is planned (rows per sample, its phases, the loss and dropout its trainer fixes) is decided upstream of
training, torch-free: `lowmem_ft.method_planning`, keyed by the same names, over the memory model's
`lowmem_ft.memory.preference` and `lowmem_ft.memory.grpo`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from lowmem_ft.recipe.schema import Recipe
    from lowmem_ft.train.args import Batching

# training.method → the module whose `METHODS` holds it
REGISTRY: dict[str, str] = {
    "sft": "lowmem_ft.train.methods.sft",
    "dpo": "lowmem_ft.train.methods.preference",
    "orpo": "lowmem_ft.train.methods.preference",
    "simpo": "lowmem_ft.train.methods.preference",
    "kto": "lowmem_ft.train.methods.preference",
    "grpo": "lowmem_ft.train.methods.grpo",
}


@dataclass
class MethodData:
    """A method's prepared data: the train and eval datasets (the eval one or None), the data summary run.json
    records, and what its trainer takes beside the common arguments (GRPO: the reward functions; image chats: their
    collator).

    Data that brings more than rows (SFT's image chats, `lowmem_ft.vision`) says here what the run does with it, so
    `FineTune` asks no more of it than of text: the columns its collator reads, the bytes the collator holds (the
    exact CPU measure counts them), a line for the banner, and files saved beside the weights."""

    train: Any
    eval: Any
    summary: dict[str, Any]
    trainer_kwargs: dict[str, Any] = field(default_factory=dict)
    # the trainer's collator (in trainer_kwargs) reads columns beyond the model's inputs: the trainer keeps them
    keeps_columns: bool = False
    # bytes the collator's batches hold beside the model's tensors, for `ExactMemory.pixels_held`; None: none
    held: Callable[[], int] | None = None
    # the data's line on the plan banner (`lowmem_ft.train.observe.banner`: image chats' images per sample and cap)
    banner: str = ""
    # writes what the saved weights need beside them into the staged directory (the processor at the run's cap)
    save_beside: Callable[[Path], None] | None = None


class Method(Protocol):
    """What `FineTune` asks of a training method."""

    name: str
    # the method's own metrics on the progress line (log key → label), `lowmem_ft.train.observe.progress`
    shown: Mapping[str, str]
    # log keys of the method's own figures kept in metrics.json's `method_metrics` (`own_figures`; "x/*": a prefix)
    logged: tuple[str, ...]
    # whether `--verify` can trace the method's step at full size (`lowmem_ft.train.trace.step`)
    traced: bool
    # whether the method scores completions with reward functions (`--reward-fn`)
    takes_rewards: bool
    # whether our chunked loss head answers the model's loss call when memory.chunked_loss is set
    # (`lowmem_ft.train.losses`); False where the trainer computes its loss from its own log-probs (GRPO)
    chunked_loss: bool

    def batching(self, recipe: Recipe) -> Batching:
        """How the method's samples are batched (packing decided from the model's config for SFT)."""
        ...

    def batch_text(self, recipe: Recipe, world_size: int) -> str:
        """What a step's batch is, for the banner, where the method says it (GRPO's round); "" for sequences."""
        ...

    def config(self, sft_args: Any, recipe: Recipe) -> Any:
        """The method's TRL config from the `SFTConfig` `lowmem_ft.train.args` decided for the recipe."""
        ...

    def prepare_data(self, recipe: Recipe, tokenizer: Any, reward_fns: list) -> MethodData:
        """The method's data, read, tokenized and fitted (SFT: image chats too, for a vision-language checkpoint);
        `reward_fns`: the command line's `--reward-fn`."""
        ...

    def trainer(self, recipe: Recipe) -> tuple[type, dict[str, Any]]:
        """The method's memory-safe trainer class and its own keyword arguments."""
        ...


def own_figures(method: Method, logs: Mapping[str, Any]) -> dict[str, Any]:
    """The figures of one log entry that `method.logged` names."""
    prefixes = tuple(k[:-1] for k in method.logged if k.endswith("*"))
    return {k: v for k, v in logs.items() if k in method.logged or (prefixes and k.startswith(prefixes))}


def names() -> tuple[str, ...]:
    """Every training method's name, in the registry's order (`--method`'s choices)."""
    return tuple(REGISTRY)


def get(name: str) -> Method:
    """The method called `name` (its module imported now)."""
    if name not in REGISTRY:
        raise KeyError(f"no training method {name!r}; known: {', '.join(REGISTRY)}")
    return import_module(REGISTRY[name]).METHODS[name]
