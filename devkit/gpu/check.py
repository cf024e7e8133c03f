"""The GPU check of the memory model (issue #15): one command on a lent H200 measures what the estimator predicts.

    bash scripts/gpu_check.sh                      # on the device, carrying .gpukit (docs/development.md, "GPU check")
    bash scripts/gpu_check.sh --cpu-smoke          # here: every step end to end at toy sizes on the CPU
    python -m devkit.gpu.check --analyze RESULTS   # fetched results.jsonl (or its folder) → benchmarks/estimator_gpu.md

Each step runs in a child process with a timeout, so an out-of-memory error, a crash or the deadline loses nothing
before it; each child appends its result as one JSON line to `$OUT/results.jsonl`, and the orchestrator redraws
`$OUT/estimator_gpu.md` (`devkit.gpu.report`) after every step and prints its table last. Steps:

- `env`: versions, the GPU, free scratch space, and the carried packages' requirements against the image.
- `probe`: in a fresh process, the CUDA context (NVML − reserved at idle), what the first cuBLAS / cuBLASLt GEMMs
  keep (in torch's allocator and outside it), and TRL's fused LM head (Triton on CUDA) alone at a real shape.
- `checkpoint`: a random-initialized real-size model — built on the meta device, materialized and filled on the
  GPU (never a CPU fp32 init of 8 B parameters), saved as bf16 safetensors with a locally trained tokenizer, so
  every later step loads it through `from_pretrained` exactly as `train` does (NF4 quantized on load, on the GPU).
- `point`: the estimator harness (`measure_cuda`) at one model × tier under the `--vram` cap: allocated, reserved
  and NVML peaks per phase against `predict`.
- `train`: `lowmem-ft train --vram 24` on the random 7B for two steps, W&B off, beside a 20 Hz sampler of NVML and
  torch's allocator (memory.jsonl resets the peak counters at every sample, so reserved between samples is the
  sampler's); measured peaks against the run's plan.json.
- `context`: the planner's longest trainable context at 24 GB for Llama-3.1-8B (`planner_longest_context`), at most
  `CONTEXT_LIMIT` tokens, one optimizer step of `lowmem-ft train` at that length.
- `calibrate`: `lowmem-ft doctor --calibrate` (`devkit.gpu.calibration`), last of the memory model's steps, so
  the steps above measure it uncalibrated; then every calibration the call recorded (the doctor's and the train
  run's own, as any GPU run records one) is copied to `$OUT/calibration.json` and printed.
- `published`: PEFT's MetaMathQA step run for real (`devkit.gpu.published`), once per allocator setting: LoRA r32
  under PEFT's setting right after the probe, the other three runs at the end; its readings against the harness's
  allocator replay and PEFT's published figures.

Budget on the H200 (ESTIMATES — no device has run this yet; `results.jsonl` records the real times; each is a
setting, `devkit.gpu.settings`): install ~15 s, probe 20 s, a checkpoint 10 s + 2.5 s per billion parameters, a
point 15 s + 1.5 s per billion, train 40 s + 3 s per billion, context 40 s + 4 s per billion, a published run 45 s
(four of them) — about 680 s for everything. The orchestrator starts a step only when that much time is left before
`--deadline` (450 s by default, `LOWMEM_GPU_DEADLINE_S`, counted from the start of gpu_check.sh) and records it as
skipped otherwise, so the kit ends inside the device tool's 10-minute call; the run order puts PEFT's LoRA step, the
small model's tiers, the train run and the context run before the remaining points, and the other published runs
last.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

from devkit.gpu.published import FIRST, LAST
from devkit.gpu.published import SETTINGS as PUBLISHED_SETTINGS
from devkit.gpu.published import environment as published_environment
from devkit.gpu.settings import SETTINGS
from devkit.harness.estimator import Point, measure_cuda, predict, run_point

GB = 1e9
RESULTS = "results.jsonl"
REPORT = "estimator_gpu.md"
RUNS_TAR = "runs.tar"
# Run order: the small model first (every tier early), the train and context runs as soon as their model exists.
MODELS = ("Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-7B", "meta-llama/Llama-3.1-8B", "Qwen/Qwen2.5-1.5B")
TRAIN_MODEL, CONTEXT_MODEL, RUN_VRAM = "Qwen/Qwen2.5-7B", "meta-llama/Llama-3.1-8B", 24
# Harness tiers (the same as devkit/bench/estimator.py --device cuda): vram GB, adapter, micro batch, sequence.
TIERS = ((8, "qlora", 1, 512), (24, "qlora", 2, 2048), (40, "lora", 4, 2048))
# --cpu-smoke: the same steps on tiny shapes (a Qwen2 with tied embeddings and biases, a GQA Llama).
SMOKE_MODELS = {
    "tiny-qwen2": {
        "model_type": "qwen2", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 192,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True,
    },
    "tiny-llama": {
        "model_type": "llama", "vocab_size": 1200, "hidden_size": 96, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2,
    },
}  # fmt: skip
SMOKE_TIERS = ((8, "qlora", 1, 64), (24, "qlora", 2, 48), (40, "lora", 2, 64))
SMOKE_POINTS = ("tiny-qwen2",)  # the harness's code is the same for both: one model's points keep the smoke short
SMOKE_CONTEXT_LIMIT = 256  # the tiny model's longest context at 8 GB would be the planner's 262k ceiling
# With the long-context savers (issue #13) the planner fits Llama-3.1-8B's whole 131,072 positions in 24 GB: one step
# that long is minutes of H200 time (and ~35 GB of pinned host memory), past the context step's budget; 32,768 tokens
# is beyond what fitted without them (~29k), so the run still exercises savers the planner turned on.
CONTEXT_LIMIT = 32768
# (samples, shortest, longest) tokens of the train run's data: p99 ≈ 2,000 → the planner's 2,048 tokens
TRAIN_DATA, SMOKE_TRAIN_DATA = (32, 1536, 2000), (16, 48, 100)
# The knobs the context run fixes: NF4 LoRA (the tier's rank and modules), batch 1; the planner picks the rest.
CONTEXT_FIXED = {"model": {"quantization": "nf4"}, "adapter": {"kind": "lora"}, "memory": {"micro_batch_size": 1}}


# -- the planner, through one adapter (branch core reshapes memory.planner) ------------------------------------------
def planner_longest_context(model: str, vram_gb: float, limit: int = 262144) -> int:
    """The planner's longest trainable max_seq_len for `model` (catalog id or directory) at `vram_gb`, at most
    `limit` and the model's positions: QLoRA, batch 1, every saver as the planner chooses; 0 when nothing fits."""
    from lowmem_ft.longest_context import longest_context

    return longest_context(model, vram_gb, CONTEXT_FIXED, limit=limit)


