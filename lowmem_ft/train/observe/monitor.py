"""Continuous memory monitoring of a training run: one sample at every phase boundary, into memory.jsonl and W&B.

The one idea: read memory where it changes — after each forward, each backward, each optimizer step, each
evaluation and each checkpoint save — and reset the CUDA peak counter at every sample, so each record's `peak_gb`
is the highest allocation *since the previous sample*: the phase that peaked is known, not guessed.

Figures in decimal GB (1e9 bytes, as `--vram 24` and the memory model speak; every `*_gb` key in memory.jsonl):
- `allocated_gb`, `reserved_gb`, `peak_gb`, `peak_reserved_gb`: torch's caching allocator
  (`torch.cuda.memory_allocated`, `memory_reserved`, `max_memory_allocated`, `max_memory_reserved`);
  `fragmentation_gb` = reserved − allocated.
- `device_used_gb`, `device_total_gb`: NVML, which also sees the CUDA context, other processes and memory torch's
  allocator does not own (bitsandbytes' paged optimizer states live in CUDA unified memory).
- `rss_gb`: host resident set size (psutil) — the only figure without CUDA, so the same code runs on the CPU.
- On the CPU, exactly (`lowmem_ft.train.measure.exact.ExactMemory`, given as `exact`): `live_gb` (live tensor bytes now),
  `peak_live_gb` (their exact peak since the previous sample), and the memory model's prediction of that peak for the
  phase and the batch that ran, `predicted_peak_live_gb`, with the batch as `batch` ([rows, tokens]).

Reading these is host-side bookkeeping (no device synchronisation), so a sample costs microseconds; the measured
overhead is in `benchmarks/monitor_overhead.md` (`python -m devkit.bench.monitor_overhead`).

Several processes (`train --gpus N`): every rank samples its own device. Rank 0 writes `memory.jsonl` (what the
report reads), rank R > 0 writes `memory.rank{R}.jsonl` beside it — one writer per file, so no appends interleave
across processes or nodes — and every record carries `rank`. W&B is rank 0's; at the end of training the ranks
all-gather their run peaks (one collective), which rank 0 logs as `memory/rank{R}/peak_gb` and records in
memory.jsonl as a `rank_peaks` event.

The monitor only observes and records. Whoever decides on memory (the guard, `lowmem_ft.train.resilience.guard`) subscribes
with `watch(fn)` to every sample and records its events through `event`; the monitor never acts. It does report
one observation of its own: allocated memory growing step after step at one phase (a probable leak).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from lowmem_ft.memory.target import Target
from lowmem_ft.train.measure.exact import ExactMemory

log = logging.getLogger(__name__)

GB = 1e9  # decimal, like lowmem_ft.memory.estimate.GB
LEAK_STEPS = 8  # consecutive optimizer steps of growth at one phase before a leak is suspected
LEAK_MIN_GB = 0.064  # ... and at least this much growth: below it, allocator noise (block rounding)
# GRPO's generation and scoring phases belong to the optimizer step in progress too (lowmem_ft.train.methods.grpo)
TRAIN_PHASES = ("forward", "backward", "optimizer", "generation", "scoring")


class MemoryReader:
    """Reads the figures above; without CUDA only `rss_gb`. Call it to get one sample (resets the CUDA peak)."""

    def __init__(self, device: int | None = None):
        import psutil
        import torch

        self._torch = torch
        self._process = psutil.Process(os.getpid())
        # Linux: RSS from a kept-open /proc/self/statm (one pread, ~5 µs) instead of psutil's open/read/close
        # (~70 µs measured on the 2-core CI machine) — the difference is most of a CPU sample's cost.
        self._statm = None
        try:
            self._statm = os.open("/proc/self/statm", os.O_RDONLY)
            self._page = os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            self._statm = None
        self.cuda = torch.cuda.is_available()
        self.device = (torch.cuda.current_device() if device is None else device) if self.cuda else None
        self._nvml = None
        if self.cuda:
            try:
                import pynvml

                pynvml.nvmlInit()
                # torch's own CUDA_VISIBLE_DEVICES → NVML index mapping (torch/cuda/__init__.py, used by
                # torch.cuda.device_memory_used); the handle is kept so a sample is one NVML call.
                index = torch.cuda._get_nvml_device_index(self.device)
                self._nvml = (pynvml, pynvml.nvmlDeviceGetHandleByIndex(index))
            except Exception as exc:  # no NVML (driver/container): the allocator figures still stand
                log.debug("NVML unavailable: %s", exc)

    def _rss(self) -> int:
        if self._statm is not None:
            return int(os.pread(self._statm, 128, 0).split()[1]) * self._page  # fields: size resident shared ...
        return self._process.memory_info().rss

    def __call__(self) -> dict[str, float]:
        out = {"rss_gb": self._rss() / GB}
        if self.cuda:
            cuda = self._torch.cuda
            allocated = cuda.memory_allocated(self.device)
            reserved = cuda.memory_reserved(self.device)
            peak = cuda.max_memory_allocated(self.device)
            peak_reserved = cuda.max_memory_reserved(self.device)
            cuda.reset_peak_memory_stats(self.device)
            out |= {
                "allocated_gb": allocated / GB,
                "reserved_gb": reserved / GB,
                "peak_gb": max(peak, allocated) / GB,
                "peak_reserved_gb": max(peak_reserved, reserved) / GB,
                "fragmentation_gb": (reserved - allocated) / GB,
            }
            if self._nvml is not None:
                pynvml, handle = self._nvml
                info = pynvml.nvmlDeviceGetMemoryInfo(handle)
                out |= {"device_used_gb": info.used / GB, "device_total_gb": info.total / GB}
        return {k: round(v, 5) for k, v in out.items()}


def _held(sample: dict[str, Any]) -> float | None:
    """Tensor bytes a sample holds: the allocator's on CUDA, the exact count on the CPU."""
    return sample.get("allocated_gb", sample.get("live_gb"))


