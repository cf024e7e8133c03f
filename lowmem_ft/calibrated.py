"""What a GPU measured about itself, kept in the user's cache and read back by `plan` and `train` on that GPU.

The memory model prices three device overheads it cannot read from a library's tensors
(`lowmem_ft.memory.overheads`): the CUDA context, cuBLAS' workspaces and the caching allocator's reserved bytes over
its allocated ones. Each is a constant read from code or assumed. A run on a GPU measures them, and so does
`lowmem-ft doctor --calibrate`; this module keeps those measurements for the device and the software that made them,
and turns them into what `plan` and `train` add to the recipe's safety margin there.

The one idea: a calibration may only add. Each term is a measurement less the model's figure for the same plan;
the terms that measured more than the model are added to the safety margin (the largest excess of each term over
the kept measurements), and a term that measured less lowers nothing — the recipe's margin stands.

The terms, each read from a measurement (`Term`):
- `CUDA context`: what the device holds for this process outside torch's allocator (NVML's used bytes less
  `memory_reserved`), read before the first optimizer step (bitsandbytes' paged optimizer states live outside the
  allocator too, once they exist), less the model's `CUDA context` component.
- `cuBLAS workspaces`: what the first matmul allocates beyond its output (`doctor --calibrate`; in a run the
  workspace is inside the allocated peak and is not told apart), less the model's `cuBLAS workspaces`.
- `reserved over allocated`: `max_memory_reserved` − `max_memory_allocated` in the phase that reserved most, less
  the model's allocator term for the same plan. It is kept in bytes, as measured on that plan: a much larger plan
  than the calibrated ones gets the model's fraction of its own transient plus this excess, not the excess scaled.
  It holds for the allocator setting it was measured under (`lowmem_ft.cuda_alloc`: expandable segments, which
  `train` sets, or torch's default settings, which a user's own `PYTORCH_CUDA_ALLOC_CONF` may leave): the two
  strand different blocks, so a plan adds only the excess measured under the setting its run will use.
Not corrected here: live tensor bytes. The measured allocated peak of each phase is recorded beside its prediction
(`phases` in the file), but a wrong tensor term is the memory model's to fix for every device (`lowmem_ft.memory`),
not a device's calibration.

A calibration holds for one device and one software set (`DeviceKey`: the GPU's name, the driver, torch and the CUDA
it was built for, bitsandbytes, transformers). A file made under another set is stale: ignored, and said so; the next
measurement replaces it. The device is identified through NVML (nvidia-ml-py, a dependency) and the versions from
the packages' metadata, so `plan` reads a calibration without importing torch.

Where: `$LOWMEM_FT_CACHE/calibration/`, else `$XDG_CACHE_HOME/lowmem-ft/calibration/`, else
`~/.cache/lowmem-ft/calibration/` — one JSON file per GPU model, written whole (a temporary file renamed).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from importlib import metadata, util
from pathlib import Path
from typing import Any, Literal

from lowmem_ft.cache import cache_root
from lowmem_ft.cuda_alloc import run_setting
from lowmem_ft.memory.records import AllocatorSetting

GB = 1e9  # decimal, as `--vram` and the memory model speak
FORMAT = 1  # the file's layout; a file of another format is stale
KEEP = 8  # measurements kept per device: each new run refines, an old outlier ages out
Term = Literal["CUDA context", "cuBLAS workspaces", "reserved over allocated"]
TERMS: tuple[Term, ...] = ("CUDA context", "cuBLAS workspaces", "reserved over allocated")
BY_SETTING: frozenset[Term] = frozenset({"reserved over allocated"})  # terms that hold for one allocator setting


@dataclass(frozen=True)
class DeviceKey:
    """The device and software a calibration holds for; any field that differs makes it stale."""

    device: str
    driver: str
    torch: str
    cuda: str
    bitsandbytes: str
    transformers: str

    def differences(self, other: DeviceKey) -> list[str]:
        """'torch 2.12.0 (now 2.13.0)' for each field `other` (the one found) has otherwise."""
        mine, theirs = asdict(self), asdict(other)
        return [f"{k} {theirs[k]} (now {v})" for k, v in mine.items() if theirs[k] != v]


def _version(package: str) -> str:
    try:
        return metadata.version(package)  # torch's local tag (+cu128, +cpu) names its build: kept
    except metadata.PackageNotFoundError:
        return "missing"


def torch_cuda() -> str:
    """The CUDA torch was built for, read from the `cuda = '12.8'` line of torch/version.py (generated when torch
    is built) without importing torch; "none" for a CPU build or where the file says nothing readable."""
    spec = util.find_spec("torch")
    if spec is None or spec.origin is None:
        return "none"
    try:
        text = (Path(spec.origin).parent / "version.py").read_text()
    except OSError:
        return "none"
    found = re.search(r"^cuda\b[^=]*=\s*['\"]([^'\"]+)['\"]", text, re.M)
    return found.group(1) if found else "none"


def _nvml_index(pynvml) -> Any:
    """The NVML handle of the first device this process sees (CUDA_VISIBLE_DEVICES: an index or a UUID)."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    if first.isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(first))
    return pynvml.nvmlDeviceGetHandleByUUID(first)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def this_device() -> DeviceKey | None:
    """The key of the first GPU this process sees, with the installed software; None without an NVIDIA GPU."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "0").strip() in ("", "-1"):
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = _nvml_index(pynvml)
        name, driver = _text(pynvml.nvmlDeviceGetName(handle)), _text(pynvml.nvmlSystemGetDriverVersion())
    except Exception:  # no driver, no NVML, no such device: no GPU to calibrate for
        return None
    return DeviceKey(name, driver, _version("torch"), torch_cuda(), _version("bitsandbytes"), _version("transformers"))


@dataclass(frozen=True)
class Measurement:
    """One measurement of the terms on one device: what was measured and the model's figure for it (bytes; None:
    not measured this way), when, by what (`train` or `doctor`), on which plan, each phase's allocated and
    reserved peaks beside the prediction (a run's; recorded, not applied), and the allocator setting it ran under
    ("" in a file written before the setting was recorded: counted for either setting, as a calibration only adds)."""

    source: Literal["train", "doctor"]
    measured: dict[str, float | None]
    model: dict[str, float]
    plan: dict[str, Any]
    phases: dict[str, dict[str, float]]
    when: str = ""
    allocator: AllocatorSetting | Literal[""] = ""

    def excess(self, term: Term) -> float | None:
        got = self.measured.get(term)
        return None if got is None else got - self.model.get(term, 0.0)

    def holds_for(self, term: Term, setting: AllocatorSetting) -> bool:
        """Whether this measurement of `term` speaks for a run under allocator `setting`."""
        return term not in BY_SETTING or self.allocator in ("", setting)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"when": self.when or datetime.now(UTC).isoformat(timespec="seconds")}


@dataclass(frozen=True)
class Calibration:
    """The kept measurements of one device and software set, and what they add to a safety margin under one
    allocator setting (the setting a run started here will use)."""

    key: DeviceKey
    measurements: tuple[Measurement, ...]
    setting: AllocatorSetting = "expandable segments"

    def added(self) -> dict[Term, float]:
        """term → bytes added: each term's largest excess over the measurements that hold for this setting, where it
        is above zero."""
        out: dict[Term, float] = {}
        for term in TERMS:
            found = [
                e for m in self.measurements if m.holds_for(term, self.setting) and (e := m.excess(term)) is not None
            ]
            if found and max(found) > 0:
                out[term] = max(found)
        return out

    @property
    def added_gb(self) -> float:
        return sum(self.added().values()) / GB

    def _elsewhere(self) -> list[str]:
        """The settings-bound terms measured only under another allocator setting (not applied)."""
        return [
            term
            for term in sorted(BY_SETTING)
            if not any(m.holds_for(term, self.setting) and m.measured.get(term) is not None for m in self.measurements)
            and any(m.measured.get(term) is not None for m in self.measurements)
        ]

    def line(self) -> str:
        """What `plan`'s reasons and `train`'s banner say, e.g. 'calibrated on this GPU: +0.41 GB reserved over
        allocated (expandable segments) (NVIDIA H100 80GB HBM3, 2 measurements)': each term measured above the
        model's, in GB added, and any term measured only under another allocator setting, not applied."""
        n = len(self.measurements)
        where = f"{self.key.device}, {n} measurement{'s' if n != 1 else ''}"
        added = self.added()
        elsewhere = "".join(
            f"; {term} was measured only under another allocator setting than this run's ({self.setting}): not applied"
            for term in self._elsewhere()
        )
        if not added:
            return (
                f"calibrated on this GPU ({where}): its overheads measured within the model's, nothing added{elsewhere}"
            )
        terms = ", ".join(
            f"+{b / GB:.2f} GB {term}" + (f" ({self.setting})" if term in BY_SETTING else "")
            for term, b in added.items()
        )
        return f"calibrated on this GPU: {terms} ({where}){elsewhere}"


def calibration_dir() -> Path:
    """Where every GPU model's calibration file is kept."""
    return cache_root() / "calibration"


def calibration_file(key: DeviceKey) -> Path:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", key.device).strip("-").lower() or "gpu"
    return calibration_dir() / f"{slug}.json"


def _read(path: Path) -> tuple[DeviceKey, list[Measurement]] | None:
    try:
        data = json.loads(path.read_text("utf-8"))
        if data.get("format") != FORMAT:
            return None
        return DeviceKey(**data["device"]), [Measurement(**m) for m in data["measurements"]]
    except (OSError, ValueError, TypeError, KeyError):  # absent, damaged or of another layout: not a calibration
        return None


def load(key: DeviceKey, setting: AllocatorSetting | None = None) -> tuple[Calibration | None, str]:
    """The calibration for `key` under allocator `setting` (None: the setting a `train` run here would use), and the
    line to say: how it is used, why a stale one is ignored, or "" (none)."""
    found = _read(calibration_file(key))
    if found is None:
        return None, ""
    other, measurements = found
    if other != key:
        why = ", ".join(key.differences(other))
        return None, (
            f"the calibration of this GPU is ignored: it was measured with {why}; the next GPU run or "
            "`lowmem-ft doctor --calibrate` measures it again"
        )
    calibration = Calibration(key, tuple(measurements), setting or run_setting())
    return calibration, calibration.line()


def record(key: DeviceKey, measurement: Measurement) -> Path:
    """Add `measurement` to the device's file (a stale file is replaced, the newest KEEP kept); the file's path."""
    path = calibration_file(key)
    found = _read(path)
    kept = found[1] if found is not None and found[0] == key else []
    entries = [m.to_dict() for m in kept[-(KEEP - 1) :]] + [measurement.to_dict()]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps({"format": FORMAT, "device": asdict(key), "measurements": entries}, indent=2), "utf-8")
    tmp.replace(path)  # whole or absent: a reader never sees half a file
    return path


def for_this_device() -> tuple[float, str]:
    """(GB to add to the safety margin, the line saying so) for the GPU here and the allocator setting a run started
    in this environment uses; (0.0, "") without a GPU or a calibration, (0.0, why) for a stale one."""
    key = this_device()
    if key is None:
        return 0.0, ""
    calibration, line = load(key)
    return (round(calibration.added_gb, 3) if calibration is not None else 0.0), line
