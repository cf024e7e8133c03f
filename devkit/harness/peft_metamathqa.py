"""PEFT's MetaMathQA runs re-enacted: the publisher's training step traced at full size on the CPU and its
allocations replayed through the model of torch's CUDA caching allocator. Used by `devkit.bench.published` (the
table), `devkit.bench.published_leads` (the reserved figure by lead length) and `devkit.bench.published_p99` (the
every-step generations' 99th percentile).

PEFT's method comparison (huggingface/peft, method_comparison/MetaMathQA) trains Llama-3.2-3B in bf16 on an L40S
and records, per configuration, `accelerator_memory_max` (`torch.cuda.max_memory_reserved()` over the whole run)
and the 99th percentile of `torch.cuda.memory_reserved()` read after each training step. The numbers used here,
with their commits, are in `devkit/bench/peft_metamathqa.json`; their code is not copied, its loop is re-enacted:

- the model and adapter as `utils.get_model` builds them: `from_pretrained(dtype=bfloat16)` with transformers'
  default attention (SDPA), `get_peft_model(..., autocast_adapter_dtype=True)` (so the adapters are fp32), or the
  bare model for full fine-tuning;
- its step (`run.py` `train`): `optimizer.zero_grad()` (grads set to None), `outputs = model(**batch,
  num_items_in_batch=...)` — the model's own loss, `ForCausalLMLoss` over the full logits — `loss.backward()`,
  `clip_grad_norm_`, `optimizer.step()` with `torch.optim.AdamW(model.parameters())`, which on CUDA takes its
  foreach path (`torch/optim/optimizer.py` `_default_to_fused_or_foreach`), so it is built with `foreach=True`;
  `outputs` (the bf16 logits) stays alive until the next step's forward returns, as the loop's variable does;
- its batches: 4 rows padded to the longest (right padding, labels −100 after each row's end), sorted longest first
  within buckets of 20 batches (`BucketIterator`), `empty_cache` every 10 steps (every step before PEFT's commit
  90d3fc05d of 2025-11-13). A bucket's longest batch comes first and bucket starts (step 20k + 1) follow an
  `empty_cache`, so the largest reserved figure of the run is that of a longest batch run from a freshly emptied
  cache, with the previous bucket's short batch's logits still alive.

The step is traced at full size on the CPU on shape-only tensors (`lowmem_ft.train.trace.step.Shadow`: data real,
weights and activations fake), its allocation log (`PeakMemory(log=...)`) replayed through the model of torch's CUDA
caching allocator (`lowmem_ft.train.measure.allocator`) with `empty_cache` where the loop calls it. The cuBLAS
workspaces are allocations of that allocator (torch `CublasHandlePool.cpp` allocates them through
`c10::cuda::CUDACachingAllocator`), so they are part of the reserved figure; the CUDA context is not (it is no
allocation), and the publisher subtracts what was reserved at start. The decoder stack is cut to two and three
layers and the replayed figures extrapolated to 28 (`lowmem_ft.train.trace.layers`); a fourth depth checks that
the extrapolation holds (`affine`), and a configuration it misses by more than AFFINE_LIMIT is traced whole
(reserved bytes, unlike live bytes, need not be affine in the depth: benchmarks/allocator.md).

Library generations. PEFT published each configuration from up to three generations of torch / transformers /
peft. `--generation DATE`, run in an environment with that generation's transformers and peft (and today's torch:
no older CPU torch can be installed here), traces that generation's rows whole with its loop's `empty_cache`
schedule and records the libraries it ran on; the table uses such a trace where there is one (the full
fine-tuning rows) and today's libraries on the every-10 schedule elsewhere. Each generation trace is made three
times, with AdamW's state made on a step of the mean sample length and of each solved lead length: run.py makes it
on its first step, the first bucket's longest batch, whose length is not published. What was compared between the
generations, and what was not found, is in the table's notes.

What the published data do not give: the lengths of the batches. MetaMathQA and its tokenizer cannot be read here
(no Hub access), so the one input taken from outside the memory model is the padded length of the run's longest
batch (for the max) and of the batch that sets the 99th percentile: they are solved from ONE held-in result (LoRA
r32 on q,v, the newest generation) and then held fixed for every other row, which is a prediction. Nothing in the
memory model or the allocator is fitted to these numbers; see `docs/published-gpu-runs.md`.
"""

