"""Other people's GPU measurements, reproduced by tracing their own training step: PEFT's MetaMathQA comparison.

    nice -n 10 python -m devkit.bench.published --check-whole --out benchmarks/published.md   # ~20 min, 2 busy cores
    python -m devkit.bench.published --rewrite --out benchmarks/published.md      # re-render from the cache
    nice -n 10 python -m devkit.bench.published --whole --out /tmp/whole.md       # every trace 28 layers deep
    nice -n 10 .venv-2025-07/bin/python -m devkit.bench.published --generation 2025-07-22 \
        --only full-finetuning--llama-3.2-3B-lr_0.00001      # one generation, in its libraries' environment

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

import argparse
import gc
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).with_name("peft_metamathqa.json")
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
    return max((r for r in published() if r.name == HELD_IN), key=lambda r: r.date)


def _config(layers: int):
    from transformers import AutoConfig

    from lowmem_ft.memory.arch import load_config_dict
    from lowmem_ft.train.trace import layers as trace_layers

    config, _ = load_config_dict("meta-llama/Llama-3.2-3B")
    return trace_layers.truncated(AutoConfig.for_model(**config), layers)


def build(result: Published, config, shadow=None):
    """The publisher's model (`utils.get_model`): bf16 base, fp32 adapters, or the bare model; shape-only under
    `shadow` (a `Shadow`), else with random weights (the tests' real run)."""
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

    import torch
    from transformers import set_seed

    from lowmem_ft.train.measure.peak import PeakMemory
    from lowmem_ft.train.trace.step import Shadow

    shadow = Shadow() if fake else None
    set_seed(0)
    model = build(result, config, shadow)
    vocab = config.vocab_size
    log: list = [("+", "cublas", CUBLAS_WORKSPACE)]  # the first matmul's handle workspace, held for the process
    with shadow or nullcontext():
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)
        model.train()
        with PeakMemory(device="cpu", roots=[model, optimizer.state], log=log) as pm:
            outputs = None
            for i, length in enumerate(lengths):
                ids, mask, labels = batch(vocab, length, seed=i)
                n_items = int(mask.sum())
                optimizer.zero_grad()
                outputs = model(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=n_items)
                outputs.loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                pm.mark(f"step {i}")
                if i in empty_after:
                    log.append(("empty_cache", i, 0))
            del outputs
    del model, optimizer
    gc.collect()
    return log


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
    median = result.mean_row
    seq = [state or median, SHORT, lengths[0], median, SHORT, lengths[1], median]
    empty = emptied_after(every)
    by_depth = {d: replay(run_log(result, _config(d), seq, empty_after=empty)) for d in depths}
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


def _interpolate(points: list[tuple[int, int]], target: int) -> int:
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
        guess = [_interpolate(points, t) for t in targets]
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
    from unittest import mock

    from lowmem_ft.choosing import choose_recipe
    from lowmem_ft.cuda_alloc import ALLOC_CONF
    from lowmem_ft.errors import UserError
    from lowmem_ft.memory.calibration import CUDA_CONTEXT_BYTES

    # PEFT ran torch's default allocator settings: plan as a user who set them (`lowmem_ft.cuda_alloc`)
    with mock.patch.dict(os.environ, {ALLOC_CONF: "expandable_segments:False"}):
        try:
            _, choice = choose_recipe(vram_gb=48.0, recipe=None, overrides=plan_overrides(result), seq_len=length)
        except UserError:  # every knob is given: nothing to change when it does not fit
            return None
    return choice.predicted_peak_gb * GB - CUDA_CONTEXT_BYTES


def _gap(pred: float, pub: float) -> str:
    return f"{(pred - pub) / pub:+.2%}"


