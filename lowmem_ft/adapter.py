"""An existing LoRA adapter to continue training (`--adapter`, `adapter.name_or_path`): where it is and what it is.

The one idea: the adapter decides its own shape. Its rank, alpha and dropout (adapter_config.json) and the modules it
adapts (the weight names in adapter_model.safetensors: what will actually load) replace the recipe's adapter section
before planning, so the planner counts the adapter that is loaded, not the tier's. All of it is read before any data or
model work, and every problem is one line: a missing directory, a Hub id without network, a non-LoRA adapter, an
adapter whose matrices do not fit the model's layers. No torch here (a safetensors header is JSON), so `plan` stays
instant; loading the weights is `lowmem_ft.train.model.load_adapter`.
"""

from __future__ import annotations

import functools
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowmem_ft.errors import UserError

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
# peft's key of one LoRA matrix: <module path>.lora_A.weight / .lora_B.weight (the adapter name is not saved)
_LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")
_LAYER = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class LoraMatrix:
    """One adapted module: its path in the model, rank, input and output size (from lora_A [r, in], lora_B [out, r])."""

    module: str
    r: int
    in_features: int
    out_features: int

    @property
    def name(self) -> str:
        return self.module.rsplit(".", 1)[-1]

    @property
    def layer(self) -> int | None:
        found = _LAYER.search(f".{self.module}.")
        return int(found.group(1)) if found else None


@dataclass(frozen=True)
class SavedAdapter:
    """A LoRA adapter on disk: what the user named (`source`), the local directory, and its shape."""

    source: str
    path: Path
    base: str  # base_model_name_or_path as peft recorded it ("" when absent)
    r: int
    alpha: int
    dropout: float
    target_modules: tuple[str, ...]
    matrices: tuple[LoraMatrix, ...] = ()
    uncounted: tuple[str, ...] = ()  # what it trains that the memory model does not count (modules_to_save…)
    use_dora: bool = False  # DoRA magnitude vectors: priced like adapter.use_dora

    def section(self) -> dict[str, Any]:
        """The recipe's adapter keys this adapter fixes (it is initialised already: adapter.init is default)."""
        return {"kind": "lora", "r": self.r, "alpha": self.alpha, "dropout": self.dropout,
                "target_modules": list(self.target_modules), "use_dora": self.use_dora,
                "init": "default"}  # fmt: skip

    def same_base(self, model: str) -> bool:
        """Whether `model` names the base peft recorded: the same string, directory or model name (any case)."""
        if not self.base or self.base == model:
            return True
        a, b = Path(self.base), Path(model)
        if a.exists() and b.exists():
            return a.resolve() == b.resolve()
        return a.name.lower() == b.name.lower()

    def misfit(self, linears: dict[str, tuple[int, int]], num_layers: int) -> str | None:
        """Why the adapter's matrices do not fit a model with these block linears (name → (in, out)) and layers, or
        None when every matrix has a layer of its shape."""
        for m in self.matrices:
            if m.layer is not None and m.layer >= num_layers:
                return f"it adapts layer {m.layer} ({m.module}) but the model has {num_layers} layers"
            if m.name in linears and linears[m.name] != (m.in_features, m.out_features):
                have = linears[m.name]
                return (
                    f"{m.name} is {m.in_features} → {m.out_features} in the adapter but {have[0]} → {have[1]} in the "
                    "model"
                )
        return None

    def misfit_model(self, model) -> str | None:
        """Like `misfit`, against a loaded model's modules: the first matrix without a module of its shape, or None."""
        for m in self.matrices:
            try:
                module = model.get_submodule(m.module)
            except AttributeError:
                return f"the model has no module {m.module}"
            dims = (getattr(module, "in_features", None), getattr(module, "out_features", None))
            if None not in dims and dims != (m.in_features, m.out_features):
                return (
                    f"{m.module} is {m.in_features} → {m.out_features} in the adapter but {dims[0]} → {dims[1]} in "
                    "the model"
                )
        return None


def _safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name → shape from a safetensors file's header (8-byte length, then JSON), no tensor read."""
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    return {name: info["shape"] for name, info in header.items() if name != "__metadata__"}


def _matrices(path: Path) -> tuple[LoraMatrix, ...]:
    """The adapted modules, from the weight names and shapes (empty when the weights are not safetensors)."""
    if not (path / WEIGHTS).is_file():
        return ()
    parts: dict[str, dict[str, list[int]]] = {}
    for name, shape in _safetensors_shapes(path / WEIGHTS).items():
        match = _LORA_KEY.match(name)
        if match and len(shape) == 2:
            parts.setdefault(match["module"], {})[match["which"]] = shape
    return tuple(
        LoraMatrix(module, ab["A"][0], ab["A"][1], ab["B"][0])
        for module, ab in sorted(parts.items())
        if "A" in ab and "B" in ab
    )


