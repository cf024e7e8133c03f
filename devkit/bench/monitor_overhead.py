"""Cost of the memory monitor per optimizer step, and of each way to measure live tensor bytes exactly on the CPU.

Every run goes through `lowmem_ft.train.run.train` end to end (SFTTrainer, collator, checkpoint save) on the
embedded model and on a wider one. Per run: the step time (`train_runtime` / steps) and the time spent inside
`MemoryMonitor.sample` (timed in place with perf_counter). Ways of measuring, each over the whole training loop:

- `rss`: the monitor without exact measurement (host RSS only: what a CPU run did before issue #15), the baseline;
- `exact`: what ships — `lowmem_ft.train.measure.exact.ExactMemory`, i.e. `PeakMemory` (a TorchDispatchMode counting
  live storages) plus the per-sample prediction;
- `profiler`: `torch.profiler.profile(profile_memory=True)` instead (it sees CPU allocations, but buffers every
  operator's event until it stops; the per-phase peak would need its events processed: timed here as `key_averages`
  at the end, and the number of events per step is reported);
- `memtracker`: torch's `torch.distributed._tools.mem_tracker.MemTracker` (the same dispatch-mode mechanism plus
  module hooks), tracking the model and optimizer.

Prints a markdown table; `--out` writes it too.

    python -m devkit.bench.monitor_overhead --out benchmarks/monitor_overhead.md
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

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "numbered.jsonl"

# (name, tiny-model config overrides, recipe overrides): the embedded model, and wider/deeper ones whose step time
# is closer to (still far below) a real model's — the overhead fraction only falls as steps get longer. "seq" is
# max_seq_len; the samples (tests/data/numbered.jsonl) are 20–49 tokens, batches are padded to their longest.
CONFIGS = [
    ("tiny h64 L2, batch 4×2, seq 48", {}, ["memory.max_seq_len=48"]),
    (
        "small h256 L4, batch 4×2, seq 128",
        {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4},
        ["memory.max_seq_len=128"],
    ),
    (
        "medium h768 L4, batch 4×2, seq 64",
        {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 4, "num_attention_heads": 12},
        ["memory.max_seq_len=64"],
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
WAYS = ("rss", "exact", "profiler", "memtracker")


def candidate(way: str, found: dict):
    """A trainer callback that runs `way`'s measurement from the start of training to its end (None: the monitor's
    own, `rss` or `exact`)."""
    import torch
    from transformers import TrainerCallback

    class Around(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
            if way == "profiler":
                self.ctx = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
            else:
                from torch.distributed._tools.mem_tracker import MemTracker

                self.ctx = MemTracker()
                self.ctx.track_external(model, optimizer)
            self.ctx.__enter__()

        def on_train_end(self, args, state, control, **kwargs):
            self.ctx.__exit__(None, None, None)
            start = time.perf_counter()
            if way == "profiler":
                events = self.ctx.events()
                found["events"] = len(events)
                self.ctx.key_averages()
            else:
                found["peak"] = max(self.ctx.get_tracker_snapshot("peak")["cpu"].values(), default=0)
            found["post_s"] = time.perf_counter() - start

    return None if way in ("rss", "exact") else Around()


def timed_run(model: Path, out: Path, name: str, sets: list[str], steps: int, way: str) -> dict:
    from lowmem_ft.recipe.load import resolve
    from lowmem_ft.rundir import RunDir
    from lowmem_ft.train.measure import exact as exact_module
    from lowmem_ft.train.observe import monitor as monitor_module
    from lowmem_ft.train.run import train

    costs: list[float] = []
    found: dict = {}
    original_sample, original_for = monitor_module.MemoryMonitor.sample, exact_module.ExactMemory.for_recipe

    def sample(self, phase, **extra):
        start = time.perf_counter()
        try:
            return original_sample(self, phase, **extra)
        finally:
            costs.append(time.perf_counter() - start)

    monitor_module.MemoryMonitor.sample = sample
    if way != "exact":  # the monitor without its exact count: the baseline, or another way instead of it
        exact_module.ExactMemory.for_recipe = classmethod(lambda cls, *a, **k: None)
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
        run = RunDir.new(recipe.training.output_dir, name, recipe.model.name_or_path)
        extra = candidate(way, found)
        result = train(recipe, run, callbacks=[extra] if extra else None)
    finally:
        monitor_module.MemoryMonitor.sample = original_sample
        exact_module.ExactMemory.for_recipe = original_for
    runtime = result.metrics["train_runtime"]
    done = result.metrics["global_step"]
    return {
        "steps": done,
        "us_per_sample": statistics.median(costs) * 1e6,
        "step_ms": runtime / done * 1e3,
        "sample_ms_per_step": sum(costs) / done * 1e3,
        "events_per_step": found.get("events", 0) / done,
        "post_s": found.get("post_s"),
    }


def per_operator(iterations: int = 3000) -> list[str]:
    """µs per operator of the dispatch-mode mechanism itself: a loop of 11 small operators (matmul, relu, sum and
    their backward) with no mode, an empty TorchDispatchMode, PeakMemory as shipped, and PeakMemory with torch's
    default `torch._disable_dynamo` wrapper around `__torch_dispatch__` (what `_should_skip_dynamo` avoids)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from lowmem_ft.train.measure.peak import PeakMemory

    class Empty(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class Wrapped(PeakMemory):  # torch wraps a subclass's own __torch_dispatch__ unless told not to
        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return PeakMemory.__torch_dispatch__(self, func, types, args, kwargs)

    x, w = torch.randn(8, 8), torch.randn(8, 8, requires_grad=True)

    def loop() -> float:
        start = time.perf_counter()
        for _ in range(iterations):
            (x @ w).relu().sum().backward()
        return (time.perf_counter() - start) / (iterations * 11) * 1e6

    modes = {"no mode": None, "empty TorchDispatchMode": Empty, "PeakMemory (as shipped)": PeakMemory,
             "PeakMemory with torch's dynamo wrapper": Wrapped}  # fmt: skip
    best: dict[str, float] = {}
    for _ in range(3):  # interleaved, fastest of three
        for name, mode in modes.items():
            if mode is None:
                took = loop()
            else:
                with mode(device="cpu") if mode is not Empty else mode():
                    took = loop()
            best[name] = min(best.get(name, took), took)
    return [f"| {name} | {us:.1f} | {us - best['no mode']:+.1f} |" for name, us in best.items()]


def single(config: int, way: str, steps: int, threads: int, model: Path, out: Path) -> dict:
    """One run in this process (`--single`): each run gets a fresh process, so a way that fails or leaves hooks
    behind (MemTracker on a LoRA model) cannot affect the next, and no run inherits another's caches."""
    import torch

    torch.set_num_threads(threads)
    name, _, sets = CONFIGS[config]
    return timed_run(model, out, f"run{config}-{way}-{time.time_ns()}", sets, steps, way)


def in_subprocess(config: int, way: str, args, model: Path, out: Path) -> dict:
    import json
    import subprocess

    cmd = [
        sys.executable,
        "-m",
        "devkit.bench.monitor_overhead",
        "--single",
        str(config),
        way,
        "--steps",
        str(args.steps),
    ]
    cmd += ["--threads", str(args.threads), "--model", str(model), "--runs", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        errors = [line for line in done.stderr.splitlines() if "Error" in line]
        return {"error": errors[-1] if errors else f"exit code {done.returncode}"}
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m devkit.bench.monitor_overhead", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    parser.add_argument("--repeats", type=int, default=2, help="runs per cell; the fastest counts (shared CPUs)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steady on shared CPUs)")
    parser.add_argument("--out", type=Path, help="also write the table (markdown) here")
    parser.add_argument("--single", nargs=2, metavar=("CONFIG", "WAY"), help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.single:
        import json

        print(json.dumps(single(int(args.single[0]), args.single[1], args.steps, args.threads, args.model, args.runs)))
        return 0

    import torch

    from devkit.tiny import build_tiny_model

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.processor() or 'cpu'})"
    torch.set_num_threads(args.threads)
    op_rows = per_operator()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, config, _) in enumerate(CONFIGS):
            model = build_tiny_model(Path(tmp) / f"model{i}", **config)
            best: dict[str, dict] = {}
            for _ in range(args.repeats):  # ways interleaved, so a busy minute of the machine hits them all
                for way in WAYS:
                    res, old = in_subprocess(i, way, args, model, Path(tmp) / "runs"), best.get(way)
                    if old is None or "error" in old or ("error" not in res and res["step_ms"] < old["step_ms"]):
                        best[way] = res
            rows += table_rows(name, best)
    table = "\n".join(
        [
            f"Monitor and exact-measurement cost on {device}, torch {torch.__version__}, {args.threads} thread(s), "
            f"{time.strftime('%Y-%m-%d')}; `python -m devkit.bench.monitor_overhead --steps {args.steps} --repeats "
            f"{args.repeats}` (fastest of the repeats, each run in its own process)",
            "",
            "| model | measuring | step ms | cost per step ms (vs rss) | µs/sample (median) | sampling ms/step "
            "| profiler events/step | after training |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
            *rows,
            "",
            "Per operator (a loop of 11 small operators, fastest of 3):",
            "",
            "| measuring | µs per operator | added µs per operator |",
            "| --- | --- | --- |",
            *op_rows,
        ]
    )
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n", encoding="utf-8")
    return 0


def table_rows(name: str, best: dict[str, dict]) -> list[str]:
    rows = []
    base = best["rss"]["step_ms"]
    for way in WAYS:
        res = best[way]
        if "error" in res:
            rows.append(f"| {name} | {way} | fails: {res['error']} | | | | | |")
            continue
        extra = res["step_ms"] - base
        post = f"{res['post_s']:.1f} s" if res["post_s"] is not None else "—"
        events = f"{res['events_per_step']:.0f}" if res["events_per_step"] else "—"
        rows.append(
            f"| {name} | {way} | {res['step_ms']:.1f} | {extra:+.1f} ({extra / base:+.0%}) "
            f"| {res['us_per_sample']:.0f} | {res['sample_ms_per_step']:.2f} | {events} | {post} |"
        )
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
