"""Checkpoints that ship their own modeling code, loaded as the native transformers architecture they map onto.

The one idea: some checkpoints users bring (Qwen v1: `Qwen/Qwen-7B`) are a native architecture under other tensor
names, with a config and a tokenizer of their own. Their repository code does not import under transformers 5 and
would run arbitrary code if it did, so lowmem-ft never imports it: a `Conversion` says how the checkpoint maps onto the
native model (config keys, tensor renames and splits applied by transformers' own loader as the weights are read, the
tokenizer rebuilt from the checkpoint's files), and every command — `plan`, `train`, `generate`, `merge`, the tracer —
sees the native model. What a merge or a save writes is a native checkpoint that loads anywhere.

One module per family, registered in `CONVERSIONS` by the `model_type` its config.json declares. This package is
torch-free at import (the memory model reads `native_config`); torch and transformers are imported inside the
functions that build weights or tokenizers.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from lowmem_ft.errors import UserError


class Conversion(Protocol):
    """How one family's checkpoints map onto a native transformers architecture."""

    model_type: str  # what the checkpoint's config.json says
    native_model_type: str  # what it loads as
    family: str  # the family's name in messages

    def native_config(self, config: dict[str, Any], name: str = "") -> dict[str, Any]:
        """The native config.json dict for the checkpoint's config dict (raises UserError when it cannot map)."""

    def weight_transforms(self) -> list[Any]:
        """transformers `WeightTransform`s turning the checkpoint's tensors into the native layout as they load."""

    def tokenizer(self, files: CheckpointFiles) -> Any:
        """A fast tokenizer rebuilt from the checkpoint's own files (no repository code)."""

    def native_tensors(self, key: str, shape: tuple[int, ...]) -> list[tuple[str, int, tuple[int, ...]]]:
        """(native name, first row in the stored tensor, shape) of each native tensor stored tensor `key` holds."""

    def loaded(self, model: Any, files: CheckpointFiles) -> None:
        """Settings the repository's code applied at run time, set on the loaded native model (e.g. stop tokens)."""


@dataclass(frozen=True)
class CheckpointFiles:
    """Files of one checkpoint, local or on the Hub, fetched one at a time as a conversion needs them."""

    name_or_path: str

    def path(self, filename: str) -> Path | None:
        """The local path of `filename` (downloaded into the Hub cache for a hub id), or None when it has none."""
        local = Path(self.name_or_path)
        if local.is_dir():
            return local / filename if (local / filename).is_file() else None
        from transformers.utils import cached_file

        found = cached_file(
            self.name_or_path,
            filename,
            _raise_exceptions_for_missing_entries=False,
            _raise_exceptions_for_gated_repo=False,
        )
        return Path(found) if found else None

    def json(self, filename: str) -> dict[str, Any]:
        """A JSON file's object, or {} when the checkpoint has no such file."""
        path = self.path(filename)
        if path is None:
            return {}
        data = json.loads(path.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}


def _registry() -> dict[str, Conversion]:
    from lowmem_ft.native import qwen_v1

    return {c.model_type: c for c in (qwen_v1.CONVERSION,)}


def conversion_for(config: dict[str, Any]) -> Conversion | None:
    """The conversion of a checkpoint whose config.json dict is `config`, or None when it loads as it is."""
    return _registry().get(str(config.get("model_type", "")))


def raw_config(name_or_path: str) -> dict[str, Any] | None:
    """The checkpoint's own config.json dict (local directory, or the Hub's file for a hub id), None where it cannot
    be read: the caller's own loading then reports why."""
    try:
        return CheckpointFiles(name_or_path).json("config.json") or None
    except (OSError, ValueError):
        return None


def checkpoint_conversion(name_or_path: str) -> Conversion | None:
    """The conversion that loads checkpoint `name_or_path` natively, or None."""
    config = raw_config(name_or_path)
    return conversion_for(config) if config else None


def transformers_config(name_or_path: str, conversion: Conversion):
    """The native transformers config object of a checkpoint that `conversion` loads."""
    from transformers import AutoConfig

    return AutoConfig.for_model(**conversion.native_config(raw_config(name_or_path) or {}, name_or_path))


def load_model(name_or_path: str, conversion: Conversion, config, **kwargs):
    """The checkpoint as its native model, its tensors mapped by transformers' loader as they are read.

    transformers looks a model's weight transforms up by its class name (`get_model_conversion_mapping`); a subclass
    of the native class with a name of its own carries this checkpoint's transforms without touching how any native
    checkpoint loads. Once loaded, the model is made the native class again and forgets the transforms, so a save
    (a merge, a full fine-tune's weights) writes the native layout rather than reverting to the checkpoint's."""
    from transformers import AutoModelForCausalLM
    from transformers.conversion_mapping import (
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )

    native = AutoModelForCausalLM._model_mapping[type(config)]
    loader_name = f"{native.__name__}From{conversion.model_type.capitalize()}Checkpoint"
    if get_checkpoint_conversion_mapping(loader_name) is None:
        own = get_checkpoint_conversion_mapping(conversion.native_model_type) or []
        register_checkpoint_conversion_mapping(loader_name, [*conversion.weight_transforms(), *own])
    loader = type(loader_name, (native,), {"__module__": native.__module__})
    model = loader.from_pretrained(name_or_path, config=config, **kwargs)
    model.__class__ = native
    model._weight_conversions = None
    conversion.loaded(model, CheckpointFiles(name_or_path))
    return model


def load_tokenizer(name_or_path: str, conversion: Conversion):
    """The checkpoint's tokenizer, rebuilt by `conversion` from its own files."""
    return conversion.tokenizer(CheckpointFiles(name_or_path))


@contextmanager
def remote_code_errors(name_or_path: str, trusted: bool, what: str = "code"):
    """A model repository's own code that fails where transformers imports or runs it — a package it needs, an import
    transformers 5 removed — as one line naming the family and the error (`what`: "code", "tokenizer code")."""
    try:
        yield
    except UserError:
        raise
    except Exception as exc:
        config = (raw_config(name_or_path) or {}) if trusted else {}
        if not config.get("auto_map"):  # no repository code ran: the caller says what failed
            raise
        family = config.get("model_type") or "unknown"
        first = (str(exc).strip().splitlines() or [""])[0][:240]
        raise UserError(
            f"model '{name_or_path}' (model_type {family!r}) ships its own {what}, which fails under transformers "
            f"{_version('transformers')}: {type(exc).__name__}: {first}; lowmem-ft cannot train it — use a checkpoint "
            "of the model in a layout transformers implements"
        ) from None


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)