HEADER = """# Published GPU runs: PEFT's MetaMathQA memory, reproduced by tracing the publisher's step

Written by `python -m devkit.bench.published --check-whole --out benchmarks/published.md` (run under `nice -n 10`; cached in
`benchmarks/published.json`; `--rewrite` re-renders without tracing). Published: `max_memory_reserved` over the
run (`max`) and the 99th percentile of `memory_reserved` after each step (`p99`), from huggingface/peft
`method_comparison/MetaMathQA/results/*.json` at the commits in `devkit/bench/peft_metamathqa.json` (Llama-3.2-3B,
bf16, 4 rows, no checkpointing, torch AdamW, the model's own loss over full logits, NVIDIA L40S). Predicted: the
publisher's step traced on the CPU on shape-only tensors (on the libraries in `traced with`: today's, torch
{torch}, transformers {transformers}, peft {peft}, unless a generation was traced on its own) and its allocations
replayed through the model of torch's caching allocator, with `empty_cache` where that loop calls it, cut to 2 and 3 decoder layers and extrapolated to 28 (`affine`: the
extrapolation's worst miss at 4 layers). These are predictions, not measurements.

The batch lengths are not published (MetaMathQA cannot be read here): the longest batch's padded length
(**{lmax}** tokens) and the length of the bucket lead that sets the 99th percentile (**{lp99}** tokens) are solved
from the held-in row only (`held in`) and kept for every other row (`held out`). The p99 of the rows run before
PEFT's commit 90d3fc05d (`empty_cache` after every step, not every 10) is set by a shorter lead, solved from that
generation's lora r32 q,v alone (**{lp99s}** tokens; its section below). `alloc`: `memory_allocated` after a step of the run's mean sample length
(published total tokens / samples; no length solved) against the mean of the published `mem allocated avg`: the
static state plus what the loop keeps alive between steps (the bf16 logits and the KV cache in `outputs`).
`memory model`: lowmem-ft's own memory model (`lowmem_ft.memory.estimate`, `loss_impl="hf_full"`, on CUDA, torch's default allocator settings, less
its CUDA context) at the longest batch, against the published max. `plan`: what `lowmem-ft plan --vram 48
--seq-len {lmax}` predicts at PEFT's settings with `--set memory.full_logits_loss=true` (the model's own loss over
full logits; every knob given, so the planner changes none) with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False`
(torch's default allocator settings, which PEFT's runs had), less the CUDA context.

| configuration | published (torch / transformers / peft) | traced with (torch / transformers / peft), empty_cache | row | predicted max GB | published max GB | gap | predicted p99 GB | published p99 GB | gap | predicted alloc GB | published alloc GB | gap | memory model max GB | gap | plan max GB | gap | affine (miss at 4 layers) | trace s |
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|
"""


