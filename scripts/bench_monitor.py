"""Overhead of the memory monitor: time spent inside `MemoryMonitor.sample` during real training runs.

Every sample (forward end, backward end, optimizer step, eval, save) is timed in place with perf_counter while
`lowmem_ft.train.run.train` runs the embedded model end to end; the overhead is that time over the training
loop's wall time (`train_runtime`). The reader is the real one: on a CUDA machine it includes the allocator
queries and the NVML call, on the CPU only psutil's RSS. Prints a markdown table; `--out` writes it too.

    python scripts/bench_monitor.py --out benchmarks/monitor_overhead.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's lowmem_ft, not an installed one
DATA = ROOT / "tests" / "data" / "numbered.jsonl"

# (name, tiny-model config overrides, recipe overrides): the embedded model, and a wider/deeper one whose step
# time is closer to (still far below) a real model's — the overhead fraction only falls as steps get longer.
CONFIGS = [
    ("tiny h64 L2, batch 4×2, seq 48", {}, ["memory.max_seq_len=48"]),
    (
        "small h256 L4, batch 4×2, seq 128",
        {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4},
        ["memory.max_seq_len=128"],
    ),
]
COMMON = [
    "model.quantization=none",
    "model.compute_dtype=float32",
    "memory.gradient_checkpointing=false",
    "memory.micro_batch_size=4",
    "memory.gradient_accumulation=2",
    "optimizer.name=adamw_torch",
    "training.save_steps=1000",
    "training.logging_steps=1000",
]


def timed_run(model: Path, out: Path, name: str, sets: list[str], steps: int) -> dict:
    from lowmem_ft.recipe.load import resolve
    from lowmem_ft.rundir import RunDir
    from lowmem_ft.train import monitor as monitor_module
    from lowmem_ft.train.run import train

    costs: list[float] = []
    original = monitor_module.MemoryMonitor.sample

    def sample(self, phase, **extra):
        start = time.perf_counter()
        try:
            return original(self, phase, **extra)
        finally:
            costs.append(time.perf_counter() - start)

    monitor_module.MemoryMonitor.sample = sample
    try:
        recipe = resolve(
            "8gb",
            [
                f"model.name_or_path={model}",
                f"data.path={DATA}",
                f"training.output_dir={out}",
                f"training.max_steps={steps}",
                *COMMON,
                *sets,
            ],
        )
        result = train(recipe, RunDir.new(recipe.training.output_dir, name, recipe.model.name_or_path))
    finally:
        monitor_module.MemoryMonitor.sample = original
    runtime = result.metrics["train_runtime"]
    return {
        "steps": result.metrics["global_step"],
        "samples": len(costs),
        "us_per_sample": statistics.median(costs) * 1e6,
        "us_p99": sorted(costs)[int(0.99 * (len(costs) - 1))] * 1e6,
        "step_ms": runtime / result.metrics["global_step"] * 1e3,
        "overhead": sum(costs) / runtime,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steady on shared CPUs)")
    parser.add_argument("--out", type=Path, help="also write the table (markdown) here")
    args = parser.parse_args(argv)

    import torch

    from devkit.tiny import build_tiny_model

    torch.set_num_threads(args.threads)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.processor() or 'cpu'})"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, config, sets) in enumerate(CONFIGS):
            model = build_tiny_model(Path(tmp) / f"model{i}", **config)
            r = timed_run(model, Path(tmp) / "runs", f"run{i}", sets, args.steps)
            rows.append(
                f"| {name} | {r['steps']} | {r['samples']} | {r['us_per_sample']:.0f} | {r['us_p99']:.0f} "
                f"| {r['step_ms']:.1f} | {r['overhead']:.2%} |"
            )
    table = "\n".join(
        [
            f"Monitor overhead on {device}, torch {torch.__version__}, {args.threads} thread(s), "
            f"{time.strftime('%Y-%m-%d')}; `python scripts/bench_monitor.py --steps {args.steps}`",
            "",
            "| model | steps | samples | µs/sample (median) | µs/sample (p99) | step ms | overhead |",
            "| --- | --- | --- | --- | --- | --- | --- |",
            *rows,
        ]
    )
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
