"""Build the GPU kit: the wheels `scripts/gpu_check.sh` needs on the lent H200, whose image lacks or differs in them.

    python -m devkit.gpu.kit             # download into .gpukit/ (PyPI), strip bitsandbytes, check the size
    python -m devkit.gpu.kit --dry-run   # what it would fetch and why, without the network (--json: as JSON)

The device image (as the device tool's notes list it: Python 3.12, torch 2.11+cu130, transformers 5.17, accelerate
1.15, no bitsandbytes / trl / datasets / dill / multiprocess) cannot reach a registry, so the packages travel as
wheels in `.gpukit/wheels/` (ignored by git; name `.gpukit` in the device tool's `carry`), at the versions this
machine's venv runs the tests with. gpu_check.sh installs them there with `pip install --no-index --no-deps
--target`. bitsandbytes' wheel holds a native library per CUDA / ROCm / XPU version (43 MB); the kit keeps only
`libbitsandbytes_cuda130.so` (torch 2.11+cu130: `torch.version.cuda` 13.0 selects it, bitsandbytes
cextension.get_cuda_bnb_library_path) and the 63 kB CPU library (so the CPU smoke run imports it too), and rewrites
the wheel's RECORD to match. What travels — the repository's tracked and untracked-not-ignored files plus the kit —
must stay under the device tool's 64 MiB; the builder prints the sum and exits 2 when it is over.

Standard library only: it runs with any python3 (the venv's, for the versions).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from devkit.gpu.settings import SETTINGS

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT / ".gpukit"
LIMIT_BYTES = SETTINGS.travel_bytes  # the device tool: "the working tree that travels" (`devkit.gpu.settings`)
PYTHON = "3.12"  # the device image's python3
PLATFORMS = (  # pip matches manylinux tags exactly; bitsandbytes 0.50 is manylinux_2_24, regex manylinux_2_17
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
# distribution → why it travels (versions: what this venv has, i.e. what the tests run with)
CARRY = {
    "bitsandbytes": "missing on the image; NF4 weights and the 8-bit optimizers",
    "trl": "missing on the image; SFTTrainer and the fused LM head",
    "datasets": "missing on the image; tokenization and TRL's data path",
    "dill": "missing on the image; needed by datasets",
    "multiprocess": "missing on the image; needed by datasets (a wheel per Python version: py312 here)",
    "transformers": "the image has 5.17; lowmem-ft needs >= 5.20 and is tested on this version",
    "peft": "the image's version is not recorded; tested on this version",
    "accelerate": "the image has 1.15; tested on this version",
    "regex": "transformers checks regex>=2025.10.22 at import; the image's version is not recorded",
}
BNB_KEEP = ("libbitsandbytes_cuda130.so", "libbitsandbytes_cpu.so")


def pinned(extra: list[str] = ()) -> list[dict[str, str]]:
    """Each carried distribution with the version installed here (the one the tests run with), plus `extra`
    (NAME or NAME==VERSION: what a device run's `unmet` list asked for, e.g. pyarrow)."""
    wanted = dict(CARRY)
    pins = {}
    for item in extra:
        name, _, pin = item.partition("==")
        wanted[name] = "added with --with (a device run reported it unmet)"
        if pin:
            pins[name] = pin
    out = []
    for name, why in wanted.items():
        try:
            out.append({"name": name, "version": pins.get(name) or version(name), "why": why})
        except PackageNotFoundError:
            sys.exit(
                f"devkit.gpu.kit: {name} is not installed in this Python; use the project's .venv/bin/python or NAME==VERSION"
            )
    return out


def pip_download_command(packages: list[dict[str, str]], dest: Path) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", PYTHON]
    cmd += ["--implementation", "cp", "--dest", str(dest), "--quiet"]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    return cmd + [f"{p['name']}=={p['version']}" for p in packages]


def strip_bitsandbytes(wheel: Path, keep: tuple[str, ...] = BNB_KEEP) -> list[str]:
    """Rewrite the bitsandbytes wheel in place without the native libraries not in `keep`; returns what was removed.

    The RECORD lines of removed files are dropped, so the wheel stays consistent for pip.
    """
    with zipfile.ZipFile(wheel) as src:
        entries = [(info, src.read(info)) for info in src.infolist()]
    removed = {
        info.filename
        for info, _ in entries
        if (base := info.filename.rsplit("/", 1)[-1]).startswith("libbitsandbytes_") and base not in keep
    }
    tmp = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info, data in entries:
            if info.filename in removed:
                continue
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = ("\n".join(line for line in lines if line.split(",", 1)[0] not in removed) + "\n").encode()
            dst.writestr(info, data)
    tmp.replace(wheel)
    return sorted(removed)


def travelling_bytes(root: Path = ROOT) -> int:
    """Bytes of what the device tool sends besides carried paths: tracked + untracked-not-ignored files."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=root, capture_output=True, check=True,
        ).stdout.decode().split("\0")  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return 0
    return sum((root / name).stat().st_size for name in listed if name and (root / name).is_file())


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build(kit: Path = KIT, extra: list[str] = ()) -> dict:
    """Download, strip, write kit/manifest.json; returns the manifest."""
    packages = pinned(extra)
    wheels = kit / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    for old in wheels.glob("*.whl"):
        old.unlink()
    subprocess.run(pip_download_command(packages, wheels), check=True)
    removed: list[str] = []
    for wheel in wheels.glob("bitsandbytes-*.whl"):
        removed = strip_bitsandbytes(wheel)
    files = {w.name.split("-")[0].replace("_", "-").lower(): w for w in wheels.glob("*.whl")}
    for p in packages:
        wheel = files[p["name"].lower()]
        p |= {"file": wheel.name, "bytes": wheel.stat().st_size, "sha256": sha256(wheel)}
    manifest = {
        "python": PYTHON,
        "platforms": list(PLATFORMS),
        "packages": packages,
        "bitsandbytes_kept": list(BNB_KEEP),
        "bitsandbytes_removed": len(removed),
        "install": "python3 -m pip install --no-index --no-deps --no-compile --target SITE .gpukit/wheels/*.whl",
    }
    (kit / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def size_report(kit: Path = KIT, root: Path = ROOT) -> tuple[int, str]:
    """(total travelling bytes, a few lines saying where they go)."""
    kit_bytes, repo_bytes = folder_bytes(kit), travelling_bytes(root)
    total = kit_bytes + repo_bytes
    lines = [
        f"kit {kit.relative_to(root)}: {kit_bytes / 2**20:.1f} MiB",
        f"repository (tracked + untracked-not-ignored): {repo_bytes / 2**20:.1f} MiB",
        f"total {total / 2**20:.1f} MiB of the device tool's {LIMIT_BYTES / 2**20:.0f} MiB",
    ]
    return total, "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devkit.gpu.kit", description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="print the plan (packages, versions, pip command) only")
    ap.add_argument("--json", action="store_true", help="with --dry-run: the plan as JSON")
    ap.add_argument("--with", dest="extra", action="append", default=[], metavar="NAME[==VERSION]",
                    help="carry one more distribution (repeatable), e.g. one a device run listed as unmet")  # fmt: skip
    args = ap.parse_args(argv)
    if args.dry_run:
        packages = pinned(args.extra)
        plan = {"kit": str(KIT), "python": PYTHON, "packages": packages, "bitsandbytes_kept": list(BNB_KEEP)}
        plan["pip"] = pip_download_command(packages, KIT / "wheels")
        if args.json:
            print(json.dumps(plan, indent=2))
        else:
            for p in packages:
                print(f"{p['name']}=={p['version']}: {p['why']}")
            print(" ".join(plan["pip"]))
        return 0
    manifest = build(extra=args.extra)
    for p in manifest["packages"]:
        print(f"{p['file']}: {p['bytes'] / 2**20:.2f} MiB ({p['why']})")
    total, report = size_report()
    print(report)
    if total > LIMIT_BYTES:
        print(f"devkit.gpu.kit: {total / 2**20:.1f} MiB would travel, over the {LIMIT_BYTES / 2**20:.0f} MiB limit")
        return 2
    print(f"carry it: device run(command='bash scripts/gpu_check.sh', carry=['{KIT.name}'], "
          f"timeout_s={SETTINGS.command_s})")  # fmt: skip
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