NOTES = """
## Gaps, by the term that causes them

- **LoRA / rsLoRA on q,v** (+0.5 to +0.7 % max, +0.0 to +0.1 % p99): within the allocator's step-like response
  to the length (the held-in row's reserved figure moves 0.5 GB between 695 and 704 tokens, as the lead step's
  logits do or do not fit a cached block), below the solve's resolution. The oldest generation, traced on its own
  libraries with its every-step loop (the section above), is −0.2 %, whatever step makes AdamW's state.
- **The p99 rests on an assumption** (`SHORT`, the previous bucket's shortest batch, 96 tokens): for the held-in
  row, cut, the p99 lead reserves 19.84 / 20.14 / 21.17 GB at SHORT = 64 / 96 / 160 (the max 22.33 / 22.41 /
  22.40), so the held-out rows' p99 tests their difference from the held-in row at the same SHORT. The previous
  bucket's median, taken as the mean sample length (208), matters less: 150 / 208 / 300 tokens give max 22.41 /
  22.41 / 22.89 GB, p99 19.92 / 20.14 / 20.33 GB.
- **LoRA r10 on the MLP** (max −1.3 %): its longest batch lands on the other side of such a step; p99 +0.2 %.
  Its every-step generation (2025-10-27), traced on its own libraries and loop: +0.3 %.
- **DoRA** (max +0.2 to +0.3 %, p99 +0.1 to +0.2 %, traced whole): cut to 2/3 layers its extrapolation missed
  the 4-layer trace by 0.95 % (its weight-norm temporaries, one fp32 weight per adapted linear, land in different
  cached blocks at each depth) and gave p99 +4.7 %, max −1.7 %; traced whole, both are within 0.3 % (−0.5 % on
  the oldest generation, traced on peft 0.15.2 and its loop).
- **Full fine-tuning** (traced whole; each generation on its own transformers and peft with its loop's
  `empty_cache`, the section above): max −0.2 % and +0.7 % on the two newer generations, +6.0 % on the oldest;
  p99 +3.0 % and +3.3 %. Cut to 2/3 layers it was meaningless (4.5 % miss at 4 layers, max −35 %). What sets the
  reserved figure, after either lead: at the optimizer step AdamW's foreach temporaries (`_foreach_sqrt`, one per
  parameter, 48 MiB per MLP weight) find no cached block that holds them, while the lead's blocks sit cached: after
  the 704-token lead 5.6 GB, mostly the MLP activations' own 44 MiB segments and the fp32 norm inputs' 33 MiB ones.
  After the 599-token lead 5.4 GB: 3.2 GB of it in segments the previous step's gradients held through the
  `empty_cache` (`zero_grad` frees them only at the next step's start, as in run.py; 2.6 GB of 48 MiB ones), split
  by the lead's 37.4 MiB activations and 28.1 MiB norm inputs into pieces under 48 MiB; 1.3 GB the activations'
  own segments. The harness reads `memory_reserved`
  where run.py does: after `optimizer.step()`, before the `empty_cache` and the next `zero_grad`, with this step's
  gradients and `outputs` (bf16 logits, KV cache) alive.
- **Why the oldest generation's full fine-tuning max is 4 % lower** is not found in the Python of torch,
  transformers or peft, nor in the loop. torch's `_multi_tensor_adam`, `Adam._init_group` and `clip_grad_norm_`'s
  foreach path allocate the same in 2.7.1, 2.9.0 and 2.13 (read from their wheels; AdamW is `Adam` with decoupled
  decay in all three, and foreach is its CUDA default in all three). run.py's step and reading are the same in
  every generation; only the `empty_cache` schedule (every step, with `gc.collect()`) differs, and the wiki-loss
  evaluation before training that the newer two run (not traced). Re-enacted: the every-step schedule leaves the
  704-token lead at 38.80 GB on today's libraries; `gc.collect()` changes nothing (the trace frees the same storages
  with the collector off); transformers 4.52.4 adds 0.69 GB (its SDPA path copies the transposed query with
  `.contiguous()`, 16.5 MiB per layer at 704 tokens, and builds a bf16 4-D mask where 4.57 builds a bool one).
  The same re-enactment puts that generation's adapter rows at −0.5 to −0.2 %, so what is left is what only full
  fine-tuning exercises, on torch 2.7's C++ side (autograd's accumulation of every weight's gradient, the caching
  allocator under them and AdamW's temporaries, the CUDA kernels' own allocations), which a CPU trace under torch
  2.13 cannot re-enact. Not resolved.
- **The step that makes AdamW's state** (run.py's first: the first bucket's longest batch, not published) moves the
  full fine-tuning figures: made on a 209 / 599 / 704-token step, the 704-token lead reserves 38.80 / 38.75 /
  38.64 GB but the 599-token lead 38.46 / 39.37 / 38.27 GB, and on a long step the state's own step reserves more
  than any lead (39.41 GB at 704 tokens). So the max holds to 0.4 %, but the p99 (+2.5 to +5.7 %) is within what
  this unknown moves, and the solved 599 tokens sit on a 1.3 to 2.5 GB step of the full fine-tuning figure
  (`benchmarks/published_leads.md`): one length cannot stand for the leads its percentile counts.
  transformers' `caching_allocator_warmup` (`device_map="cuda"` reserves the weights' bytes in one segment
  before loading) is not re-enacted: added by hand to one logged sequence, it moved the figures by 0.1 GB at
  most. Allocated after a step matches to 0.06 %.
- **Allocated after a step** (−0.7 to +0.2 % on the adapter rows): the trace's batch is padded to the mean sample
  length; the published mean is over batches padded to their longest row (a few tokens more).

What this says about lowmem-ft's own memory model is in `docs/published-gpu-runs.md`.
"""