from __future__ import annotations

import gc
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).parents[1] / "bench" / "peft_metamathqa.json"
ROWS = 4  # batch_size
EMPTY_CACHE_EVERY = 10  # run.py ACCELERATOR_EMPTY_CACHE_SCHEDULE
# torch 2.13 aten/src/ATen/cuda/CublasHandlePool.cpp: the default cuBLAS workspace off Hopper is
# ":4096:2:16:8" (2 × 4096 KiB + 8 × 16 KiB = 8,320 KiB), and the cuBLASLt workspace `getCUDABlasLtWorkspaceSize`
# shares it (TORCH_CUBLASLT_UNIFIED_WORKSPACE default) — one allocation through the caching allocator per handle.
CUBLAS_WORKSPACE = (2 * 4096 + 8 * 16) * 1024
GIB = 1 << 30
GB = 1e9


@dataclass(frozen=True)
class Published:
    """One published PEFT result (a row of `peft_metamathqa.json`)."""

    name: str
    label: str
    commit: str
    date: str
    method: str  # "lora", "dora" or "full"
    r: int | None
    lora_alpha: int | None
    target_modules: tuple[str, ...] | None
    use_rslora: bool
    max_reserved: int
    reserved_p99: int
    allocated_avg: int
    total_tokens: int
    samples: int
    empty_cache_every: int
    torch: str
    transformers: str
    peft: str

    @property
    def mean_row(self) -> int:
        """The mean sample length in tokens (run.py counts one end token per sample on top)."""
        return round(self.total_tokens / self.samples) - 1


def published() -> list[Published]:
    rows = json.loads(DATA.read_text())["results"]
    fields = Published.__dataclass_fields__
    return [
        Published(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in row.items() if k in fields})
        for row in rows
    ]


def held_in() -> Published:
    """The one row the batch lengths are solved from: the newest generation of HELD_IN."""
    return newest(HELD_IN)


def newest(name: str) -> Published:
    """The newest generation's published result of a configuration."""
    return max((r for r in published() if r.name == name), key=lambda r: r.date)


def config_at(layers: int):
    from transformers import AutoConfig

    from lowmem_ft.memory.arch import load_config_dict
    from lowmem_ft.train.trace import layers as trace_layers

    config, _ = load_config_dict("meta-llama/Llama-3.2-3B")
    return trace_layers.truncated(AutoConfig.for_model(**config), layers)


def build(result: Published, config, shadow=None, device: str = "cpu"):
    """The publisher's model (`utils.get_model`): bf16 base, fp32 adapters, or the bare model; shape-only under
    `shadow` (a `Shadow`), else with random weights made on `device` (the tests' real run, the GPU check's)."""
    from contextlib import nullcontext

    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    from lowmem_ft.train.trace.step import _fake_tensors_of, _model_class, _state_dict_shapes

    cls = _model_class(config)
    from packaging.version import Version

    # `torch_dtype` became `dtype` in transformers 4.56: an older generation is traced in an environment of its own
    bf16 = {"dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype": torch.bfloat16}
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"  # a dispatch mode is the entering thread's alone
    with shadow or nullcontext():
        if shadow is None:
            with torch.device(device):
                model = cls._from_config(config, **bf16)
        else:
            shapes = _state_dict_shapes(cls, config, torch.bfloat16)
            state = {k: shadow.fake_tensor(s, d) for k, (s, d) in shapes.items()}
            model = cls.from_pretrained(None, config=config, state_dict=state, **bf16)
        if result.method != "full":
            lora = LoraConfig(
                r=result.r,
                lora_alpha=result.lora_alpha,
                target_modules=list(result.target_modules),
                lora_dropout=0.0,
                use_rslora=result.use_rslora,
                use_dora=result.method == "dora",
                task_type="CAUSAL_LM",
            )
            model = get_peft_model(model, lora, autocast_adapter_dtype=True)
    if shadow is not None:
        _fake_tensors_of(model, shadow)
    return model


