"""What robustness costs: split-stable LoRA dropout against torch's, and flushing a checkpoint to disk.

    python -m devkit.bench.robust                                   # CPU (and CUDA when there is one)
    python -m devkit.bench.robust --out benchmarks/robust_cpu.md

Dropout: one LoRA branch as peft runs it (`lora_B(lora_A(dropout(x)))`, x fp32, r 16) on x of batch × seq × hidden,
forward and backward, median of `--repeat` timed runs after warm-up, with torch's `nn.Dropout` and with
`StableDropout`, on the whole micro batch and cut into 2 and 4 pieces of rows (an OOM step-down, where each
`StableDropout` piece draws the whole micro batch's mask). The frozen base linear beside the branch — most of a
layer's time — is left out, so the ratio is the dropout's own cost at its most visible. Saving: `fsync_tree` + rename of a staged directory of `--save-mb` MB of
freshly written files (what `lowmem_ft.train.resilience.checkpoints` adds to each checkpoint save), on the disk of `--dir`.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from lowmem_ft.train.resilience.checkpoints import rename_into_place
from lowmem_ft.train.resilience.dropout import DropoutContext, Piece, StableDropout


def lora_pass(dropout: nn.Module, a: nn.Linear, b: nn.Linear, x: torch.Tensor, pieces: int, seed: int) -> float:
    """ms of forward + backward of the LoRA branch over x, run as `pieces` pieces of rows."""
    rows = x.shape[0] // pieces
    context = dropout.context if isinstance(dropout, StableDropout) else DropoutContext()
    if x.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for k in range(pieces):
        with context.piece(Piece(seed, 0, x.shape[0], k * rows, rows)):
            b(a(dropout(x[k * rows : (k + 1) * rows]))).sum().backward()
    if x.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000


def dropout_rows(device: str, shape: tuple[int, int, int], repeat: int) -> list[str]:
    """Torch's and the stable dropout timed in alternation (a shared machine's load hits both alike)."""
    x = torch.randn(*shape, device=device)
    a = nn.Linear(shape[-1], 16, bias=False, device=device)
    b = nn.Linear(16, shape[-1], bias=False, device=device)
    native, stable = nn.Dropout(0.05).train(), StableDropout(0.05, 0, DropoutContext()).train()
    rows = []
    for pieces in (1, 2, 4):
        times: dict[nn.Module, list[float]] = {native: [], stable: []}
        for i in range(repeat + 2):
            for module in (native, stable):
                ms = lora_pass(module, a, b, x, pieces, i)
                if i >= 2:
                    times[module].append(ms)
        t_native, t_stable = statistics.median(times[native]), statistics.median(times[stable])
        size = " × ".join(map(str, shape))
        rows.append(f"| {device} | {size} | {pieces} | {t_native:.2f} | {t_stable:.2f} | {t_stable / t_native:.2f} |")
    return rows


def save_row(directory: Path, megabytes: int) -> str:
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        staged, final = Path(tmp, ".staging", "checkpoint-1"), Path(tmp, "checkpoint-1")
        staged.mkdir(parents=True)
        for i in range(4):
            Path(staged, f"part{i}.bin").write_bytes(os.urandom(megabytes * 2**20 // 4))
        start = time.perf_counter()
        rename_into_place(staged, final)
        ms = (time.perf_counter() - start) * 1000
    return f"| {megabytes} MB in 4 files | {file_system(directory)} | {ms:.0f} ms |"


def file_system(directory: Path) -> str:
    """The type of the file system `directory` is on (the mount with the longest matching path in /proc/mounts):
    what the flush cost depends on, where the directory's own path would only name one machine."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return "unknown"
    best = max((m for m in mounts if directory.is_relative_to(m[0])), key=lambda m: len(m[0]), default=None)
    return best[1] if best else "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m devkit.bench.robust", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="4,512,1024", help="batch,seq,hidden of the LoRA input")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--save-mb", type=int, default=256)
    parser.add_argument("--dir", default=".", help="a directory on the disk to time the flush on")
    parser.add_argument("--out", help="also write the tables to this markdown file")
    args = parser.parse_args()
    torch.set_num_threads(1)  # steadier on a shared machine; the ratio is what the table is for
    shape = tuple(int(v) for v in args.shape.split(","))
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    lines = [
        "# What robustness costs (devkit/bench/robust.py)",
        "",
        f"How: `python -m devkit.bench.robust --repeat {args.repeat} --save-mb {args.save_mb}`; see the script's "
        "docstring. Measured on a shared machine: medians, other processes running.",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads" + (f", {torch.cuda.get_device_name()}" if "cuda" in devices else ""),
        "",
        "| device | x | pieces | torch nn.Dropout ms | StableDropout ms | ratio |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for device in devices:
        lines += dropout_rows(device, shape, args.repeat)
    lines += ["", "| staged checkpoint | file system of --dir | fsync + rename |", "| --- | --- | --- |"]
    lines.append(save_row(Path(args.dir).resolve(), args.save_mb))
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
