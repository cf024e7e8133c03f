"""The library versions the memory model was read from and checked against: one record, read by `doctor`, `plan`
and the memory model's calibration table.

The memory model's constants were read from these libraries' code and measured with them installed (exact
live-tensor counts on the CPU, `lowmem_ft.train.measure.peak`). A newer or older version may allocate differently; the
installed versions are compared with these and any difference is said, not assumed harmless.
"""

from __future__ import annotations

from importlib import metadata

# package → the version the memory model was checked against (the CI machine's set-up, scripts/setup.sh).
CHECKED: dict[str, str] = {
    "torch": "2.13.0",
    "transformers": "5.24.0",
    "peft": "0.21.2",
    "trl": "1.16.0",
    "bitsandbytes": "0.50.2",
    "accelerate": "1.16.0",
    "datasets": "5.2.0",
    "gguf": "0.19.0",  # lowmem_ft.export: its Q8_0 block size and writer layout
    "lm-eval": "0.4.13",  # lowmem_ft.evaluate: HFLM's log-softmax over the whole batch (evaluate/batch.py)
    "llama-cpp-python": "0.3.36",  # lowmem_ft.export.llama_quant: its quantizer's params struct and memory
}


def installed(package: str) -> str | None:
    """The installed version of `package` without a local build tag (`2.13.0+cpu` → `2.13.0`), None if absent."""
    try:
        return metadata.version(package).split("+")[0]
    except metadata.PackageNotFoundError:
        return None


# Packages of an extra (pyproject.toml `eval`, `gguf-quants`): checked when installed, not missed when absent.
OPTIONAL = {"lm-eval", "llama-cpp-python"}


def differences() -> dict[str, tuple[str, str | None]]:
    """package → (checked, installed) for each package whose installed version is not the one checked (an optional
    package only when it is installed)."""
    found = {name: (want, installed(name)) for name, want in CHECKED.items()}
    return {
        name: pair for name, pair in found.items() if pair[0] != pair[1] and not (name in OPTIONAL and pair[1] is None)
    }
