"""What the CUDA caching allocator would reserve for real-size plans: the traced step's allocations replayed through
`lowmem_ft.train.measure.allocator` (a model of torch 2.13's DeviceCachingAllocator), beside the memory model's allowance.

    nice -n 10 python -m devkit.bench.allocator --out benchmarks/allocator.md             # the default rows
    python -m devkit.bench.allocator --rows meta-llama/Llama-3.1-8B:24 --out /tmp/a.md

Each row: the plan `lowmem-ft plan --model M --vram T` chooses, traced (`lowmem_ft.train.trace.step.allocation_log`: the
real step at full size, no weights: two optimizer steps with an accumulation window, then the evaluation forward)
with its decoder stack cut to three depths n, n + p, n + 2p (p the layers' period), each log replayed with the
default allocator settings and with `expandable_segments:True`; the peaks are extrapolated to the model's depth
from the first two depths (as `lowmem_ft.train.trace.layers` does for live bytes) and the third checks whether the
replayed figures are affine in the depth (`affine check`). Live bytes are affine; reserved bytes are not quite
(the slack of cached blocks that a shallow model leaves is filled as layers are added), so `--whole` traces the
whole model (minutes) and also replays it held to the card's capacity. These are predictions of a model of the
allocator, not measurements on a GPU. Rows are cached in the `.json` beside `--out`; `--rewrite` only rewrites
the table.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from lowmem_ft.memory.estimate import GB

ROWS = (("Qwen/Qwen2.5-0.5B", 8.0), ("Qwen/Qwen2.5-0.5B", 24.0), ("meta-llama/Llama-3.1-8B", 24.0))
MODES = {"default": {}, "expandable": {"expandable_segments": True}}


def replayed(log: list, capacity: int | None = None) -> dict[str, dict[str, list[int]] | str]:
    """mode → phase mark → the peaks (requested, allocated, reserved) within the window that mark closes; with a
    `capacity`, also the default allocator held to it ("capacity"; "out of memory" when it fails)."""
    from lowmem_ft.train.measure.allocator import Allocator, ReplayOutOfMemory

    modes = dict(MODES, **({"capacity": {"capacity": capacity}} if capacity else {}))
    out = {}
    for mode, kw in modes.items():
        try:
            windows = Allocator(**kw).replay(log)
        except ReplayOutOfMemory as exc:
            out[mode] = f"out of memory: {exc}"
            continue
        out[mode] = {k: [w.requested, w.allocated, w.reserved] for k, w in windows.items() if k != "total"}
    return out


def capacity_of(vram_gb: float) -> int:
    """What the allocator may reserve on a card of `vram_gb`: less the CUDA context and cuBLAS workspaces, the
    memory model's own figures for what lies outside the allocator (`lowmem_ft.memory.calibration`)."""
    from lowmem_ft.memory.calibration import CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES

    return int(vram_gb * GB - CUDA_CONTEXT_BYTES - CUBLAS_WORKSPACE_BYTES)


def allowance(recipe) -> dict[str, float]:
    """The memory model's allocator term for the plan on a GPU (`lowmem_ft.memory.overheads`, bytes), per allocator
    setting: mode → bytes."""
    from dataclasses import replace

    from lowmem_ft.choosing import setup_from_recipe
    from lowmem_ft.memory.arch import load_architecture
    from lowmem_ft.memory.estimate import estimate
    from lowmem_ft.memory.overheads import allocator_component_bytes

    arch = load_architecture(recipe.model.name_or_path, recipe.model.trust_remote_code)
    s = setup_from_recipe(recipe, device="cuda")
    settings = {"default": "default", "expandable": "expandable segments"}
    return {
        m: allocator_component_bytes(estimate(arch, replace(s, allocator=a)).components) for m, a in settings.items()
    }


def reprice(cache: dict) -> None:
    """Each row's allowance as the memory model has it now, for the plan the row traced (its recipe made again;
    a row whose plan the planner no longer chooses keeps the allowance it was traced with)."""
    from devkit.bench.real_size import _plan

    for key, e in cache.items():
        model, vram, *_ = key.split("|")
        recipe, _, what = _plan(model, float(vram), None)
        if what == e["plan"]:
            e["allowance"] = allowance(recipe)


