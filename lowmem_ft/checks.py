"""Directories users hand us, checked before any weight is read: models, adapters, checkpoints.

The one idea: transformers, peft and safetensors meet a half-written or hand-edited directory with a traceback from
deep inside a load (a truncated safetensors file, an `adapter_config.json` that is not JSON, a checkpoint without its
trainer state), often after minutes of work. These checks read only names, JSON files and the safetensors header —
its 8-byte length, its JSON, the end of the last tensor, compared with the file size — and say in one line which
file is wrong and how. They run no repository code and import no torch.

`checkpoint_problem` is the one answer to "can training resume from this checkpoint directory?".
"""

from __future__ import annotations

import json
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from lowmem_ft.errors import UserError

# What `from_pretrained` reads a model's weights from (transformers 5.24 modeling_utils: safetensors first).
MODEL_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
TRAINER_STATE = "trainer_state.json"  # transformers.trainer_utils TRAINER_STATE_NAME
# The safetensors format caps its header at 100 MB (safetensors' MAX_HEADER_SIZE): a larger length is corruption.
MAX_SAFETENSORS_HEADER = 100_000_000


def _json_object(path: Path) -> tuple[dict[str, Any], str | None]:
    """(the JSON object in `path`, None), or ({}, what is wrong with the file)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        return {}, f"not a text file (byte {exc.start} is not UTF-8)"
    except json.JSONDecodeError as exc:
        return {}, f"not valid JSON ({exc.msg} at line {exc.lineno})"
    except RecursionError:
        return {}, "JSON nested deeper than Python's JSON reader allows"
    except OSError as exc:
        return {}, f"cannot read it ({exc.strerror or exc})"
    if not isinstance(data, dict):
        return {}, f"expected a JSON object ({{...}}), got a {type(data).__name__}"
    return data, None


def read_json_object(path: Path, what: str = "") -> dict[str, Any]:
    """A JSON file that must hold an object, or a UserError naming the file and what is wrong with it."""
    data, problem = _json_object(path)
    if problem:
        raise UserError(f"{what} {path}: {problem}" if what else f"{path}: {problem}")
    return data


def safetensors_problem(path: Path) -> str | None:
    """Why a .safetensors file cannot load (truncated, corrupt header), or None: the header's length and the end of
    its last tensor must fill the file exactly as the format lays it out (8-byte length, JSON header, data)."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            return f"{path.name} is truncated ({size} bytes: not even the header's length)"
        length = int.from_bytes(head, "little")
        if length > MAX_SAFETENSORS_HEADER:
            return f"{path.name} is corrupt (a {length:,}-byte header is beyond the format's limit)"
        if 8 + length > size:
            return f"{path.name} is truncated ({size:,} bytes, but its header alone takes {8 + length:,})"
        raw = handle.read(length)
    try:
        header = json.loads(raw)
        ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
        end = max((int(e) for e in ends), default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, UnicodeDecodeError):
        return f"{path.name} is corrupt (its header is not a safetensors header)"
    expected = 8 + length + end
    if size < expected:
        return f"{path.name} is truncated ({size:,} of {expected:,} bytes)"
    if size > expected:  # safetensors refuses it too: "incomplete metadata, file not fully covered"
        return f"{path.name} is corrupt ({size - expected:,} bytes after its last tensor)"
    return None


def torch_file_problem(path: Path) -> str | None:
    """Why a torch.save file (a zip archive since torch 1.6) cannot load, or None; legacy pickle files pass."""
    with path.open("rb") as handle:
        magic = handle.read(4)
    if not magic:
        return f"{path.name} is empty"
    if magic[:1] == b"\x80":  # a pickle protocol byte: torch's legacy (pre-1.6) format
        return None
    if magic != b"PK\x03\x04":
        return f"{path.name} is corrupt (neither a torch.save archive nor a pickle)"
    try:
        with zipfile.ZipFile(path):  # reads the central directory at the end: gone when the file was cut short
            return None
    except zipfile.BadZipFile:
        return f"{path.name} is truncated or corrupt (not a complete torch.save archive)"


def _file_problems(directory: Path, names: list[str]) -> str | None:
    for name in names:
        path = directory / name
        if name.endswith(".safetensors"):
            problem = safetensors_problem(path)
        elif name.endswith((".bin", ".pt", ".pth")):
            problem = torch_file_problem(path)
        else:
            continue
        if problem:
            return problem
    return None


def _shards(directory: Path, index_name: str) -> list[str]:
    index = read_json_object(directory / index_name)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise UserError(f"{directory / index_name}: no weight_map of tensor names to shard files")
    shards = sorted(set(weight_map.values()))
    missing = [s for s in shards if not (directory / s).is_file()]
    if missing:
        raise UserError(f"{directory}: {index_name} names shards that are missing: {', '.join(missing[:3])}")
    return shards


def check_model_dir(path: Path, what: str = "model", weights: bool = True, config: bool = True) -> None:
    """A local model directory as `from_pretrained` needs it: with `config`, config.json (a JSON object); with
    `weights`, complete weight files."""
    if config and not (path / "config.json").is_file():
        raise UserError(f"{what} {path}: no config.json (a model directory holds config.json and its weights)")
    if config:
        read_json_object(path / "config.json", what)
    if not weights:
        return
    found = [name for name in MODEL_WEIGHTS if (path / name).is_file()]
    if not found:
        raise UserError(f"{what} {path}: no weights ({' or '.join(MODEL_WEIGHTS[::2])}, or a sharded index)")
    name = found[0]
    files = _shards(path, name) if name.endswith(".index.json") else [name]
    problem = _file_problems(path, files)
    if problem:
        raise UserError(f"{what} {path}: {problem}; copy or download the model again")


def check_writable(path: Path, what: str) -> None:
    """A directory that can be created and written to: a probe directory is made and removed in `path`, or in its
    nearest existing parent (nothing is left behind; a read-only mount or a file in the way is one line)."""
    probe_in = path.resolve()
    while not probe_in.exists():
        probe_in = probe_in.parent
    try:
        if not probe_in.is_dir():
            raise NotADirectoryError(20, "Not a directory", str(probe_in))
        Path(tempfile.mkdtemp(prefix=".lowmem-ft-probe-", dir=probe_in)).rmdir()
    except OSError as exc:
        raise UserError(f"{what} {path}: cannot write there ({exc.strerror or exc}: {probe_in})") from None


def looks_like_path(name: str) -> bool:
    """A model name that can only be a local path: a Hub id is `name` or `org/name`."""
    return name.startswith(("/", "./", "../", "~", ".\\")) or "\\" in name or name.count("/") > 1


def check_model(
    name_or_path: str, what: str = "--model", weights: bool = True, config: bool = True, hint: str = ""
) -> None:
    """A model given by name: a local directory is checked (`check_model_dir`); a path that is not one is an error
    (ending in `hint`); a Hub id is left to the loader (it may be cached, or the network may answer)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        check_model_dir(path, what, weights, config)
    elif path.exists():
        raise UserError(f"{what} {name_or_path}: a file, not a model directory (with config.json and weights){hint}")
    elif looks_like_path(name_or_path):
        raise UserError(f"{what} {name_or_path}: no such directory{hint}")


def check_adapter_dir(path: Path, what: str = "adapter") -> dict[str, Any]:
    """A LoRA adapter directory as peft saves it: adapter_config.json of a LoRA, complete adapter weights.
    Returns the adapter config."""
    if not (path / ADAPTER_CONFIG).is_file() or not (path / ADAPTER_WEIGHTS).is_file():
        raise UserError(f"{what} {path} holds no LoRA adapter ({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS})")
    config = read_json_object(path / ADAPTER_CONFIG, what)
    wrong = _lora_config_problem(config)
    if wrong:
        raise UserError(f"{what} {path / ADAPTER_CONFIG}: {wrong}")
    problem = safetensors_problem(path / ADAPTER_WEIGHTS)
    if problem:
        raise UserError(f"{what} {path}: {problem}; the save was cut short — train the run again or --resume it")
    return config


def _lora_config_problem(config: dict[str, Any]) -> str | None:
    """The fields peft's LoraConfig needs, with their types (peft 0.21 config.py / tuners/lora/config.py)."""
    if config.get("peft_type") != "LORA":
        return f"peft_type is {config.get('peft_type')!r}, not 'LORA'"
    r, alpha, targets = config.get("r"), config.get("lora_alpha"), config.get("target_modules")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        return f"r must be a positive integer, got {r!r}"
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        return f"lora_alpha must be a number, got {alpha!r}"
    if not (isinstance(targets, str) or (isinstance(targets, list) and all(isinstance(t, str) for t in targets))):
        return f"target_modules must be a name or a list of names, got {targets!r}"
    base = config.get("base_model_name_or_path")
    if base is not None and not isinstance(base, str):
        return f"base_model_name_or_path must be a string, got {base!r}"
    return None


# What a checkpoint holds besides the trainer state (transformers 5.24 Trainer._save_checkpoint): the weights —
# adapter or full model, FSDP shards (pytorch_model_fsdp_*), DeepSpeed's global_step*/ — and the optimizer state.
CHECKPOINT_WEIGHTS = (ADAPTER_WEIGHTS, "adapter_model.bin", *MODEL_WEIGHTS)


def checkpoint_problem(path: Path) -> str | None:
    """Why training cannot resume from the checkpoint directory `path` (incomplete or corrupt), or None.

    Without its optimizer state transformers would resume silently with a fresh optimizer, so that counts as
    incomplete too.
    """
    if not path.is_dir():
        return "not a directory"
    if not (path / TRAINER_STATE).is_file():
        return f"no {TRAINER_STATE} (the save did not finish)"
    state, problem = _json_object(path / TRAINER_STATE)
    if problem:
        return f"{TRAINER_STATE} is broken: {problem}"
    if not isinstance(state.get("global_step"), int):
        return f"{TRAINER_STATE} has no global_step"
    names = sorted(p.name for p in path.iterdir())
    sharded = [n for n in names if n.startswith(("pytorch_model_fsdp", "global_step"))]
    if not sharded and not any(n in CHECKPOINT_WEIGHTS for n in names):
        return f"no weights ({ADAPTER_WEIGHTS} or model.safetensors)"
    if not sharded and not any(n.startswith("optimizer") for n in names):
        return "no optimizer state (optimizer.pt)"
    return _file_problems(path, [n for n in names if (path / n).is_file()])


def check_checkpoint(path: Path) -> None:
    """A checkpoint to resume from, or a UserError saying what is wrong with it."""
    problem = checkpoint_problem(path)
    if problem:
        raise UserError(f"checkpoint {path}: {problem}")
