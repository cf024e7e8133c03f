"""The checked library versions are written twice — `lowmem_ft/versions.py` (read by `doctor`, `plan` and the
memory model's calibration table) and `scripts/constraints.txt` (what `scripts/setup.sh`, and so CI, installs) —
and must be the same set, or CI tests versions the memory model does not name."""

from __future__ import annotations

from pathlib import Path

from lowmem_ft.versions import CHECKED

CONSTRAINTS = Path(__file__).resolve().parents[1] / "scripts" / "constraints.txt"


def pins() -> dict[str, str]:
    lines = (line.split("#")[0].strip() for line in CONSTRAINTS.read_text().splitlines())
    return dict(line.split("==") for line in lines if line)


def test_setup_pins_exactly_the_checked_versions():
    assert pins() == CHECKED


def test_setup_installs_with_the_pins():
    setup = (CONSTRAINTS.parent / "setup.sh").read_text()
    assert "-c scripts/constraints.txt" in setup
    assert setup.count('"${PIN[@]}" -e ".[dev]"') == 1  # the project and its dependencies go through the pins