def _fetch(name: str) -> Path:
    """A Hub adapter's config and weights in the local cache (downloaded once), or one line saying why not."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, OfflineModeIsEnabled, RepositoryNotFoundError

    how = f"--adapter {name} is not a local directory, so it is read as a Hugging Face Hub id"
    try:
        local = snapshot_download(name, allow_patterns=[CONFIG, WEIGHTS, "adapter_model.bin"])
    except (GatedRepoError, RepositoryNotFoundError):
        raise UserError(
            f"{how}, and the Hub has no such adapter (or it is private or gated: `hf auth login`)"
        ) from None
    except (OfflineModeIsEnabled, OSError, ConnectionError) as exc:  # no network, offline mode, nothing cached
        offline = constants.HF_HUB_OFFLINE or isinstance(exc, OfflineModeIsEnabled) or "offline" in str(exc).lower()
        why = "offline mode is on, HF_HUB_OFFLINE=1" if offline else type(exc).__name__
        raise UserError(
            f"{how}, and the Hub is unreachable ({why}) with no copy in the cache; download it where there is "
            "network (`hf download ID --local-dir DIR`) and pass --adapter DIR"
        ) from None
    return Path(local)


def _directory(name: str) -> Path:
    path = Path(name)
    if path.is_dir():
        if not (path / CONFIG).is_file() and (path / "adapter" / CONFIG).is_file():
            return path / "adapter"  # a run directory: its adapter/
        return path
    if path.exists():
        raise UserError(f"--adapter {name} is a file; pass the directory that holds {CONFIG}")
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        raise UserError(f"--adapter {name}: no such directory (and not a Hub id, org/name)") from None
    return _fetch(name)


def _int(value: Any, key: str, name: str) -> int:
    if isinstance(value, (int, float)) and float(value).is_integer():
        return int(value)
    raise UserError(f"--adapter {name}: {key} is {value!r}; lowmem-ft continues adapters with an integer {key}")


def _targets(config: dict[str, Any], matrices: tuple[LoraMatrix, ...], name: str) -> tuple[str, ...]:
    """Module names the adapter adapts: from its weights where they are safetensors, else from its config."""
    if matrices:
        return tuple(sorted({m.name for m in matrices}))
    targets = config.get("target_modules")
    if isinstance(targets, list) and targets:
        return tuple(sorted(targets))
    if targets == "all-linear":
        return ("all-linear",)
    raise UserError(
        f"--adapter {name}: target_modules {targets!r} is a pattern and the adapter has no {WEIGHTS} to read the "
        "adapted modules from; lowmem-ft needs their names"
    )


def _uncounted(config: dict[str, Any], matrices: tuple[LoraMatrix, ...]) -> tuple[str, ...]:
    notes = []
    if config.get("modules_to_save"):
        notes.append(f"full copies of {', '.join(config['modules_to_save'])} (modules_to_save)")
    if config.get("rank_pattern") or len({m.r for m in matrices}) > 1:
        notes.append("per-module ranks (rank_pattern): the memory model counts every module at r")
    return tuple(notes)


@functools.lru_cache(maxsize=8)  # planning resolves the recipe more than once per command: read (and fetch) once
def locate(name: str) -> SavedAdapter:
    """The adapter `name` (a directory, a run directory, or a Hub id) and its shape, or a one-line UserError."""
    path = _directory(name)
    config_file = path / CONFIG
    if not config_file.is_file():
        raise UserError(
            f"--adapter {name}: {path} has no {CONFIG}; pass a directory saved by peft (e.g. runs/X/adapter)"
        )
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"--adapter {name}: {config_file} is not valid JSON ({exc})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise UserError(f"--adapter {name} is a {config.get('peft_type')} adapter; lowmem-ft continues LoRA adapters")
    if not (path / WEIGHTS).is_file() and not (path / "adapter_model.bin").is_file():
        raise UserError(f"--adapter {name}: {path} has {CONFIG} but no weights ({WEIGHTS})")
    init = str(config.get("init_lora_weights", True)).lower()
    if init == "olora" or init.startswith(("pissa", "corda", "lora_ga")):
        raise UserError(
            f"--adapter {name} is in its {init} form (a checkpoint of an adapter.init={init} run): it applies to the "
            "residual base only; continue that run with --resume, or pass its adapter/ (converted to plain LoRA)"
        )
    matrices = _matrices(path)
    return SavedAdapter(
        source=name,
        path=path,
        base=str(config.get("base_model_name_or_path") or ""),
        r=_int(config.get("r", 8), "r", name),
        alpha=_int(config.get("lora_alpha", 8), "lora_alpha", name),
        dropout=float(config.get("lora_dropout") or 0.0),
        target_modules=_targets(config, matrices, name),
        matrices=matrices,
        uncounted=_uncounted(config, matrices),
        use_dora=bool(config.get("use_dora")),
    )