def batch(vocab: int, length: int, seed: int):
    """A padded batch as run.py makes it: ROWS rows, the longest `length` tokens and the others a little shorter
    (a bucket is sorted), right padding, labels −100 after each row's end token."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (ROWS, length), generator=gen)
    mask = torch.ones_like(ids)
    labels = ids.clone()
    for i in range(1, ROWS):
        mask[i, length - i :] = 0
        labels[i, length - i + 1 :] = -100
    return ids, mask, labels


def run_log(result: Published, config, lengths: list[int], empty_after: set[int], *, fake: bool = True) -> list:
    """The allocation log of the publisher's steps at `lengths` (an `("empty_cache", i, 0)` entry after each step
    index in `empty_after`, a ("mark", "step i", 0) after each step's optimizer step, where run.py reads
    `memory_reserved`) on the model `config` describes: traced on shape-only tensors, or (`fake=False`) run."""
    from contextlib import nullcontext

    from transformers import set_seed

    from lowmem_ft.train.measure.peak import PeakMemory
    from lowmem_ft.train.trace.step import Shadow

    shadow = Shadow() if fake else None
    set_seed(0)
    model = build(result, config, shadow)
    log: list = [("+", "cublas", CUBLAS_WORKSPACE)]  # the first matmul's handle workspace, held for the process
    with shadow or nullcontext():
        optimizer = optimizer_for(model)
        model.train()
        with PeakMemory(device="cpu", roots=[model, optimizer.state], log=log) as pm:
            kept: list = [None, None]
            for i, length in enumerate(lengths):
                step(model, optimizer, kept, length, seed=i)
                pm.mark(f"step {i}")
                if i in empty_after:
                    log.append(("empty_cache", i, 0))
            kept[0] = None  # the last outputs; the last batch stays, as run.py's loop variables do
    del model, optimizer
    gc.collect()
    return log


def optimizer_for(model):
    """run.py's optimizer: torch AdamW (foreach, its CUDA default) with the benchmark's settings."""
    import torch

    return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)


def step(model, optimizer, kept: list, length: int, seed: int, device: str = "cpu") -> None:
    """One step of run.py's training loop on a batch of `length` tokens. `kept` ([outputs, batch]) holds what
    run.py's loop variables do: the step's `outputs` (the logits, the KV cache) through the backward and the
    optimizer step until the next step's forward returns, and its batch until the next one is made."""
    import torch

    kept[1] = ids, mask, labels = tuple(x.to(device) for x in batch(model.config.vocab_size, length, seed))
    n_items = int(mask.sum())
    optimizer.zero_grad()
    kept[0] = model(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=n_items)
    kept[0].loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def replay(log: list) -> dict[str, tuple[int, int, int]]:
    """step mark → (reserved, allocated) bytes after that step (what run.py logs: `memory_reserved`,
    `memory_allocated`) and the peak of requested (live) bytes within the step."""
    from lowmem_ft.train.measure.allocator import Allocator

    alloc = Allocator()
    live, out, window = {}, {}, 0
    for kind, key, nbytes in log:
        if kind == "+":
            if nbytes:
                live[key] = alloc.malloc(nbytes)
                window = max(window, alloc.current.requested)
        elif kind == "-":
            block = live.pop(key, None)
            if block is not None:
                alloc.free(block)
        elif kind == "empty_cache":
            alloc.empty_cache()
        else:
            out[key] = (alloc.current.reserved, alloc.current.allocated, window)
            window = alloc.current.requested
    return out


