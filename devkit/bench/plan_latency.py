"""How long `lowmem-ft plan` takes, as a user runs it (a fresh process each time): the issue's target is < 0.5 s.

python -m devkit.bench.plan_latency [--repeat 5] [--out benchmarks/plan_latency.md]

The long-context cases make the planner search the saver stages (issue #13); the last two fit nothing, so every
stage is searched before the one-line error (exit 2), and the host-RAM refusal then searches the longest length
that would fit (`planner.max_seq_len`: whole plans, binary search).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CASES = [
    ("Qwen/Qwen-7B", 8, []),
    ("Qwen/Qwen-7B", 24, []),
    ("Qwen/Qwen-7B", 40, []),
    ("meta-llama/Llama-3.1-8B", 24, ["--seq-len", "4096"]),
    ("Qwen/Qwen2.5-72B", 24, ["--gpus", "4"]),
    # the host's RAM given, so the case plans the same on every machine (else this one's available RAM decides)
    ("meta-llama/Llama-3.1-8B", 24, ["--seq-len", "100000", "--host-ram", "64"]),
    ("meta-llama/Llama-3.1-8B", 8, ["--seq-len", "12000"]),
    ("Qwen/Qwen2.5-72B", 24, ["--gpus", "4", "--seq-len", "65536", "--host-ram", "512"]),  # a 4-GPU node's host
    ("meta-llama/Llama-3.1-8B", 8, ["--seq-len", "65536"]),
    # fits the device only with more host RAM than given: the refusal searches the longest length that fits
    ("meta-llama/Llama-3.1-8B", 24, ["--seq-len", "100000", "--host-ram", "16"]),
]
# nothing fits: the one-line error (exit 2)
EXPECTED_EXIT = {
    ("meta-llama/Llama-3.1-8B", 8, ("--seq-len", "65536")): 2,
    ("meta-llama/Llama-3.1-8B", 24, ("--seq-len", "100000", "--host-ram", "16")): 2,
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devkit.bench.plan_latency", description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    # as an installed package runs: from its cached bytecode (compiling lowmem-ft's modules from source, as a
    # PYTHONDONTWRITEBYTECODE environment makes every process do, is ~0.2 s of each run)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    rows = []
    for model, vram, extra in CASES:
        cmd = [sys.executable, "-m", "lowmem_ft", "plan", "--vram", str(vram), "--model", model, "--json", *extra]
        times = []
        for _ in range(args.repeat):
            started = time.perf_counter()
            done = subprocess.run(cmd, capture_output=True, env=env)
            if done.returncode != EXPECTED_EXIT.get((model, vram, tuple(extra)), 0):
                raise SystemExit(f"{' '.join(cmd)} exited {done.returncode}: {done.stderr.decode()[-500:]}")
            times.append(time.perf_counter() - started)
        shown = " ".join(["plan", "--vram", str(vram), "--model", model, *extra])
        line = f"| `{shown}` | {statistics.median(times):.2f} | {max(times):.2f} |"
        rows.append(line)
        print(line, flush=True)
    table = "\n".join(["| command | median s | max s |", "| --- | --- | --- |", *rows])
    if args.out:
        note = (
            f"Wall time of a fresh `python -m lowmem_ft plan ... --json` process (interpreter start included), "
            f"{args.repeat} runs each, `python -m devkit.bench.plan_latency`, with lowmem-ft's bytecode cached as an "
            "installed package has it. Target: < 0.5 s.\n\n"
        )
        Path(args.out).write_text(note + table + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