def entry(model: str, vram: float, whole: bool = False) -> dict:
    """The row's plan, its three depths' replayed peaks (or, `whole`, the whole model's, also held to the card's
    capacity) and the model's allowance: what the cache keeps."""
    from devkit.bench.real_size import _plan
    from lowmem_ft.train.args import eval_batch_size
    from lowmem_ft.train.model import torch_dtype
    from lowmem_ft.train.trace import layers as trace_layers
    from lowmem_ft.train.trace.step import _model_class, allocation_log, model_config

    recipe, _, what = _plan(model, vram, None)
    config = model_config(recipe)
    depth = None if whole else trace_layers.plan(_model_class(config), config, torch_dtype(recipe.model.compute_dtype))
    total = config.get_text_config().num_hidden_layers
    depths = [None] if depth is None else [depth.first + k * depth.period for k in range(3)]
    started = time.perf_counter()
    runs = {}
    for n in depths:
        log = allocation_log(recipe, config, n, eval_rows=eval_batch_size(recipe))
        runs[str(n or total)] = replayed(log, capacity_of(vram) if n is None else None)
        del log
    return {
        "plan": what,
        "layers": total,
        "period": depth.period if depth else None,
        "runs": runs,
        "allowance": allowance(recipe),
        "seconds": round(time.perf_counter() - started),
    }


QUANTITIES = ("requested", "allocated", "reserved")


def at_depth(e: dict, mode: str, quantity: str, train: bool = False) -> tuple[float, float | None]:
    """(the run's peak of `quantity` at the model's depth, the affine check: how much the third depth's per-period
    bytes differ from the first period's, relatively — 0 when the figure is affine in the depth);
    `train`: the training step's windows only (not the evaluation forward). Each phase window is extrapolated on its
    own and the largest taken: the phase that peaks can change with depth (a wide eval batch outweighs two layers'
    training step, not 24 layers')."""
    q = QUANTITIES.index(quantity)
    depths = sorted(int(n) for n in e["runs"])
    windows = {n: e["runs"][str(n)][mode] for n in depths}
    labels = [k for k in windows[depths[0]] if not (train and k == "eval")]
    if len(depths) == 1:
        return max(windows[depths[0]][k][q] for k in labels), None
    n0, n1, n2 = depths
    best, check = None, None
    for k in labels:
        f0, f1, f2 = (windows[n][k][q] for n in depths)
        value = f0 + (e["layers"] - n0) // (n1 - n0) * (f1 - f0)
        if best is None or value > best:  # the change of the per-period bytes from one period to the next
            best, check = value, (f2 - 2 * f1 + f0) / (f1 - f0) if f1 != f0 else 0.0
    return best, check


def row(key: str, e: dict) -> str:
    model, vram, *whole = key.split("|")
    model += " (whole)" if whole else ""
    t_req, _ = at_depth(e, "default", "requested", train=True)
    t_res, _ = at_depth(e, "default", "reserved", train=True)
    req, _ = at_depth(e, "default", "requested")
    alloc, _ = at_depth(e, "default", "allocated")
    res, check = at_depth(e, "default", "reserved")
    exp, check_exp = at_depth(e, "expandable", "reserved")
    checks = "traced whole" if check is None else f"{check:+.2%} / {check_exp:+.2%}"
    held = e["runs"][next(iter(e["runs"]))].get("capacity")
    a = e["allowance"]
    allowed = f"{a / GB:.3f}" if isinstance(a, float) else f"{a['default'] / GB:.3f} / {a['expandable'] / GB:.3f}"
    if held is None:
        capped = "not replayed (cut models)"
    elif isinstance(held, str):
        capped = "**out of memory** (the CPU path's log: see the notes)"
    else:
        capped = f"{max(w[2] for w in held.values()) / GB:.3f} of {capacity_of(float(vram)) / GB:.3f}"
    return (
        f"| {model} | {vram} | {e['plan']} | {t_req / GB:.3f} | {t_res / GB:.3f} ({t_res / t_req:.3f}) "
        f"| {req / GB:.3f} | {alloc / GB:.3f} | {res / GB:.3f} ({res / req:.3f}) | {exp / GB:.3f} ({exp / req:.3f}) "
        f"| {(res - req) / GB:.3f} | {allowed} | {capped} | {checks} | {e['seconds']} |"
    )