def render_generations(cache: dict) -> str:
    """The rows traced on their own generation's libraries (`--generation`), one line per step length AdamW's
    state was made on: how far that unknown moves the reserved figures."""
    generations = cache.get("generations", {})
    if not generations:
        return ""
    lmax, lp99 = cache["lengths"]
    lines = [
        "\n## Each generation re-enacted, and what the step that makes AdamW's state does\n\n"
        "Traced whole on that generation's transformers and peft (torch is today's: see the notes), with its loop's "
        "`empty_cache` schedule. run.py makes AdamW's state (full fine-tuning: 12.85 GB of bf16 moments) in its first step, the first "
        "bucket's longest batch, whose length is not published; the state's tensors are carved from the blocks that "
        "step left cached and stay for the whole run. The table's rows make it on a step of the mean sample length; "
        f"here also on a step of the two solved lead lengths ({lp99} and {lmax} tokens).\n\n"
        "| configuration | published (torch / transformers / peft) | traced with | empty_cache | state made at (tokens) "
        f"| reserved after that step GB | after the {lmax}-token lead GB | the larger GB | published max GB | gap | "
        f"after the {lp99}-token lead GB | published p99 GB | gap |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    ]
    for result in published():
        gen = generations.get(f"{result.name}@{result.date}")
        if gen is None:
            continue
        loop = "every step" if gen["every"] == 1 else f"every {gen['every']}"
        for state, t in gen["by_state"].items():
            top = max(t["state"], t["first"])  # max_memory_reserved is over the run: the state's step included
            p99 = (
                f"{t['second'] / GB:.2f} | {result.reserved_p99 / GB:.2f} | {_gap(t['second'], result.reserved_p99)}"
                if gen["every"] == EMPTY_CACHE_EVERY
                else f"{t['second'] / GB:.2f} | {result.reserved_p99 / GB:.2f} | not the p99's batch"
            )
            lines.append(
                f"| {result.label} | {result.date}: {result.torch} / {result.transformers} / {result.peft} | "
                f"{gen['traced_with']} | {loop} | {state} | {t['state'] / GB:.2f} | {t['first'] / GB:.2f} | "
                f"{top / GB:.2f} | {result.max_reserved / GB:.2f} | {_gap(top, result.max_reserved)} | {p99} |\n"
            )
    return "".join(lines)


def render(cache: dict) -> str:
    from importlib.metadata import version

    from devkit.bench import published_p99 as every_step  # its section and the every-step rows' p99 cells

    lmax, lp99 = cache["lengths"]
    libs = {p: version(p) for p in ("torch", "transformers", "peft")}
    lines = [HEADER.format(**libs, lmax=lmax, lp99=lp99, lp99s=cache.get(every_step.KEY, {}).get("length", "—"))]
    today = f"{version('torch')} / {version('transformers')} / {version('peft')}"
    generations = cache.get("generations", {})
    for result in published():
        traced = cache["rows"].get(result.name)
        gen = generations.get(f"{result.name}@{result.date}")
        loop = f"every {EMPTY_CACHE_EVERY}"
        if gen is not None:  # traced on its own generation's transformers and peft, with its loop
            traced = gen["by_state"][str(result.mean_row)]
            loop = "every step" if gen["every"] == 1 else f"every {gen['every']}"
        traced_with = f"{gen['traced_with'] if gen else today}, {loop}"
        held = "held in" if result == held_in() else "held out"
        held = "same config, older libraries" if result.name == HELD_IN and result != held_in() else held
        held += ", p99 held in" if f"{result.name}@{result.date}" == every_step.held_in_key(cache) else ""
        libs = f"{result.date}: {result.torch} / {result.transformers} / {result.peft}"
        if traced is None:
            lines.append(f"| {result.label} | {libs} | not traced |" + " |" * 16 + "\n")
            continue
        pmax, pp99 = traced["first"], traced["second"]
        mm, plan = model_reserved(result, lmax), plan_reserved(result, lmax)
        planned = "no plan at 48 GB | —" if plan is None else f"{plan / GB:.2f} | {_gap(plan, result.max_reserved)}"
        p99 = (
            f"{pp99 / GB:.2f} | {result.reserved_p99 / GB:.2f} | {_gap(pp99, result.reserved_p99)}"
            if result.empty_cache_every == EMPTY_CACHE_EVERY
            else every_step.p99_cells(result, cache)
        )
        affine = (
            "whole"
            if traced["affine"] is None and "cut" not in traced
            else f"{traced['affine']:.2%}"
            if "cut" not in traced
            else f"whole ({traced['cut']['affine']:.2%} cut)"
        )
        lines.append(
            f"| {result.label} | {libs} | {traced_with} | {held} | {pmax / GB:.2f} | {result.max_reserved / GB:.2f} | "
            f"{_gap(pmax, result.max_reserved)} | {p99} | {traced['allocated'] / GB:.2f} | "
            f"{result.allocated_avg / GB:.2f} | {_gap(traced['allocated'], result.allocated_avg)} | "
            f"{mm / GB:.2f} | {_gap(mm, result.max_reserved)} | {planned} | "
            f"{affine} | "
            f"{traced['seconds']} |\n"
        )
    check = cache.get("whole_check")
    if check is not None:  # the held-in row's cut traces, checked at full depth
        held = held_in()
        lines.append(
            f"\nThe held-in row traced whole (28 layers) at the solved lengths: max {check['first'] / GB:.2f} GB "
            f"({_gap(check['first'], held.max_reserved)}), p99 {check['second'] / GB:.2f} GB "
            f"({_gap(check['second'], held.reserved_p99)}), live peak {check['requested'] / GB:.3f} GB "
            f"(cut and extrapolated: {cache['rows'][HELD_IN]['requested'] / GB:.3f}).\n"
        )
    return "".join(lines) + render_generations(cache) + every_step.render(cache) + NOTES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/published.md"))
    parser.add_argument("--rewrite", action="store_true", help="re-render the table from the cache, no tracing")
    parser.add_argument("--only", nargs="*", default=None, help="result names to trace (default: every one)")
    parser.add_argument(
        "--check-whole", action="store_true", help="also trace the held-in row whole at the solved lengths"
    )
    parser.add_argument(
        "--whole", action="store_true", help="trace every row and the solve with all 28 layers (about 5 min each)"
    )
    parser.add_argument(
        "--generation",
        metavar="DATE",
        help="trace the rows of the generation published on DATE (with --only: those rows) with its loop, on the "
        "installed libraries (install that generation's transformers and peft first), and only write the cache",
    )
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    cache_path = args.out.with_suffix(".json")
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {"rows": {}}
    if args.generation:
        for result in published():
            if result.date == args.generation and (args.only is None or result.name in args.only):
                key = f"{result.name}@{result.date}"
                cache.setdefault("generations", {})[key] = trace_generation(result, tuple(cache["lengths"]))
                cache_path.write_text(json.dumps(cache, indent=1))
        print(
            f"traced; re-render in lowmem-ft's environment: python -m devkit.bench.published --rewrite --out {args.out}"
        )
        return 0
    if not args.rewrite:
        held = held_in()
        depths = (28,) if args.whole else DEPTHS
        cache["lengths"] = list(solve_lengths(held, cache, depths))
        cache["rows"][HELD_IN] = {k: v for k, v in cache["solve"][-1].items() if k != "lengths"}
        cache_path.write_text(json.dumps(cache, indent=1))
        for result in published():
            if result.name in cache["rows"] or (args.only is not None and result.name not in args.only):
                continue  # one trace per configuration: the generations differ in libraries only
            print(f"tracing {result.label} at lead lengths {cache['lengths']}", flush=True)
            cache["rows"][result.name] = reserved_at(result, tuple(cache["lengths"]), depths)
            cache_path.write_text(json.dumps(cache, indent=1))
        for result in published():
            row = cache["rows"].get(result.name)
            if row is None or "cut" in row or (row["affine"] or 0) <= AFFINE_LIMIT:
                continue
            print(f"tracing {result.label} whole: its extrapolation missed by {row['affine']:.2%}", flush=True)
            whole = reserved_at(result, tuple(cache["lengths"]), depths=(28,))
            cache["rows"][result.name] = {**whole, "cut": row}
            cache_path.write_text(json.dumps(cache, indent=1))
        if args.check_whole and "whole_check" not in cache:
            print(f"tracing {held.label} whole at the solved lengths", flush=True)
            cache["whole_check"] = reserved_at(held, tuple(cache["lengths"]), depths=(28,))
        cache_path.write_text(json.dumps(cache, indent=1))
    text = render(cache)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