# The loop around a bucket's lead batch, compressed to the steps that decide what stays reserved: after the
# `empty_cache` that opens the previous bucket's second window, that window's lead (the bucket's median batch, taken
# as the run's mean sample length) fills the cache; its last batch (the bucket's shortest, SHORT) is alive, carved
# from those cached blocks, when the next `empty_cache` runs, so the segment holding it stays reserved while the
# lead runs. SHORT is an assumption (MetaMathQA cannot be read here): its bf16 logits and KV cache are
# 4 × S × 371,200 B, 143 MB at S = 96.
SHORT = 96
# Depths traced (decoder layers of 28): extrapolated from the first two, checked against the third.
DEPTHS = (2, 3, 4)
# A configuration whose extrapolation misses its third depth by more than this is traced whole (28 layers, about
# four minutes): reserved bytes are not affine in the depth when big blocks re-use cached ones differently at each
# depth (full fine-tuning's gradients and optimizer temporaries; see benchmarks/allocator.md).
AFFINE_LIMIT = 0.005


def emptied_after(every: int) -> set[int]:
    """The steps of the traced sequence (see `reserved_at`) after which the publisher's loop empties the cache:
    before each lead, and after the previous bucket's median on the every-10 schedule (so the shortest batch is
    carved from the median's blocks); after every step on the every-step one (run.py before PEFT's 90d3fc05d)."""
    return set(range(7)) if every == 1 else {1, 2, 4}


def lead_sequence(
    result: Published, lengths: tuple[int, int], every: int = EMPTY_CACHE_EVERY, state: int | None = None
) -> tuple[list[int], set[int]]:
    """`reserved_at`'s batch lengths and the steps after which the loop empties the cache: AdamW's state made on a
    step of `state` tokens (default: the mean sample length), then each of `lengths` as a bucket's lead after the
    previous bucket's median and shortest batches, then a batch of the mean sample length."""
    median = result.mean_row
    return [state or median, SHORT, lengths[0], median, SHORT, lengths[1], median], emptied_after(every)


def reserved_at(
    result: Published, lengths: tuple[int, int], depths=DEPTHS, every: int = EMPTY_CACHE_EVERY, state: int | None = None
) -> dict:
    """The publisher's reserved bytes after a bucket's lead batch of each of `lengths` (each preceded by the
    previous bucket's median and shortest batches and an `empty_cache`), then the allocated bytes after a batch of
    the run's mean sample length (what run.py's `mem allocated avg` averages), extrapolated to 28 layers, with
    `empty_cache` after the steps `emptied_after(every)` names. The first step, where AdamW makes its state, is
    `state` tokens long (default: the mean sample length): {"first", "second", "requested": the live bytes' peak
    within the first lead step, "allocated", "state": reserved after the first step, "affine": the worst relative
    miss of the extrapolation at the third depth (None with two), "seconds"}."""
    from lowmem_ft.train.trace.layers import Layers

    started = time.perf_counter()
    seq, empty = lead_sequence(result, lengths, every, state)
    by_depth = {d: replay(run_log(result, config_at(d), seq, empty_after=empty)) for d in depths}
    keys = {"first": ("step 2", 0), "second": ("step 5", 0), "requested": ("step 2", 2), "allocated": ("step 6", 1),
            "state": ("step 0", 0)}  # fmt: skip
    small, large = depths[0], depths[min(1, len(depths) - 1)]

    def at(total: int, mark: str, i: int) -> int:
        if small == total:  # traced whole
            return by_depth[small][mark][i]
        return Layers(total, small, large - small).extrapolate(by_depth[small][mark][i], by_depth[large][mark][i])

    out = {k: at(28, *m) for k, m in keys.items()}
    out["affine"] = None
    if len(depths) > 2:
        out["affine"] = max(abs(at(depths[2], *m) - by_depth[depths[2]][m[0]][m[1]]) / by_depth[depths[2]][m[0]][m[1]]
                            for k, m in keys.items() if k != "state")  # fmt: skip
    out["seconds"] = round(time.perf_counter() - started)
    return out


