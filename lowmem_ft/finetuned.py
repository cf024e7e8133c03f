"""A finished run directory as a model: its recipe, the base it was trained on, and its adapter or full weights.

`generate` and `merge` start here. The one idea: check everything a user can get wrong — the directory, the
adapter and base files (`lowmem_ft.checks`), the device, whether the adapter fits the base — before any weight is
read, and say it in one line; then load through the same `lowmem_ft.train.model` functions `train` used, so the base
is stored exactly as it was trained. A run directory is data someone may have handed you: its recipe cannot turn on
`trust_remote_code`; only the command's own `--trust-remote-code` flag does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from lowmem_ft.checks import ADAPTER_WEIGHTS, check_adapter_dir, check_model, check_model_dir
from lowmem_ft.errors import UserError
from lowmem_ft.recipe.schema import Recipe


@dataclass
class FinishedRun:
    run_dir: Path
    recipe: Recipe
    weights_dir: Path  # adapter/ (LoRA) or model/ (full fine-tune): also holds the tokenizer
    full: bool
    base: str  # the base model the adapter applies to (the full model itself for full fine-tunes)

    def base_recipe(self, **model_changes) -> Recipe:
        """The run's recipe pointed at the base, with `model` section changes (e.g. quantization="none")."""
        model = replace(self.recipe.model, name_or_path=self.base, **model_changes)
        return replace(self.recipe, model=model)


def open_run(run_dir: str | Path, base: str | None = None, trust_remote_code: bool = False) -> FinishedRun:
    """The run in `run_dir`, or a UserError saying what is missing or broken. `base` overrides where the base model
    is; `trust_remote_code` is the command's own flag (the run's recipe.yaml cannot grant it)."""
    from lowmem_ft.rundir import RunDir

    run = RunDir.existing(run_dir)
    path = run.path
    recipe = run.read_recipe({"model": {"trust_remote_code": trust_remote_code}})
    full = recipe.adapter.kind == "full"
    weights = run.weights(full)
    if not weights.is_dir():
        if run.finished() is not None:  # completed, its weights since removed: --resume refuses a finished run
            raise UserError(
                f"{path} has no {weights.name}/: the run completed but its weights are gone (moved or deleted); "
                "put them back, or train the run again"
            )
        raise UserError(
            f"{path} has no {weights.name}/ (the run did not finish); "
            f"finish it with `lowmem-ft train --resume {path}` or pick another run"
        )
    if full:
        check_model_dir(weights, "fine-tuned model")
        return FinishedRun(path, recipe, weights, full=True, base=base or str(weights))
    adapter_config = check_adapter_dir(weights)
    # peft records the base the adapter was trained on; the recipe is the fallback for adapters that lack it.
    trained_on = adapter_config.get("base_model_name_or_path") or recipe.model.name_or_path
    if base:
        check_model(base, "--base")
    else:
        check_model(trained_on, "base model", hint=f"; pass --base PATH to the model {path} was trained on")
    return FinishedRun(path, recipe, weights, full=False, base=base or trained_on)


def resolve_device(requested: str, flag: str = "--device") -> str:
    """cpu / cuda from cpu / cuda / auto; asking for cuda where there is none is a user error."""
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise UserError(
            f"{flag} cuda: no CUDA GPU is visible (torch {torch.__version__}, {build}); "
            f"use {flag} cpu, or run `lowmem-ft doctor` to see why"
        )
    return requested


def _module_dims(module) -> tuple[int, int] | None:
    if hasattr(module, "in_features") and hasattr(module, "out_features"):
        return module.in_features, module.out_features
    return None


def check_adapter_fits(model, run: FinishedRun) -> None:
    """Every LoRA matrix of the adapter has a base module of matching shape, or a one-line UserError.

    peft loads an adapter for a shallower base without a word (the extra layers are just unexpected keys) and a
    wider one with a multi-line RuntimeError; this reads the shapes from the safetensors header, no weights.
    """
    from safetensors import safe_open

    hint = f"pass --base PATH to the model {run.run_dir} was trained on"
    with safe_open(str(run.weights_dir / ADAPTER_WEIGHTS), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            for part, axis in ((".lora_A.weight", 1), (".lora_B.weight", 0)):
                if not key.endswith(part):
                    continue
                name = key.removeprefix("base_model.model.").removesuffix(part)
                try:
                    module = model.get_submodule(name)
                except AttributeError:
                    raise UserError(
                        f"adapter {run.weights_dir} does not fit base {run.base}: it has no module {name}; {hint}"
                    ) from None
                dims = _module_dims(module)
                if dims is None:
                    continue
                want = f.get_slice(key).get_shape()[axis]
                have = dims[0] if part.startswith(".lora_A") else dims[1]
                if want != have:
                    side = "input" if part.startswith(".lora_A") else "output"
                    raise UserError(
                        f"adapter {run.weights_dir} does not fit base {run.base}: {name} {side} size is {want} "
                        f"in the adapter but {have} in the base; {hint}"
                    )


def load_finetuned(run: FinishedRun, recipe: Recipe, device: str):
    """Base (stored per `recipe`) + the run's adapter, on `device`; for a full fine-tune, the saved model."""
    from lowmem_ft.train.model import load_model

    model = load_model(recipe, device=device)
    if run.full:
        return model
    from peft import PeftModel

    check_adapter_fits(model, run)
    try:
        return PeftModel.from_pretrained(model, str(run.weights_dir), is_trainable=False)
    except RuntimeError as exc:  # anything the shape check above did not foresee
        first = str(exc).splitlines()[1 if "\n" in str(exc) else 0].strip()
        raise UserError(f"adapter {run.weights_dir} does not load onto base {run.base}: {first}") from None


def weights_bytes(model) -> int:
    """Bytes the loaded model's weights occupy: parameters, buffers and bitsandbytes 4-bit quantization state."""
    total = sum(t.numel() * t.element_size() for t in model.parameters())
    total += sum(t.numel() * t.element_size() for t in model.buffers())
    for param in model.parameters():
        state = getattr(param, "quant_state", None)
        while state is not None:  # NF4 absmax (and, with double quantization, its own absmax one level down)
            absmax = getattr(state, "absmax", None)
            total += absmax.numel() * absmax.element_size() if absmax is not None else 0
            state = getattr(state, "state2", None)
    return total


def load_tokenizer_of(run: FinishedRun):
    """The tokenizer saved with the adapter (or model) — the one training used, chat template included."""
    from lowmem_ft.data.tokenize import load_tokenizer

    return load_tokenizer(str(run.weights_dir), run.recipe.model.trust_remote_code)
