"""`lowmem-ft doctor`: can this machine train? One table of checks, each failure with its fix.

The one idea: run the real thing in miniature rather than checking imports — a bitsandbytes 4-bit Linear forward
compared with its dequantized matmul, an 8-bit optimizer step that must keep 8-bit state and move the weight,
an SDPA call — since an importable library can still lack its kernels for this machine.
Exit 0 when training can run (on a GPU, or on the CPU for small models), 2 when a required check fails.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

OK, WARN, FAIL = "ok", "warn", "fail"
MIN_PYTHON = (3, 10)
HUB_TIMEOUT_S = 3.0  # the Hub probe never holds doctor longer than this (DNS included: it runs in a thread)
MIN_DISK_GB = 1.0  # below this, even an adapter checkpoint and its optimizer state may not fit
LOW_DISK_GB = 20.0  # a merged 7B model in 16-bit is ~15 GB


@dataclass
class Check:
    name: str
    status: str  # ok / warn / fail
    detail: str
    fix: str = ""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "doctor",
        help="check that this machine can train: GPU, CUDA, bitsandbytes, attention, W&B, Hub, disk",
        description="Run small real checks of everything training needs and print one table; every failed check "
        "says how to fix it. Exit 0 when training can run, 2 otherwise.",
    )
    p.add_argument("--output-dir", default="runs", help="where runs will be written, for the disk check (default runs)")
    p.add_argument("--require-gpu", action="store_true", help="count a missing CUDA GPU as a failure")
    p.add_argument("--json", action="store_true", help="print the checks as JSON instead of a table")
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this GPU's CUDA context, cuBLAS workspaces and allocator (under a minute, no training) and "
        "record the calibration plan and train add to their safety margin on it; needs a CUDA GPU",
    )
    p.set_defaults(func=run)


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"  # decimal GB, as `--vram` and the planner speak


def check_python() -> Check:
    version = platform.python_version()
    if sys.version_info[:2] < MIN_PYTHON:  # pyproject's requires-python
        return Check("python", FAIL, version, "install Python {}.{} or newer".format(*MIN_PYTHON))
    return Check("python", OK, version)


def check_torch() -> list[Check]:
    import torch

    cuda = torch.version.cuda
    detail = f"torch {torch.__version__}, " + (f"built for CUDA {cuda}" if cuda else "CPU-only build")
    checks = [Check("torch / CUDA", OK, detail)]
    try:
        import pynvml

        pynvml.nvmlInit()
        checks[0].detail += f", driver {pynvml.nvmlSystemGetDriverVersion()}"
    except Exception:  # no NVIDIA driver (or NVML) on this machine: nothing to add
        pass
    return checks


def check_gpus(require_gpu: bool) -> list[Check]:
    import torch

    if not torch.cuda.is_available():
        cpu_build = torch.version.cuda is None
        fix = (
            "install a CUDA build of torch (https://pytorch.org/get-started/locally/)"
            if cpu_build
            else "check the NVIDIA driver (nvidia-smi) and CUDA_VISIBLE_DEVICES"
        )
        detail = "no CUDA GPU visible: training runs on the CPU (fine for the tiny demo model, too slow for real ones)"
        return [Check("GPU", FAIL if require_gpu else WARN, detail, fix)]
    checks = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        cc = (props.major, props.minor)
        bf16 = cc >= (8, 0)  # bf16 tensor cores start with Ampere (sm_80)
        detail = (
            f"{props.name}: {_gb(free)} free of {_gb(total)}, compute capability {cc[0]}.{cc[1]}, "
            f"bf16 {'yes' if bf16 else 'no'}"
        )
        fix = "" if bf16 else "no bf16 on this GPU: train with --set model.compute_dtype=float16"
        checks.append(Check(f"GPU {i}", OK if bf16 else WARN, detail, fix))
    return checks


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_bnb_4bit() -> Check:
    """A real NF4 Linear4bit forward, compared with the matmul of its dequantized weight."""
    fix = "reinstall bitsandbytes (pip install -U bitsandbytes) or train with --set model.quantization=none"
    try:
        import bitsandbytes as bnb
        import torch

        device = _device()
        torch.manual_seed(0)
        layer = bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.float32, quant_type="nf4")
        layer.weight = bnb.nn.Params4bit(torch.randn(64, 64), requires_grad=False, quant_type="nf4")
        layer = layer.to(device)
        x = torch.randn(4, 64, device=device)
        y = layer(x)
        w = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state).float()
        err = (y - x @ w.t()).abs().max().item()
        if err > 1e-3:
            return Check("bitsandbytes 4-bit", FAIL, f"NF4 forward off by {err:.2g} on {device}", fix)
        backend = getattr(bnb.cextension, "BNB_BACKEND", "?")
        return Check("bitsandbytes 4-bit", OK, f"{bnb.__version__}, {backend} backend: NF4 forward on {device}")
    except Exception as exc:
        return Check("bitsandbytes 4-bit", FAIL, f"{type(exc).__name__}: {str(exc)[:120]}", fix)


def check_bnb_8bit() -> Check:
    """A real 8-bit AdamW step: the state must be uint8 and the weight must move."""
    fix = "reinstall bitsandbytes, or train with --set optimizer.name=adamw_torch (4× the optimizer memory)"
    try:
        import bitsandbytes as bnb
        import torch

        device = _device()
        # bitsandbytes keeps 32-bit state for tensors under min_8bit_size (4096 elements): use one that size.
        param = torch.nn.Parameter(torch.randn(4096, device=device))
        opt = bnb.optim.AdamW8bit([param], lr=1e-2)
        param.grad = torch.randn_like(param)
        before = param.detach().clone()
        opt.step()
        state = opt.state[param]["state1"]
        moved = (param.detach() - before).abs().max().item()
        if state.dtype != torch.uint8 or moved == 0:
            return Check("bitsandbytes 8-bit", FAIL, f"state {state.dtype}, weight moved {moved:.2g}", fix)
        return Check("bitsandbytes 8-bit", OK, f"AdamW8bit step on {device}, uint8 state")
    except Exception as exc:
        return Check("bitsandbytes 8-bit", FAIL, f"{type(exc).__name__}: {str(exc)[:120]}", fix)


def check_attention() -> Check:
    import torch
    from transformers.utils import is_flash_attn_2_available

    try:
        q = torch.randn(1, 2, 8, 16, device=_device())
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    except Exception as exc:
        return Check(
            "attention",
            FAIL,
            f"SDPA failed: {type(exc).__name__}: {str(exc)[:100]}",
            "upgrade torch (≥ 2.4), or train with --set model.attn_implementation=eager",
        )
    flash = is_flash_attn_2_available()
    detail = f"SDPA works; flash-attention 2 {'installed' if flash else 'not installed'}"
    fix = (
        ""
        if flash or _device() == "cpu"
        else "optional: pip install flash-attn for model.attn_implementation=flash_attention_2"
    )
    return Check("attention", OK, detail, fix)


def check_wandb() -> Check:
    from lowmem_ft.recipe.schema import Recipe
    from lowmem_ft.train.observe.tracking import wandb_logged_in, wandb_mode

    logged_in = wandb_logged_in()
    mode = wandb_mode(Recipe())
    detail = f"{'logged in' if logged_in else 'not logged in'}; runs log {mode}"
    fix = "" if logged_in or mode == "disabled" else "optional: `wandb login` to log online (offline runs sync later)"
    return Check("W&B", OK, detail, fix)


def check_hub() -> Check:
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return Check("Hub", OK, "offline mode (HF_HUB_OFFLINE=1): models must be local or already cached")
    host = constants.ENDPOINT.split("://")[-1].split("/")[0]
    result: dict[str, str] = {}

    def probe() -> None:
        import socket

        try:
            socket.create_connection((host, 443), timeout=HUB_TIMEOUT_S).close()
            result["ok"] = "reachable"
        except OSError as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"

    # getaddrinfo ignores socket timeouts, so the probe runs in a daemon thread we stop waiting for.
    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(HUB_TIMEOUT_S)
    if "ok" in result:
        return Check("Hub", OK, f"{host} reachable")
    why = result.get("error", f"no answer in {HUB_TIMEOUT_S:g} s")
    return Check(
        "Hub",
        WARN,
        f"{host} not reachable ({why[:80]})",
        "local model directories still work; set HF_HUB_OFFLINE=1 to skip the Hub, or check the network/HF_ENDPOINT",
    )


def check_disk(output_dir: str) -> Check:
    path = Path(output_dir).resolve()
    probe = path
    while not probe.exists():  # the run directory may not exist yet: measure the disk it will be on
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    detail = f"{_gb(free)} free at {path}"
    if free < MIN_DISK_GB * 1e9:
        return Check("disk", FAIL, detail, "free some space or pass --output-dir on a larger disk")
    if free < LOW_DISK_GB * 1e9:
        return Check("disk", WARN, detail, f"under {LOW_DISK_GB:g} GB: enough for adapters, tight for `merge`")
    return Check("disk", OK, detail)


def check_versions() -> Check:
    """The library versions the memory model was checked against (`lowmem_ft.versions.CHECKED`), and which
    installed ones differ: a warning, since a difference may change memory (`plan --verify` measures it)."""
    from lowmem_ft.versions import CHECKED, differences

    checked = ", ".join(f"{name} {version}" for name, version in CHECKED.items())
    found = differences()
    if not found:
        return Check("library versions", OK, f"the memory model's checked set: {checked}")
    installed = ", ".join(f"{name} {now or 'missing'} (checked {want})" for name, (want, now) in found.items())
    return Check(
        "library versions",
        WARN,
        f"installed differ from the memory model's checked set: {installed}",
        "plan --verify traces the step with the installed versions; or install the checked ones: " + checked,
    )


def check_calibration() -> list[Check]:
    """This GPU's calibration (`lowmem_ft.calibrated`): what plans here add to their margin, or how to make one;
    nothing without an NVIDIA GPU."""
    from lowmem_ft.calibrated import load, this_device

    key = this_device()
    if key is None:
        return []
    calibration, line = load(key)
    fix = "lowmem-ft doctor --calibrate measures it in under a minute (any GPU run does too)"
    if calibration is None:
        return [Check("calibration", WARN if line else OK, line or f"none for {key.device} yet", fix)]
    return [Check("calibration", OK, line)]


def run_checks(output_dir: str = "runs", require_gpu: bool = False) -> list[Check]:
    checks = [check_python(), *check_torch(), *check_gpus(require_gpu), check_versions(), *check_calibration()]
    checks += [check_bnb_4bit(), check_bnb_8bit(), check_attention(), check_wandb(), check_hub()]
    checks.append(check_disk(output_dir))
    return checks


def _print_table(checks: list[Check]) -> None:
    from rich.table import Table
    from rich.text import Text

    from lowmem_ft.console import rich_console

    style = {OK: "green", WARN: "yellow", FAIL: "bold red"}
    table = Table(title="lowmem-ft doctor", show_lines=False)
    for column in ("check", "status", "detail", "fix"):
        table.add_column(column, overflow="fold")
    for c in checks:
        table.add_row(c.name, Text(c.status, style=style[c.status]), c.detail, c.fix)
    rich_console().print(table)


def calibrate(as_json: bool = False) -> int:
    """`doctor --calibrate`: measure this GPU's overheads (`lowmem_ft.train.measure.cuda_overheads`), record them
    (`lowmem_ft.calibrated`) and print each term measured beside the model's, and what plans here now add."""
    import torch

    from lowmem_ft.calibrated import GB, TERMS, load, record, this_device
    from lowmem_ft.errors import UserError
    from lowmem_ft.train.device import configure_allocator
    from lowmem_ft.train.measure.cuda_overheads import measurement_of, read

    if not torch.cuda.is_available():
        build = "a CPU-only build of torch" if torch.version.cuda is None else "no CUDA GPU visible"
        raise UserError(f"doctor --calibrate measures a CUDA GPU and there is none here ({build}); run it on the GPU")
    key = this_device()
    if key is None:
        raise UserError("doctor --calibrate: NVML does not see the GPU torch uses (calibrations are kept by its NVML "
                        "name and driver); check nvidia-smi and CUDA_VISIBLE_DEVICES")  # fmt: skip
    configure_allocator()  # before CUDA starts: measure the allocator setting a `train` run here uses
    m = measurement_of(read())
    path = record(key, m)
    calibration, line = load(key)
    if as_json:
        print(json.dumps({"device": asdict(key), "file": str(path), "measured": m.measured, "model": m.model,
                          "added_gb": calibration.added_gb if calibration else 0.0, "line": line}, indent=2))  # fmt: skip
        return 0
    print(f"calibration of {key.device} (driver {key.driver}, torch {key.torch}, CUDA {key.cuda}):")
    for term in TERMS:
        got, model = m.measured[term], m.model[term]
        print(f"  {term:24} measured {got / GB:6.3f} GB   model {model / GB:6.3f} GB   {(got - model) / GB:+.3f} GB")
    print(f"recorded in {path}")
    print(line)
    return 0


def run(args: argparse.Namespace) -> int:
    if args.calibrate:
        return calibrate(args.json)
    checks = run_checks(args.output_dir, args.require_gpu)
    failed = [c for c in checks if c.status == FAIL]
    if args.json:
        print(json.dumps({"can_train": not failed, "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        _print_table(checks)
        if failed:
            print(f"training cannot run: {len(failed)} check(s) failed ({', '.join(c.name for c in failed)})")
        else:
            print("training can run" + (" (on the CPU)" if _device() == "cpu" else ""))
    return 2 if failed else 0