HELD_IN = "lora--llama-3.2-3B-rank32"  # the newest generation of it: the only row the batch lengths are solved from
GRID = (512, 640)  # the held-in row's first two lead lengths; the solve then traces at its own guesses
SOLVE_ROUNDS = 3
SOLVE_TOLERANCE = 0.003  # stop when the held-in row's traced max and p99 are this close to the published ones


def interpolate(points: list[tuple[int, int]], target: int) -> int:
    """The length at which the reserved figure reaches `target`, linear between the traced lengths that bracket it
    (or the nearest two): reserved bytes rise with the length but in steps (which cached block a tensor lands in
    changes with it), so the solve traces at each guess and interpolates again."""
    pts = sorted(dict(points).items())
    below = [p for p in pts if p[1] <= target] or pts[:1]
    above = [p for p in pts if p[1] > target] or pts[-1:]
    (l0, r0), (l1, r1) = below[-1], above[0]
    if l0 == l1:
        (l0, r0), (l1, r1) = pts[-2], pts[-1]
    return round(l0 + (target - r0) * (l1 - l0) / (r1 - r0))


def solve_lengths(held: Published, cache: dict, depths=DEPTHS) -> tuple[int, int]:
    """The lead lengths whose traced reserved figures are the held-in row's published max and p99 (see the module
    docstring): traced at GRID, then at each interpolated guess, up to SOLVE_ROUNDS times. The traces are kept in
    `cache["solve"]`; the last one is the held-in row's."""
    solve = cache.setdefault("solve", [])
    if not solve:
        solve.append({"lengths": list(GRID), **reserved_at(held, GRID, depths)})
    targets = (held.max_reserved, held.reserved_p99)
    while True:
        points = [(t["lengths"][0], t["first"]) for t in solve] + [(t["lengths"][1], t["second"]) for t in solve]
        last = solve[-1]
        close = all(abs(last[k] - v) / v <= SOLVE_TOLERANCE for k, v in zip(("first", "second"), targets, strict=True))
        if (close and last["lengths"] != list(GRID)) or len(solve) > SOLVE_ROUNDS:
            return tuple(last["lengths"])
        guess = [interpolate(points, t) for t in targets]
        if guess == last["lengths"]:
            return tuple(guess)
        print(f"solving the batch lengths: tracing {held.label} at lead lengths {guess}", flush=True)
        solve.append({"lengths": guess, **reserved_at(held, tuple(guess), depths)})


def libraries() -> str:
    """The installed torch / transformers / peft: what a trace ran on."""
    from importlib.metadata import version

    return " / ".join(version(p) for p in ("torch", "transformers", "peft"))


def trace_generation(result: Published, lengths: tuple[int, int]) -> dict:
    """`result`'s generation re-enacted on the installed libraries (run in an environment with that generation's
    transformers and peft; torch is today's, see `docs/published-gpu-runs.md`): its loop's `empty_cache` schedule,
    traced whole, once with AdamW's state made on a step of the mean sample length (as every row) and once each on
    a step of the two solved lead lengths. run.py's first step, where the state is made, is the first bucket's
    longest batch, whose length the published data do not give; these bound how much that choice moves the
    reserved figures."""
    by_state = {}
    for state in (result.mean_row, lengths[1], lengths[0]):
        print(f"tracing {result.label} ({result.date}) on {libraries()}, state made at {state} tokens", flush=True)
        by_state[str(state)] = reserved_at(result, lengths, (28,), result.empty_cache_every, state)
    return {"traced_with": libraries(), "every": result.empty_cache_every, "by_state": by_state}