def used_gb(sample: dict[str, Any]) -> float | None:
    """Memory a sample holds against the budget: the allocator's high-water mark plus what NVML sees beyond it
    (CUDA context, other processes, unified memory) — all of it counts against a card of the budget's size."""
    if "reserved_gb" not in sample:
        return None
    held = max(sample["reserved_gb"], sample.get("peak_gb", 0.0))
    beyond = max(0.0, sample.get("device_used_gb", sample["reserved_gb"]) - sample["reserved_gb"])
    return held + beyond


def growth(now: dict[str, Any], then: dict[str, Any]) -> tuple[str, float]:
    """The component that grew most between two samples, and by how much (GB)."""
    parts = {
        "allocated tensors": lambda s: s.get("allocated_gb", 0.0),
        "allocator fragmentation (reserved − allocated)": lambda s: s.get("fragmentation_gb", 0.0),
        "transient peak above allocated": lambda s: s.get("peak_gb", 0.0) - s.get("allocated_gb", 0.0),
        "memory outside torch's allocator (NVML)": lambda s: (
            max(0.0, s.get("device_used_gb", 0.0) - s.get("reserved_gb", 0.0)) if "device_used_gb" in s else 0.0
        ),
    }
    name, grew = max(((n, f(now) - f(then)) for n, f in parts.items()), key=lambda kv: kv[1])
    return name, grew


def breakdown(sample: dict[str, Any]) -> str:
    """One line of the memory figures of a sample, for error messages."""
    keys = [
        ("allocated_gb", "allocated"),
        ("reserved_gb", "reserved"),
        ("fragmentation_gb", "fragmentation"),
        ("device_used_gb", "device used"),
        ("rss_gb", "host RSS"),
    ]
    parts = [f"{label} {sample[k]:.2f} GB" for k, label in keys if k in sample]
    if "device_total_gb" in sample:
        parts[-1:-1] = [f"device total {sample['device_total_gb']:.2f} GB"]
    return ", ".join(parts)