def context_overrides(seq: int) -> list[str]:
    """`--set` items of the context run: CONTEXT_FIXED, the planned length, one optimizer step of one sample."""
    items = [f"{section}.{key}={value}" for section, keys in CONTEXT_FIXED.items() for key, value in keys.items()]
    return items + [f"memory.max_seq_len={seq}", "memory.gradient_accumulation=1", "training.max_steps=1"]


# -- measuring ------------------------------------------------------------------------------------------------------
@functools.cache
def _nvml_handle():
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception:  # no driver, no library: there is nothing to read
        return None


def nvml_used() -> float | None:
    """Bytes in use on GPU 0 as NVML sees them (all processes, the CUDA context included), or None without NVML."""
    handle = _nvml_handle()
    if handle is None:
        return None
    pynvml, device = handle
    return float(pynvml.nvmlDeviceGetMemoryInfo(device).used)


def cuda_snapshot(before: float) -> dict[str, float]:
    """torch's allocated and reserved bytes now and NVML use minus `before` (this process's share of the card)."""
    import torch

    torch.cuda.synchronize()
    used = nvml_used()
    return {
        "allocated": float(torch.cuda.memory_allocated()),
        "reserved": float(torch.cuda.memory_reserved()),
        "device": (used - before) if used is not None else float("nan"),
    }


class Meter:
    """Allocated bytes now and the peak since `reset`: torch's CUDA allocator, or `PeakMemory` on the CPU."""

    def __init__(self, device: str):
        self.device = device
        self._pm = None

    def __enter__(self):
        if self.device == "cpu":
            from lowmem_ft.train.measure.peak import PeakMemory

            self._pm = PeakMemory(device="cpu").__enter__()
        return self

    def __exit__(self, *exc):
        if self._pm is not None:
            self._pm.__exit__(*exc)

    def now(self) -> int:
        import torch

        return self._pm.live_bytes if self._pm is not None else torch.cuda.memory_allocated()

    def peak(self) -> int:
        import torch

        return self._pm.peak_bytes if self._pm is not None else torch.cuda.max_memory_allocated()

    def reset(self) -> None:
        import torch

        if self._pm is not None:
            self._pm.reset_peak()
        else:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()