def setup_of(result: Published, length: int):
    """The publisher's step as the memory model's `Setup`: the model's own loss over full logits (`hf_full`)."""
    from lowmem_ft.memory.records import Setup

    return Setup(
        quantization="none",
        adapter="full" if result.method == "full" else "lora",
        lora_r=result.r or 16,
        lora_dropout=0.0,
        use_dora=result.method == "dora",
        lora_targets=result.target_modules or (),
        optimizer="adamw_torch",
        gradient_checkpointing=False,
        micro_batch_size=ROWS,
        max_seq_len=length,
        gradient_accumulation=1,
        loss_impl="hf_full",
        device="cuda",
        allocator="default",  # PEFT's run.py leaves PYTORCH_CUDA_ALLOC_CONF unset: torch's default settings
    )


def model_reserved(result: Published, length: int) -> float:
    """The memory model's CUDA peak for the publisher's step, less the CUDA context (no allocation: not in a
    reserved figure, and the publisher subtracts what was reserved at start)."""
    from lowmem_ft.memory.arch import load_architecture
    from lowmem_ft.memory.calibration import CUDA_CONTEXT_BYTES
    from lowmem_ft.memory.estimate import estimate

    arch = load_architecture("meta-llama/Llama-3.2-3B", False)
    return estimate(arch, setup_of(result, length)).peak_bytes - CUDA_CONTEXT_BYTES


def plan_overrides(result: Published) -> dict:
    """PEFT's settings as `lowmem-ft plan --set ...` takes them, with the model's own loss over full logits
    (`memory.full_logits_loss`): every knob given, so the planner changes none."""
    adapter = (
        {"kind": "full"}
        if result.method == "full"
        else {"kind": "lora", "r": result.r or 16, "alpha": result.lora_alpha or 2 * (result.r or 16), "dropout": 0.0,
              "target_modules": list(result.target_modules or ()), "use_rslora": result.use_rslora,
              "use_dora": result.method == "dora"}
    )  # fmt: skip
    return {
        "model": {"name_or_path": "meta-llama/Llama-3.2-3B", "quantization": "none"},
        "adapter": adapter,
        "optimizer": {"name": "adamw_torch"},
        "memory": {"gradient_checkpointing": False, "activation_offloading": False, "micro_batch_size": ROWS,
                   "gradient_accumulation": 1, "full_logits_loss": True, "tiled_norms": False, "tiled_mlp": False,
                   "recompute_lora": False, "embeddings_on_host": False},
    }  # fmt: skip


def plan_reserved(result: Published, length: int) -> float | None:
    """`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False lowmem-ft plan --vram 48 --seq-len LENGTH` at PEFT's
    settings (`plan_overrides`, an L40S's 48 GB; torch's default allocator settings, as PEFT ran): the plan's
    predicted peak less the CUDA context, as `model_reserved`; None when the plan does not fit 48 GB."""
    from lowmem_ft.memory.calibration import CUDA_CONTEXT_BYTES

    planned = plan_at(result, length)
    return None if planned is None else planned[1].predicted_peak_gb * GB - CUDA_CONTEXT_BYTES


def plan_at(result: Published, length: int, expandable: bool = False):
    """(recipe, choice) of `lowmem-ft plan --vram 48 --seq-len LENGTH` at PEFT's settings (`plan_overrides`), with
    torch's default allocator settings (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False, as PEFT ran) or
    (`expandable`) with the expandable segments `train` sets when the user set none; None when it does not fit."""
    from unittest import mock

    from lowmem_ft.choosing import choose_recipe
    from lowmem_ft.cuda_alloc import ALLOC_CONF, ALLOC_CONF_GENERIC
    from lowmem_ft.errors import UserError

    env = {k: v for k, v in os.environ.items() if k not in (ALLOC_CONF, ALLOC_CONF_GENERIC)}
    if not expandable:  # PEFT ran torch's default allocator settings: plan as a user who set them
        env[ALLOC_CONF] = "expandable_segments:False"
    with mock.patch.dict(os.environ, env, clear=True):
        try:
            return choose_recipe(vram_gb=48.0, recipe=None, overrides=plan_overrides(result), seq_len=length)
        except UserError:  # every knob is given: nothing to change when it does not fit
            return None


def gap(pred: float, pub: float) -> str:
    return f"{(pred - pub) / pub:+.2%}"