class MemoryMonitor(TrainerCallback):
    """Samples memory at phase boundaries into a memory file and W&B `memory/*`.

    Args:
        path: the memory file (`RunDir.memory_file(rank)`), appended to, so a resumed run continues its curve.
        predicted_peak_gb: the planner's prediction, recorded next to the measurement.
        target: the memory the run must fit (VRAM, margin, budget = VRAM − margin); None without one.
        reader: returns one sample's figures; `MemoryReader()` by default (tests pass synthetic ones).
        exact: on the CPU, the exact live tensor bytes and their prediction (`ExactMemory`); None: not measured.
        use_wandb: log to the active W&B run (transformers' WandbCallback starts it).
        write: write the memory file at all.
        rank, world_size: this process in a multi-process run (default: torchrun's RANK / WORLD_SIZE).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        predicted_peak_gb: float | None = None,
        target: Target | None = None,
        reader: Callable[[], dict[str, float]] | None = None,
        exact: ExactMemory | None = None,
        use_wandb: bool = False,
        write: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
    ):
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        self.world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
        self.path = Path(path)
        self._tag = {"rank": self.rank} if self.world_size > 1 else {}  # single process: records as before
        self._tags: dict[str, Any] = {}  # fields a decider asked to carry on every sample (`tag`)
        self.run_peak_gb = 0.0
        self.predicted_peak_gb = predicted_peak_gb
        self.target = target
        self.reader = reader or MemoryReader()
        self.exact = exact
        self.use_wandb = use_wandb
        self.write = write
        self.state = None
        self._file = None
        self._t0 = time.perf_counter()
        self._step_samples: list[dict[str, Any]] = []
        self._by_phase: dict[str, list[float]] = {}  # allocated at the last sample of each step, per phase
        self._leak_warned: set[str] = set()
        self._watchers: list[Callable[[dict[str, Any]], None]] = []
        self.events: list[dict[str, Any]] = []
        self._hooks: list = []
        self._paused = False

    @contextlib.contextmanager
    def paused(self, exact: bool = True):
        """No per-forward samples inside: GRPO's generation and scoring passes are marked as phases of their own
        (a full model's `generate` runs its forward once per token), its training forward after its loss.
        `exact`: the exact count ignores the forwards inside too (they are not training forwards)."""
        was, self._paused = self._paused, True
        counted = self.exact.paused if self.exact is not None else False
        if self.exact is not None and exact:
            self.exact.paused = True
        try:
            yield
        finally:
            self._paused = was
            if self.exact is not None:
                self.exact.paused = counted

    def watch(self, fn: Callable[[dict[str, Any]], None]) -> None:
        """Call `fn(record)` with every sample, after it is recorded."""
        self._watchers.append(fn)

    def tag(self, **fields: Any) -> None:
        """Carry these fields on every later sample (e.g. the guard's current micro batch)."""
        self._tags.update(fields)

    # -- recording ------------------------------------------------------------------------------------------------
    def _write(self, record: dict[str, Any]) -> None:
        if not self.write:
            return
        try:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = self.path.open("a", encoding="utf-8")
            self._file.write(json.dumps(record) + "\n")
        except OSError as exc:
            raise self._failed(exc) from exc

    def _flush(self) -> None:
        if self._file is None:
            return
        try:
            self._file.flush()
        except OSError as exc:
            raise self._failed(exc) from exc

    def _failed(self, exc: OSError) -> OSError:
        """The error of a failed write, naming the memory file (a full disk's ENOSPC from `write` names none)."""
        return OSError(exc.errno, exc.strerror or str(exc), str(self.path))

    def _step(self, phase: str) -> int:
        """The optimizer step a sample belongs to: the one in progress for train phases, the finished one after."""
        done = self.state.global_step if self.state is not None else 0
        return done + 1 if phase in TRAIN_PHASES else done

    def sample(self, phase: str, **extra: Any) -> dict[str, Any]:
        """Read memory now, record it and hand it to the watchers; returns the record."""
        record = {"step": self._step(phase), "phase": phase, "t": round(time.perf_counter() - self._t0, 4)}
        record |= self._tag
        record |= self._tags
        record |= self.reader()
        if self.exact is not None:
            record |= self.exact.read(phase)
        record |= extra
        self.run_peak_gb = max(self.run_peak_gb, record.get("peak_gb", record.get("rss_gb", 0.0)))
        self._write(record)
        self._step_samples.append(record)
        for fn in self._watchers:
            fn(record)
        return record

    def event(self, kind: str, message: str, level: int = logging.WARNING, **info: Any) -> dict[str, Any]:
        """Record something that happened (OOM recovered, margin warning, leak) in memory.jsonl, W&B and the log."""
        step = info.pop("step", None) or self._step("forward")  # default: the step in progress
        record = {"event": kind, "step": step, "t": round(time.perf_counter() - self._t0, 4), **self._tag}
        record |= info
        record["message"] = message
        self.events.append(record)
        self._write(record)
        self._flush()
        log.log(level, message)
        run = self._wandb_run()
        if run is not None:
            counts: dict[str, int] = {}
            for e in self.events:
                counts[e["event"]] = counts.get(e["event"], 0) + 1
            run.summary[f"memory/events/{kind}"] = counts[kind]
            run.log({f"memory/events/{kind}": counts[kind], "train/global_step": record["step"]})
        return record

    def close(self) -> None:
        if self.exact is not None:
            self.exact.stop()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self._file is not None:
            handle, self._file = self._file, None
            try:
                handle.close()
            except OSError as exc:
                raise self._failed(exc) from exc

    # -- model hooks ----------------------------------------------------------------------------------------------
    def attach(self, model) -> None:
        """Sample at the end of every forward (train micro batches and eval batches alike)."""

        def after_forward(module, args, output):
            if self._paused:
                return
            self.sample("forward" if module.training else "eval_forward")

        self._hooks.append(model.register_forward_hook(after_forward))

    # -- leaks ----------------------------------------------------------------------------------------------------
    def headroom_gb(self, sample: dict[str, Any]) -> float | None:
        """Budget (VRAM − margin) less the memory a sample holds: below zero, the run is inside its safety margin."""
        used = used_gb(sample)
        if used is None or self.target is None:
            return None
        return self.target.budget_gb - used

    def _check_leak(self) -> None:
        last: dict[str, dict[str, Any]] = {}
        for s in self._step_samples:
            if s["phase"] in TRAIN_PHASES and _held(s) is not None:
                last[s["phase"]] = s
        for phase, s in last.items():
            series = self._by_phase.setdefault(phase, [])
            series.append(_held(s))
            del series[: -(LEAK_STEPS + 1)]
            if phase in self._leak_warned or len(series) <= LEAK_STEPS:
                continue
            rising = all(b > a for a, b in zip(series, series[1:], strict=False))
            if rising and series[-1] - series[0] >= LEAK_MIN_GB:
                self._leak_warned.add(phase)
                what = "allocated" if "allocated_gb" in s else "live tensor"
                self.event(
                    "leak",
                    f"{what} memory after {phase} grew in each of the last {LEAK_STEPS} steps "
                    f"({series[0]:.2f} → {series[-1]:.2f} GB): something keeps tensors alive across steps "
                    "(a loss kept with its graph, an ever-growing list of outputs?)",
                    step=self.state.global_step,
                    phase=phase,
                    from_gb=series[0],
                    to_gb=series[-1],
                )

    # -- W&B --------------------------------------------------------------------------------------------------------
    def _wandb_run(self):
        if not self.use_wandb or self.rank != 0:  # one W&B run: rank 0's (it carries the other ranks' peaks)
            return None
        try:
            import wandb
        except ImportError:
            return None
        return wandb.run

    def _log_step(self, step: int) -> None:
        samples = [s for s in self._step_samples if s["step"] == step]
        run = self._wandb_run()
        if not samples or run is None:
            return
        metrics: dict[str, float] = {"train/global_step": step}
        keys = ("peak_gb", "reserved_gb", "device_used_gb", "rss_gb", "fragmentation_gb", "live_gb", "peak_live_gb")
        for key in (*keys, "predicted_peak_live_gb"):
            values = [s[key] for s in samples if key in s]
            if values:
                metrics[f"memory/{key}"] = max(values)
        for s in samples:  # allocated at each phase boundary: the sawtooth's corners
            if "allocated_gb" in s:
                metrics[f"memory/allocated_gb/{s['phase']}"] = s["allocated_gb"]
        headrooms = [h for h in map(self.headroom_gb, samples) if h is not None]
        if headrooms:
            metrics["memory/headroom_gb"] = min(headrooms)
        if "micro_batch" in samples[-1]:
            metrics["memory/micro_batch"] = samples[-1]["micro_batch"]
        run.log(metrics)

    # -- TrainerCallback ------------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.state = state
        self._write(
            {
                "event": "start",
                "step": state.global_step,
                **self._tag,
                "predicted_peak_gb": self.predicted_peak_gb,
                **(self.target.to_dict() if self.target is not None else {"vram_gb": None, "budget_gb": None}),
                "cuda": "allocated_gb" in self.reader(),
                **(self.exact.start_fields() if self.exact is not None else {}),
                **self._tags,
            }
        )
        if model is not None and not self._hooks:
            self.attach(model)
        if model is not None and self.exact is not None:
            self.exact.start(model, optimizer)

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.sample("optimizer")

    def on_step_end(self, args, state, control, **kwargs):
        self._check_leak()
        self._log_step(state.global_step)
        self._step_samples = [s for s in self._step_samples if s["step"] > state.global_step]
        self._flush()

    def on_evaluate(self, args, state, control, **kwargs):
        self.sample("eval")

    def on_save(self, args, state, control, **kwargs):
        self.sample("save")

    def rank_peaks(self) -> list[float] | None:
        """Every rank's run peak (GB; host RSS without CUDA), all-gathered: call on all ranks together."""
        from torch import distributed as dist

        if self.world_size <= 1 or not (dist.is_available() and dist.is_initialized()):
            return None
        peaks: list[float] = [0.0] * dist.get_world_size()
        dist.all_gather_object(peaks, self.run_peak_gb)
        return peaks

    def on_train_end(self, args, state, control, **kwargs):
        peaks = self.rank_peaks()
        if peaks is not None and self.rank == 0:
            self.event(
                "rank_peaks",
                "memory peak per rank: " + ", ".join(f"rank {r} {p:.2f} GB" for r, p in enumerate(peaks)),
                level=logging.INFO,
                step=state.global_step,
                peaks_gb=peaks,
            )
            run = self._wandb_run()
            if run is not None:
                for r, p in enumerate(peaks):
                    run.summary[f"memory/rank{r}/peak_gb"] = p
        run = self._wandb_run()
        if run is not None and self.write:
            from lowmem_ft.report import summarize
            from lowmem_ft.rundir import RunDir

            self._flush()
            log_ = RunDir(self.path.parent).memory_log(self.rank)
            summary = summarize(log_.start, log_.samples, log_.events)
            for key in ("measured_peak_gb", "peak_phase", "peak_step"):
                if summary.get(key) is not None:
                    run.summary[f"memory/{key}"] = summary[key]
            for key in ("measured_gb", "predicted_gb", "error", "planned_gb"):  # CPU: exact vs the memory model
                if summary.get("exact", {}).get(key) is not None:
                    run.summary[f"memory/exact/{key}"] = summary["exact"][key]
