"""The GPU kit's calibration: `lowmem-ft doctor --calibrate` as one step, and the calibration the call measured.

    python -m devkit.gpu.check calibrate --results RESULTS   # the step (gpu_check.sh runs it after the others)

The step runs `doctor --calibrate --json` in-process and appends what it measured to results.jsonl as a
`calibration` record (on a machine without CUDA — the CPU smoke run — the record says so and the step still
succeeds: nothing is there to measure). The kit's `train` run records its own measurement the same way any GPU run
does (`lowmem_ft.train.observe.calibrating`), into `$LOWMEM_FT_CACHE` (gpu_check.sh points it into the call's
scratch), so after the last step `summary` copies every calibration file there to `$OUT/calibration.json` and prints
each measurement's terms beside the model's, and what a plan on this GPU now adds to its margin.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

from lowmem_ft import calibrated

GB = 1e9


def calibrate(results: Path) -> int:
    """Run `doctor --calibrate --json`; append its record (or why there is none) to `results`."""
    from lowmem_ft.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["doctor", "--calibrate", "--json"])
    if rc == 0:
        append(results, {"kind": "calibration", "source": "doctor", **json.loads(out.getvalue())})
        return 0
    said = (err.getvalue().strip().splitlines() or [f"exit {rc}"])[-1]
    append(results, {"kind": "calibration", "source": "doctor", "error": said})
    return 0 if "there is none here" in said else 1  # no CUDA (the CPU smoke run): nothing to measure, not a failure


def append(results: Path, record: dict) -> None:
    """One JSON line, as every step of the kit appends its result (devkit/gpu/check.py, which imports this)."""
    with results.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def summary(out: Path) -> str:
    """Every calibration recorded during the call, copied to `out/calibration.json`, as lines to print."""
    files = sorted(calibrated.calibration_dir().glob("*.json"))
    if not files:
        return "calibration: none recorded (no CUDA GPU here, or no step reached one)"
    found = [json.loads(f.read_text("utf-8")) for f in files]
    (out / "calibration.json").write_text(json.dumps(found, indent=2), "utf-8")
    lines = []
    for data in found:
        key = calibrated.DeviceKey(**data["device"])
        lines.append(f"calibration of {key.device} (driver {key.driver}, torch {key.torch}, CUDA {key.cuda}):")
        for m in data["measurements"]:
            terms = ", ".join(
                f"{t} {got / GB:.3f} GB (model {m['model'].get(t, 0.0) / GB:.3f})"
                for t, got in m["measured"].items()
                if got is not None
            )
            lines.append(f"  {m['source']:6} {m['when']}: {terms}")
        calibration, line = calibrated.load(key)
        lines.append(f"  {line}")
    return "\n".join(lines)