HEADER = """# The caching allocator on real-size plans: replayed reserved against live bytes

Written by `python -m devkit.bench.allocator`. The traced step's allocation log (every storage's allocation and
free, in order: `lowmem_ft.train.trace.step.allocation_log`) replayed through `lowmem_ft.train.measure.allocator`, a model of
torch 2.13's CUDA caching allocator written from c10/cuda/CUDACachingAllocator.cpp — **predicted, not measured on a
GPU**. Whole run: two optimizer steps (accumulation 1, then 2 at the full batch) and the evaluation forward.
`requested` = peak live tensor bytes (the trace's own figure); `allocated` = peak of the blocks handed out
(`max_memory_allocated`: 512 B rounding and unsplit remainders); `reserved` = peak of the segments held
(`max_memory_reserved`, default settings) and with `expandable_segments:True`; `model allowance` = the memory
model's allocator term for the plan with the default settings / with expandable segments (a base plus a fraction
of the transient peak and gradients, derived in `benchmarks/allocator_term.md`; `lowmem_ft/memory/overheads.py`),
which is meant to cover reserved − requested; it is repriced by `--rewrite`. `train step` = the two optimizer steps alone; `run` = with the
evaluation forward after them. `reserved held to the card` (whole traces only) = the reserved peak when the
allocator may hold no more than the card less the CUDA context and cuBLAS workspaces (its release-and-retry then
frees cached whole segments), of that capacity. Rows without "(whole)" are extrapolated in depth from two cut
models; `affine check` = how much the reserved bytes one period adds change from the first period to the second
(default / expandable; 0 % when affine), a measure of how far that extrapolation can be trusted. Not in any
figure: CUDA context, cuBLAS workspaces, kernels' internal workspaces, and what the CPU trace does not take on a
GPU (see the notes).

| model | vram | plan | train step: requested GB | train step: reserved GB (÷ requested) | run: requested GB | run: allocated GB | run: reserved GB (÷ requested) | run: expandable reserved GB (÷ requested) | run: reserved − requested GB | model allowance GB (default / expandable) | reserved held to the card | affine check | s |
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|
"""