class Sampler(threading.Thread):
    """Maxima of NVML use (minus `baseline`) and torch's reserved / allocated bytes, read every `period` seconds."""

    def __init__(self, baseline: float | None, period: float = 0.05):
        super().__init__(daemon=True)
        self.baseline, self.period = baseline, period
        self.peaks = {"device": 0.0, "reserved": 0.0, "allocated": 0.0}
        self.count = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        import torch

        while not self._stop_event.wait(self.period):
            values = {}
            if self.baseline is not None and (used := nvml_used()) is not None:
                values["device"] = used - self.baseline
            if torch.cuda.is_initialized():  # never initialise CUDA from here: train sets the allocator first
                values["reserved"] = float(torch.cuda.memory_reserved(0))
                values["allocated"] = float(torch.cuda.memory_allocated(0))
            for key, value in values.items():
                self.peaks[key] = max(self.peaks[key], value)
            self.count += 1

    def stop(self) -> dict[str, Any]:
        self._stop_event.set()
        self.join()
        return {**self.peaks, "samples": self.count, "period_s": self.period}


def append(results: Path, record: dict[str, Any]) -> None:
    with results.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(record, default=str) + "\n")


# -- step: probe (child) ----------------------------------------------------------------------------------------------
def probe_cublas(before: float) -> dict[str, Any]:
    """What the first GEMMs keep: in torch's allocator (its workspaces are allocator blocks, CublasHandlePool.cpp)
    and outside it (the handles, the kernels' modules), bf16 / fp32 / bf16 with bias (the cuBLASLt path)."""
    import torch

    a, b = (torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    bias = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    a32, b32 = a.float(), b.float()
    out = {}
    for name, fn in (
        ("bf16 mm", lambda: a @ b),
        ("fp32 mm", lambda: a32 @ b32),
        ("bf16 linear + bias (Lt)", lambda: torch.nn.functional.linear(a, b, bias)),
    ):
        s0 = cuda_snapshot(before)
        result = fn()
        del result
        s1 = cuda_snapshot(before)
        out[name] = {
            "kept_allocated": s1["allocated"] - s0["allocated"],
            "kept_outside": (s1["device"] - s1["reserved"]) - (s0["device"] - s0["reserved"]),
        }
    return out


def probe_loss_head(device: str, config: dict[str, Any], batch: int, seq: int) -> dict[str, Any]:
    """TRL's fused LM head alone (the loss SFTTrainer trains with) at `batch × seq`: forward and backward working
    sets measured, beside `memory.estimate.loss_bytes` for the same shape."""
    import torch
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    from lowmem_ft.memory.arch import Architecture
    from lowmem_ft.memory.estimate import Setup, loss_bytes

    arch = Architecture.from_config(config)
    n, v, h = batch * (seq - 1), arch.vocab_size, arch.hidden_size
    gen = torch.Generator(device=device).manual_seed(0)
    with Meter(device) as meter:
        hidden = torch.randn(n, h, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
        weight = torch.randn(v, h, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
        targets = torch.randint(0, v, (n,), device=device, generator=gen)
        meter.reset()
        base = meter.now()
        log_probs, *_ = ChunkedLogProbFunction.apply(
            hidden,
            weight,
            None,
            targets,
            1.0,
            _CHUNKED_LOGPROB_CHUNK_SIZE,
            None,
            1.0,
            ("log_probs", "entropy", "is_top1"),
        )
        forward, kept = meter.peak() - base, meter.now() - base
        loss = -log_probs.sum()
        meter.reset()
        base = meter.now()
        loss.backward()
        backward = meter.peak() - base
    fwd, bwd, source = loss_bytes(arch, Setup(micro_batch_size=batch, max_seq_len=seq, device=device, adapter="lora"))
    return {
        "shape": {"tokens": n, "vocab": v, "hidden": h},
        "measured": {"forward": forward, "kept": kept, "backward": backward},
        "predicted": {"forward": fwd, "backward": bwd, "source": source},
    }


def preflight() -> list[str]:
    """What would make every later step fail, found in seconds: `lowmem-ft doctor`'s real NF4 forward, 8-bit
    optimizer step and SDPA call, the imports training needs, and (on CUDA) bitsandbytes' CUDA library."""
    import torch

    from lowmem_ft.commands.doctor import FAIL, check_attention, check_bnb_4bit, check_bnb_8bit

    failures = [
        f"{c.name}: {c.detail}" for c in (check_bnb_4bit(), check_bnb_8bit(), check_attention()) if c.status == FAIL
    ]
    try:
        import bitsandbytes.cextension
        import datasets  # noqa: F401  (TRL's data path; transformers' Trainer imports it when installed)
        from trl import SFTTrainer  # noqa: F401

        if torch.cuda.is_available() and type(bitsandbytes.cextension.lib).__name__ != "CudaBNBNativeLibrary":
            failures.append(f"bitsandbytes has no CUDA library for CUDA {torch.version.cuda}")
    except Exception as exc:  # an import that fails here fails every training step
        failures.append(f"import: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    return failures


def probe(results: Path, smoke: bool) -> int:
    """The CUDA terms in a fresh process (context first, before anything else touches the device), then the
    preflight; exit code 3 when the preflight fails, so the orchestrator stops before spending the lease."""
    import torch

    before = nvml_used()
    cuda = torch.cuda.is_available()
    record: dict[str, Any] = {"kind": "probe", "device": "cuda" if cuda else "cpu", "torch": torch.__version__}
    try:
        if cuda:
            props = torch.cuda.get_device_properties(0)
            record |= {"gpu": props.name, "total": float(props.total_memory), "cuda": torch.version.cuda}
            record["nvml_idle"] = before
            torch.ones(1, device="cuda")  # creates the context; one 512 B block in the allocator
            record["context"] = cuda_snapshot(before)
            record["cublas"] = probe_cublas(before)
        model = "tiny-qwen2" if smoke else TRAIN_MODEL
        config = SMOKE_MODELS[model] if smoke else catalog_config(model)
        batch, seq = (2, 64) if smoke else (2, 2048)
        record["loss_head"] = {"model": model, **probe_loss_head("cuda" if cuda else "cpu", config, batch, seq)}
    except Exception as exc:  # a probe that breaks is recorded; the preflight still decides whether to go on
        record["error"] = f"{type(exc).__name__}: {exc}"
    record["preflight"] = preflight()
    append(results, record)
    for failure in record["preflight"]:
        print(f"gpu_check preflight: {failure}", file=sys.stderr)
    return 3 if record["preflight"] else 0


# -- step: checkpoint (child) ---------------------------------------------------------------------------------------
def catalog_config(name: str) -> dict[str, Any]:
    from lowmem_ft.memory.arch import catalog_entry

    entry = catalog_entry(name)
    if entry is None:
        raise SystemExit(f"gpu_check: {name} is not in lowmem_ft/catalog/models.json")
    return dict(entry[1]["config"])


def write_checkpoint(config: dict[str, Any], out: Path, device: str) -> dict[str, Any]:
    """A random-initialized model of `config` saved to `out` (bf16 safetensors, config, a local tokenizer, and the
    harness's `lowmem_config.json`), built on the meta device and filled on `device`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from devkit.tiny import build_tokenizer

    started = time.time()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.bfloat16)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives tied parameters separate storage again
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():  # as a fresh model's init: normal(0.02), unit norms, zero bias
            if param.dim() >= 2:
                param.normal_(0.0, 0.02, generator=gen)
            elif "norm" in name:
                param.fill_(1.0)
            else:
                param.zero_()
    built = time.time()
    model.save_pretrained(out, max_shard_size="4GB")
    params = sum(p.numel() for p in model.parameters())
    del model
    tokenizer = build_tokenizer()
    tokenizer.model_max_length = 1 << 20  # the context run's samples are longer than the tiny default
    tokenizer.save_pretrained(out)
    (out / "lowmem_config.json").write_text(json.dumps(config))
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return {"params": params, "bytes": size, "build_s": built - started, "save_s": time.time() - built}


def write_text_data(model_dir: Path, path: Path, samples: int, shortest: int, longest: int, seed: int = 0) -> None:
    """`samples` text records of `shortest`..`longest` tokens of the model directory's tokenizer (words that are
    one token each, so the count is exact before the EOS the data pipeline appends)."""
    import random

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab = [w for w in tokenizer.get_vocab() if w.startswith("Ġ") and w[1:].isalpha()]
    words = [tokenizer.convert_tokens_to_string([w]) for w in vocab]
    words = [w for w in words if len(tokenizer(w, add_special_tokens=False)["input_ids"]) == 1]
    rng = random.Random(seed)
    with path.open("w", encoding="utf-8") as handle:
        for _ in range(samples):
            n = rng.randint(shortest, longest)
            handle.write(json.dumps({"text": "".join(rng.choice(words) for _ in range(n))}) + "\n")


# -- step: point (child) --------------------------------------------------------------------------------------------
def run_points(results: Path, model_dir: Path, name: str, points: list[dict[str, Any]]) -> int:
    """The harness at each point: on CUDA measure_cuda under the point's --vram cap, on the CPU run_point (exact).
    Returns the number of points that failed for a reason other than running out of memory."""
    import torch

    failed = 0
    config = json.loads((model_dir / "lowmem_config.json").read_text())
    cuda = torch.cuda.is_available()
    for spec in points:
        vram = spec.pop("vram")
        p = Point(name, **spec)
        record: dict[str, Any] = {"kind": "point", "model": name, "config": config, "vram": vram, **asdict(p)}
        record |= {"device": "cuda" if cuda else "cpu", "status": "ok"}
        started = time.time()
        try:
            if cuda:
                record["measured"] = measure_cuda(model_dir, p, vram_gb=vram)
            else:
                p = run_point(model_dir, p)
                record["measured"] = {"exact": float(p.measured), "phases": p.phases}
        except torch.OutOfMemoryError as exc:  # under the cap: the prediction said it fits, the card said no
            # loading (from_pretrained quantizes on the device, holding 16-bit tensors meanwhile) or training
            loading = any(f.name in ("build_model", "from_pretrained") for f in traceback.extract_tb(exc.__traceback__))
            record |= {
                "status": "oom",
                "where": "loading" if loading else "training",
                "error": str(exc).splitlines()[0],
            }
            record["measured"] = {"allocated": float(torch.cuda.max_memory_allocated()), "at_oom": True}
        except Exception as exc:  # recorded, and the next point still runs
            record |= {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:300], "measured": {}}
            failed += 1
        est = predict(model_dir, p, device="cuda" if cuda else "cpu")
        record["predicted"] = est.to_dict()
        record["seconds"] = round(time.time() - started, 1)
        append(results, record)
        print(f"point {name} @{vram} GB {p.adapter} {p.batch}×{p.seq}: {record['status']} ({record['seconds']} s)")
    return failed


# -- step: train / context (child) ----------------------------------------------------------------------------------
def run_cli(results: Path, kind: str, run_dir: Path, tar: Path, data: dict[str, Any], argv: list[str]) -> int:
    """`lowmem_ft.cli.main(argv)` — the `lowmem-ft` command — in this process beside a `Sampler`, then its
    plan.json and memory.jsonl against what was sampled, as one record; the run's small files go into `tar`."""
    from lowmem_ft import cli
    from lowmem_ft.rundir import RunDir

    baseline = nvml_used()  # before this process creates its CUDA context
    write_text_data(Path(data["model"]), Path(data["path"]), *data["shape"])
    sampler = Sampler(baseline)
    sampler.start()
    started = time.time()
    error = None
    try:
        rc = cli.main(argv)
    except Exception as exc:  # a crash is a result: record it with what was measured until then
        rc, error = 1, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    sampled = sampler.stop()
    record = {"kind": kind, "rc": rc, "error": error, "seconds": round(time.time() - started, 1), "argv": argv}
    record |= {"nvml_baseline": baseline, "sampled": sampled, **run_dir_summary(run_dir)}
    record["config"] = json.loads((Path(data["model"]) / "config.json").read_text())
    append(results, record)
    with tarfile.open(tar, "a") as archive:
        run = RunDir(run_dir)
        files = (
            run.plan_file,
            run.info_file,
            run.metrics_file,
            run.memory_file(),
            run.recipe_file,
            run.data_report_file,
        )
        for path in files:
            if path.is_file():
                archive.add(path, arcname=f"{kind}/{path.name}")
    return 0 if rc == 0 else 1


def run_dir_summary(run_dir: Path) -> dict[str, Any]:
    """plan.json, the resolved recipe, metrics and memory.jsonl's peaks and events of a run directory."""
    from lowmem_ft.rundir import RunDir

    run = RunDir(run_dir)
    out: dict[str, Any] = {}
    for key, record in (("plan", run.read_plan()), ("metrics", run.read_metrics())):
        if record is not None:
            out[key] = record
    if run.recipe_file.is_file():
        out["recipe"] = run.recipe_file.read_text()
    if run.memory_file().is_file():
        log = run.memory_log()
        samples, events = log.samples, log.events
        keys = ("peak_gb", "allocated_gb", "reserved_gb", "device_used_gb", "rss_gb")
        out["memory"] = {k: max(s[k] for s in samples if k in s) for k in keys if any(k in s for s in samples)}
        out["memory"]["samples"] = len(samples)
        out["events"] = [{k: e.get(k) for k in ("event", "step", "message")} for e in events]
    return out


# -- the orchestrator -----------------------------------------------------------------------------------------------
def pick_scratch(need_bytes: float) -> Path:
    """Where checkpoints and runs go: $GPU_CHECK_SCRATCH, else RAM-backed /dev/shm, else the temp dir, whichever
    first has room for the largest checkpoint."""
    candidates = [os.environ.get("GPU_CHECK_SCRATCH"), "/dev/shm", tempfile.gettempdir()]
    for candidate in filter(None, candidates):
        if os.path.isdir(candidate) and shutil.disk_usage(candidate).free >= need_bytes:
            return Path(tempfile.mkdtemp(prefix="gpu_check_", dir=candidate))
    return Path(tempfile.mkdtemp(prefix="gpu_check_"))


class Check:
    """One run of the kit: its output folder, scratch space, deadline, and the steps as child processes."""

    def __init__(self, out: Path, smoke: bool, deadline_s: float, t0: float, only: set[str], models=MODELS):
        self.out, self.smoke, self.deadline_s, self.t0, self.only = out, smoke, deadline_s, t0, only
        self.model_names = tuple(models)
        self.results = out / RESULTS
        self.scratch = pick_scratch(0 if smoke else 20 * GB)

    def remaining(self) -> float:
        return self.deadline_s - (time.time() - self.t0)

    def note(self, step: str, status: str, seconds: float = 0.0, detail: str = "") -> None:
        append(
            self.results,
            {"kind": "step", "step": step, "status": status, "seconds": round(seconds, 1), "detail": detail},
        )
        print(f"[gpu_check {time.time() - self.t0:5.0f} s] {step}: {status} ({seconds:.0f} s) {detail}", flush=True)

    def child(self, step: str, args: list[str], need_s: float, env: dict[str, str] | None = None) -> str:
        """Run `python -m devkit.gpu.check ARGS` (in `env`, default this process's) if `need_s` seconds are left;
        returns "ok", "exit N", "timeout" or "skipped"."""
        left = self.remaining() - SETTINGS.reserve_s
        if left < need_s:
            self.note(step, "skipped", detail=f"{left:.0f} s left, needs ~{need_s:.0f} s")
            return "skipped"
        started = time.time()
        try:
            rc = subprocess.run([sys.executable, "-m", "devkit.gpu.check", *args], timeout=left, env=env).returncode
            status = "ok" if rc == 0 else f"exit {rc}"
        except subprocess.TimeoutExpired:
            status = "timeout"
        self.note(step, status, time.time() - started)
        self.report()
        return status

    def report(self) -> str:
        from devkit.gpu.report import analyze

        text = analyze(self.results, smoke=self.smoke)
        (self.out / REPORT).write_text(text, encoding="utf-8")
        return text

    def models(self) -> list[tuple[str, dict[str, Any]]]:
        if self.smoke:
            return list(SMOKE_MODELS.items())
        return [(name, catalog_config(name)) for name in self.model_names]

    def run(self) -> int:
        append(self.results, {"kind": "env", **env_record(self.scratch)})
        self.note("env", "ok")
        if "probe" in self.only:
            status = self.child(
                "probe",
                ["probe", "--results", str(self.results), *(["--smoke"] * self.smoke)],
                SETTINGS.probe.seconds(),
            )
            if status == "exit 3":  # the preflight failed: every step would fail the same way
                print(self.report(), flush=True)
                print("gpu_check: stopped after the preflight (see results.jsonl: probe.preflight)", file=sys.stderr)
                return 3
        self.run_published(FIRST)
        train_model, context_model = (*SMOKE_MODELS,) if self.smoke else (TRAIN_MODEL, CONTEXT_MODEL)
        for name, config in self.models():
            wanted = (
                {"points"}
                | ({"train"} if name == train_model else set())
                | ({"context"} if name == context_model else set())
            )
            if not wanted & self.only:
                continue
            params_b = 0.0 if self.smoke else approx_params(config) / 1e9
            model_dir = self.scratch / name.replace("/", "--")
            args = ["checkpoint", "--results", str(self.results), "--name", name, "--dir", str(model_dir)]
            ok = self.child(f"checkpoint {name}", args, SETTINGS.checkpoint.seconds(params_b)) == "ok"
            if ok and name == train_model and "train" in self.only:
                self.run_train(model_dir, params_b)
            if ok and name == context_model and "context" in self.only:
                self.run_context(model_dir, params_b)
            if ok and "points" in self.only and (not self.smoke or name in SMOKE_POINTS):
                self.run_points(name, model_dir, params_b)
            shutil.rmtree(model_dir, ignore_errors=True)
        shutil.rmtree(self.scratch, ignore_errors=True)
        if "calibrate" in self.only:  # last: the grid above is the memory model alone, uncalibrated
            self.child("calibrate", ["calibrate", "--results", str(self.results)], SETTINGS.calibrate.seconds())
        self.run_published(LAST)  # the publisher's loop reads no calibration
        from devkit.gpu.calibration import summary

        print(summary(self.out), flush=True)  # the doctor's and the train run's measurements of this GPU
        print(self.report(), flush=True)
        return 0

    def run_published(self, runs: tuple[tuple[str, str], ...]) -> None:
        """The `published` step's (configuration, allocator setting) `runs`, one child each (the setting is read
        when CUDA starts)."""
        if "published" not in self.only:
            return
        for name, setting in runs:
            args = ["published", "--results", str(self.results), "--name", name, "--setting", setting]
            self.child(f"published {name} ({setting})", [*args, *(["--smoke"] * self.smoke)],
                       SETTINGS.published.seconds(), env=published_environment(setting))  # fmt: skip

    def run_points(self, name: str, model_dir: Path, params_b: float) -> None:
        specs = [
            {
                "vram": vram,
                "adapter": adapter,
                "optimizer": "paged_adamw_8bit",
                "checkpointing": True,
                "batch": b,
                "seq": s,
            }
            for vram, adapter, b, s in (SMOKE_TIERS if self.smoke else TIERS)
        ]
        # on the GPU one process per point (a fresh CUDA context and cap each); the CPU smoke batches them
        groups = [specs] if self.smoke else [[spec] for spec in specs]
        for group in groups:
            label = ", ".join(f"{spec['vram']} GB" for spec in group)
            args = ["point", "--results", str(self.results), "--name", name, "--dir", str(model_dir)]
            self.child(
                f"point {name} @ {label}", [*args, "--points", json.dumps(group)], SETTINGS.point.seconds(params_b)
            )

    def cli_args(self, kind: str, model_dir: Path, data: tuple[int, int, int], tail: list[str]) -> list[str]:
        runs = self.scratch / "runs"
        data_path = self.scratch / f"{kind}.jsonl"
        spec = {"model": str(model_dir), "path": str(data_path), "shape": list(data)}
        vram = "8" if self.smoke else str(RUN_VRAM)
        name = f"gpu-{kind}"
        argv = ["train", "--vram", vram, "--model", str(model_dir), "--data", str(data_path), "--no-wandb"]
        argv += ["--name", name, "--set", f"training.output_dir={runs}", "--set", "training.logging_steps=1", *tail]
        return [
            "cli", "--results", str(self.results), "--kind", kind, "--run-dir", str(runs / name),
            "--tar", str(self.out / RUNS_TAR), "--data", json.dumps(spec), "--", *argv,
        ]  # fmt: skip

    def run_train(self, model_dir: Path, params_b: float) -> None:
        data = SMOKE_TRAIN_DATA if self.smoke else TRAIN_DATA
        tail = ["--set", "training.max_steps=2", "--set", "memory.gradient_accumulation=2"]
        self.child("train", self.cli_args("train", model_dir, data, tail), SETTINGS.train.seconds(params_b))

    def run_context(self, model_dir: Path, params_b: float) -> None:
        vram = 8 if self.smoke else RUN_VRAM
        limit = SMOKE_CONTEXT_LIMIT if self.smoke else CONTEXT_LIMIT
        seq = planner_longest_context(str(model_dir), vram, limit=limit)
        if not seq:
            self.note("context", "skipped", detail=f"the planner fits no length at {vram} GB")
            return
        tail = [x for item in context_overrides(seq) for x in ("--set", item)]
        self.child(
            f"context ({seq} tokens)",
            self.cli_args("context", model_dir, (2, seq + 64, seq + 256), tail),
            SETTINGS.context.seconds(params_b),
        )


def approx_params(config: dict[str, Any]) -> int:
    from lowmem_ft.memory.arch import Architecture

    return Architecture.from_config(config).total_params


def env_record(scratch: Path) -> dict[str, Any]:
    """Versions, the GPU (nvidia-smi), scratch space, and unmet requirements of the carried packages."""
    from importlib.metadata import PackageNotFoundError, version

    names = (
        "torch",
        "transformers",
        "peft",
        "trl",
        "accelerate",
        "datasets",
        "bitsandbytes",
        "triton",
        "huggingface-hub",
        "tokenizers",
        "safetensors",
        "pyarrow",
        "fsspec",
        "regex",
    )
    versions = {}
    for name in names:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    smi = shutil.which("nvidia-smi")
    gpu = ""
    if smi:
        query = [smi, "--query-gpu=name,driver_version,memory.total,memory.used", "--format=csv,noheader"]
        gpu = subprocess.run(query, capture_output=True, text=True).stdout.strip()
    return {
        "python": sys.version.split()[0],
        "versions": versions,
        "gpu": gpu,
        "scratch": str(scratch),
        "scratch_free_gb": round(shutil.disk_usage(scratch).free / GB, 1),
        "unmet": unmet_requirements(),
        "cpus": os.cpu_count(),
    }


def unmet_requirements() -> list[str]:
    """Requirements of the kit's packages (and lowmem-ft's) that the installed versions do not meet."""
    from importlib.metadata import PackageNotFoundError, requires, version

    from packaging.requirements import Requirement

    unmet = []
    for dist in ("transformers", "peft", "trl", "accelerate", "datasets", "bitsandbytes", "multiprocess"):
        try:
            reqs = requires(dist) or []
        except PackageNotFoundError:
            unmet.append(f"{dist}: not installed")
            continue
        for line in reqs:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = version(req.name)
            except PackageNotFoundError:
                unmet.append(f"{dist} needs {req}: missing")
                continue
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                unmet.append(f"{dist} needs {req}: have {have}")
    return unmet


# -- command line ---------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devkit.gpu.check", description=__doc__.splitlines()[0])
    ap.add_argument("--analyze", metavar="RESULTS", help="results.jsonl (or its folder): write the table and constants")
    ap.add_argument("--md", default="benchmarks/estimator_gpu.md", help="with --analyze: where the table goes")
    sub = ap.add_subparsers(dest="step")
    r = sub.add_parser("run", help="every step, as gpu_check.sh runs it")
    r.add_argument("--out", required=True)
    r.add_argument("--cpu-smoke", action="store_true")
    r.add_argument("--deadline", type=float, default=SETTINGS.deadline_s,
                   help=f"seconds from $GPU_CHECK_T0 (default {SETTINGS.deadline_s:g}, LOWMEM_GPU_DEADLINE_S)")  # fmt: skip
    r.add_argument("--only", default="probe,published,points,train,context,calibrate",
                   help="steps to run (comma-separated)")  # fmt: skip
    r.add_argument("--models", default=",".join(MODELS), help="catalog ids, in run order (default: all four)")
    p = sub.add_parser("probe")
    p.add_argument("--results", required=True)
    p.add_argument("--smoke", action="store_true")
    sub.add_parser("calibrate").add_argument("--results", required=True)
    c = sub.add_parser("checkpoint")
    for x in (c, pt := sub.add_parser("point")):
        x.add_argument("--results", required=True)
        x.add_argument("--name", required=True)
        x.add_argument("--dir", required=True)
    pt.add_argument(
        "--points", required=True, help="JSON list of {vram, adapter, optimizer, checkpointing, batch, seq}"
    )
    pb = sub.add_parser("published")
    pb.add_argument("--results", required=True)
    pb.add_argument("--name", required=True)
    pb.add_argument("--setting", required=True, choices=PUBLISHED_SETTINGS)
    pb.add_argument("--smoke", action="store_true")
    cl = sub.add_parser("cli")
    for flag in ("--results", "--kind", "--run-dir", "--tar", "--data"):
        cl.add_argument(flag, required=True)
    cl.add_argument("argv", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)

    if args.analyze:
        from devkit.gpu.report import write_analysis

        return write_analysis(Path(args.analyze), Path(args.md))
    if args.step == "run":
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        t0 = float(os.environ.get("GPU_CHECK_T0") or time.time())
        only = set(args.only.split(","))
        return Check(out, args.cpu_smoke, args.deadline, t0, only, args.models.split(",")).run()
    if args.step == "probe":
        return probe(Path(args.results), args.smoke)
    if args.step == "calibrate":
        from devkit.gpu.calibration import calibrate

        return calibrate(Path(args.results))
    elif args.step == "checkpoint":
        import torch

        config = SMOKE_MODELS.get(args.name) or catalog_config(args.name)
        info = write_checkpoint(config, Path(args.dir), "cuda" if torch.cuda.is_available() else "cpu")
        append(Path(args.results), {"kind": "checkpoint", "model": args.name, **info})
    elif args.step == "published":
        from devkit.gpu.published import measure

        append(Path(args.results), measure(args.name, args.setting, args.smoke))
    elif args.step == "point":
        return 1 if run_points(Path(args.results), Path(args.dir), args.name, json.loads(args.points)) else 0
    elif args.step == "cli":
        tail = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        return run_cli(Path(args.results), args.kind, Path(args.run_dir), Path(args.tar), json.loads(args.data), tail)
    else:
        ap.print_help()
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