NOTES = """
## Notes

- **Which column is the product's.** `train` sets `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` unless the
  user set it (`lowmem_ft/train/device.py`), so `expandable reserved` is what a lowmem-ft run would reserve; the
  default-settings columns are for a user who overrides it.
- **With expandable segments, reserved is within 1–2 % of live**, evaluation included: Llama-3.1-8B at 24 GB
  (whole) 23.840 GB for 23.651 live (×1.008, +0.19 GB), Qwen2.5-0.5B at 8 GB (whole) 5.247 for 5.180 (×1.013,
  +0.07 GB). The memory model allows 0.197 and 0.129 GB for the allocator there (derived from replays of other
  steps, `benchmarks/allocator_term.md`; 0.420 and 0.243 with the 10 % assumed before).
- **With the default settings the training step alone reserves ×1.04–1.05**: Llama-3.1-8B 24.753 GB for 23.651
  (+1.10 GB, the allowance is 0.420), Qwen2.5-0.5B 5.377 for 5.180 (+0.20 GB, allowance 0.243). Most of it appears
  at the full-size micro batch (forward 2.2): its activations and the LM head's tiles do not fit the blocks the
  short warm-up steps left cached, so new segments are cut beside them. Evaluation after training has no cached
  block of its sizes either: without a limit the allocator keeps the training segments and adds the evaluation's
  (Llama-3.1-8B 26.632 GB, Qwen2.5-0.5B 7.575 GB). Held to the card, cudaMalloc fails first and the allocator frees
  its whole cached segments and retries: Qwen2.5-0.5B at 8 GB then peaks at 7.038 of the 7.433 GB it may hold.
- **The logs are the CPU path's, not the GPU's.** The trace runs the CPU kernels and, on the CPU, nothing is
  offloaded; the plans differ on a GPU: the Llama-3.1-8B 24 GB plan offloads activations, and on CUDA the memory
  model expects TRL's fused head to fold the loss in Triton (Qwen2.5-0.5B 8 GB: 0.072 GB of loss working set on
  CUDA against 1.042 on the CPU; activations 2.354 against 3.100 GB). So the Llama log holds 23.65 GB live where
  the GPU plan predicts 20.64: `out of memory` held to its card is this CPU-path log not fitting 23.433 GB, not a
  prediction that the plan fails. The ratios above are the allocator's behaviour on these sequences; on the GPU's
  own sequences they are an indication until the trace can take the CUDA paths (fake CUDA, below) or a GPU
  measures them.
- **Allocated ≈ live.** The 512 B rounding and the unsplit remainders add 0.0–2.2 % (`run: allocated` against
  `run: requested`): `max_memory_allocated` is the traced live peak, within the model's accuracy.
- **Depth extrapolation does not hold for reserved bytes.** Live bytes are exactly affine in the depth; reserved
  bytes are not: the slack a shallow model leaves in cached blocks is filled as layers are added, so the reserved
  bytes per layer grow with depth (Llama-3.1-8B, backward 2.2: +0.434 then +0.453 GB per layer at 2 → 3 → 4
  layers while live grows by 0.517; `affine check` +4.35 %). Extrapolated from 2 and 3 layers its training-step
  reserved comes out at 22.33 GB, below its own live bytes and 2.4 GB under the whole trace (24.75); Qwen2.5-0.5B's
  comes out 1.8 % above (5.476 against 5.377). The rows without "(whole)" are kept to show this; only the whole
  traces are figures.
- **Not modelled**: CUDA streams (one stream; activation offloading's copy stream and `record_stream` are not in
  the CPU trace), unmapping of expandable segments' free pages under a limit, bitsandbytes' paged optimizer states
  (CUDA managed memory, outside the caching allocator; a few MB for LoRA, counted here as allocations), kernels'
  internal workspaces, and the order in which weights are loaded (the log allocates the existing tensors first, in
  the order `PeakMemory` finds them).
- **Fake CUDA** (`python -m devkit.fakecuda`): with a small C++ shim the CPU-only torch runs a tiny Llama's forward
  and backward on fake CUDA tensors through the CUDA flash attention kernel (no mask) and the memory-efficient one
  (a mask); their live bytes equal the CPU flash kernel's within 48 B. Without the shim, SDPA on fake CUDA silently
  takes the math path (+22 MB of kept scores on that model). The tracer does not use fake CUDA yet (its real data
  cannot live on a fake CUDA device; see devkit/fakecuda.py), so the logs here are the CPU kernels' allocations.
- **Published figures for the same stack: none found.** The nearest: torchtune's Llama-3.1-8B QLoRA single-device
  recipe reports after model init 14.41 GiB allocated against 14.62 GiB reserved (×1.015), and 6.19 against
  6.27 GiB (×1.013) with fewer LoRA modules (https://github.com/meta-pytorch/torchtune/issues/1398) — a static
  state, another stack; peft's maintainers report reserved well above allocated for small models (esm2-8M 0.72
  against 1.95 GB, bert-base 1.55 against 3.34 GB) and the gap shrinking as models grow
  (https://github.com/huggingface/peft/issues/1469). Neither is a training step of these plans on transformers 5.24 /
  peft 0.21 / TRL 1.16 / torch 2.13; the GPU check (`scripts/gpu_check.sh`) is what would measure them.
- **The allowance.** Under expandable segments the memory model's term is derived from these replays and others
  (`benchmarks/allocator_term.md`: 34 MiB + 3.8 % of the transient peak and gradients for adapters); under the
  default settings it stays the assumed 10 % of the transient (0.407 GB for the 8B, under the 1.10 GB its training
  step adds here), because no term derived from the replays held on PEFT's published runs
  (`docs/published-gpu-runs.md`). Both are replays of CPU-path logs through a model, not GPU measurements.
"""


def write(out: Path, cache: dict, notes: str) -> None:
    out.write_text(HEADER + "\n".join(row(k, v) for k, v in cache.items()) + "\n" + notes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", help="MODEL:VRAM_GB pairs (default: %(default)s)")
    parser.add_argument("--out", default="benchmarks/allocator.md")
    parser.add_argument("--rewrite", action="store_true", help="only rewrite the table from the cache")
    parser.add_argument("--whole", action="store_true", help="trace the whole model (minutes) and also replay it "
                        "held to the card's capacity; cached under MODEL|VRAM|whole")  # fmt: skip
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    out = Path(args.out)
    cache_file = out.with_suffix(".json")
    cache = json.loads(cache_file.read_text()) if cache_file.is_file() else {}
    rows = [(m, float(v)) for m, v in (r.rsplit(":", 1) for r in args.rows)] if args.rows else ROWS
    if args.rewrite:
        reprice(cache)
        cache_file.write_text(json.dumps(cache, indent=1) + "\n")
    else:
        for model, vram in rows:
            key = f"{model}|{vram:g}" + ("|whole" if args.whole else "")
            if key in cache:
                continue
            cache[key] = entry(model, vram, whole=args.whole)
            cache_file.write_text(json.dumps(cache, indent=1) + "\n")
            print(row(key, cache[key]), flush=True)
    write(out, cache, NOTES)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
