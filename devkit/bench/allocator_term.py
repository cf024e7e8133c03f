"""The caching allocator's allowance, derived from replays of traced training steps — none of them PEFT's.

    nice -n 10 python -m devkit.bench.allocator_term --out benchmarks/allocator_term.md   # ~40 min, 2 busy cores
    python -m devkit.bench.allocator_term --rewrite --out benchmarks/allocator_term.md    # re-render from the cache
    python -m devkit.bench.allocator_term --explain "meta-llama/Llama-3.2-1B (whole) full ckpt, 2×1024"  # the blocks

Each row is one training step traced on shape-only tensors (`lowmem_ft.train.trace.step.allocation_log`: two optimizer
steps, the second with an accumulation window whose last micro batch is the full batch) and its allocation log
replayed through the model of torch's CUDA caching allocator (`lowmem_ft.train.measure.allocator`) with the default
settings and with `expandable_segments:True`. The rows: whole real-size steps of catalog models (WHOLE), every zoo
family at the accuracy grid's width (`devkit.zoo.estimator_config`, 3 layers, traced whole), catalog models at
their real width cut to 2 decoder layers (a depth check, not used: reserved bytes are not affine in the depth), and
whole real-size steps with the full-logits loss (FULL_LOGITS, also with one micro batch per optimizer step: a kind
of their own); LoRA, QLoRA and full fine-tunes, with and without checkpointing. PEFT's MetaMathQA runs
(`devkit/bench/published.py`, Llama-3.2-3B) are the held-out test and are not among them.

Per row and setting: `live` = the training step's peak of requested bytes (the trace's own figure), `reserved` =
the replay's peak of reserved bytes over the same windows (the evaluation forward left out), `excess` = reserved −
live, `churn` = live peak − the live bytes after step 1. `derive` takes the term (a base + a fraction of the churn)
as the upper envelope of the whole rows; `lowmem_ft/memory/calibration.py` holds the values the memory model
takes, and says why the default settings keep an assumed one.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

ZOO = ("llama3", "qwen2.5", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "granite")
CUT = (
    "Qwen/Qwen2.5-0.5B",
    "meta-llama/Llama-3.2-1B",
    "google/gemma-3-1b-pt",
    "microsoft/Phi-3-mini-4k-instruct",
    "mistralai/Mistral-7B-v0.3",
    "Qwen/Qwen3-8B",
)
# (adapter, gradient checkpointing): the methods and the checkpointing switch a plan chooses between
KINDS = (("lora", True), ("lora", False), ("qlora", True), ("full", True), ("full", False))
ZOO_BATCH, CUT_BATCH = (2, 512), (2, 1024)  # rows × tokens of the full micro batch
CUT_LAYERS = 2
# whole real-size steps (under a minute each): the settings of `lowmem-ft plan`'s 8 GB plan for Qwen2.5-0.5B and 24 GB
# plan for Llama-3.1-8B (benchmarks/allocator.md's whole rows), then LoRA, QLoRA and full fine-tunes of other
# catalog families and sizes, with and without checkpointing
WHOLE = (
    ("Qwen/Qwen2.5-0.5B", "lora", False, (2, 512)),
    ("meta-llama/Llama-3.1-8B", "lora", True, (4, 2048)),
    ("Qwen/Qwen2.5-0.5B", "full", False, (2, 512)),
    ("meta-llama/Llama-3.2-1B", "full", True, (2, 1024)),
    ("Qwen/Qwen2.5-0.5B", "qlora", False, (4, 1024)),
    ("meta-llama/Llama-3.2-1B", "lora", False, (2, 1024)),
    ("meta-llama/Llama-3.2-1B", "qlora", True, (4, 1024)),
    ("google/gemma-3-1b-pt", "lora", True, (2, 1024)),
    ("google/gemma-3-1b-pt", "full", True, (2, 1024)),
    ("Qwen/Qwen2.5-1.5B", "full", True, (2, 1024)),
    ("microsoft/Phi-3-mini-4k-instruct", "qlora", True, (2, 2048)),
    ("mistralai/Mistral-7B-v0.3", "qlora", True, (2, 2048)),
    ("Qwen/Qwen3-8B", "lora", True, (2, 1024)),
    ("microsoft/Phi-3-mini-4k-instruct", "full", True, (2, 1024)),  # a full fine-tune of untied embeddings
)
# whole real-size steps with the full-logits loss (`memory.full_logits_loss`), each with the accumulating sequence
# and with one micro batch per optimizer step (`ONE_MICRO_BATCH`, as a run of accumulation 1): their own kind
FULL_LOGITS = (
    ("Qwen/Qwen2.5-0.5B", "lora", False, (2, 512)),
    ("meta-llama/Llama-3.2-1B", "lora", False, (2, 1024)),
    ("google/gemma-3-1b-pt", "lora", True, (2, 1024)),
    ("microsoft/Phi-3-mini-4k-instruct", "qlora", True, (2, 2048)),
    ("Qwen/Qwen3-8B", "lora", True, (2, 1024)),
    ("Qwen/Qwen2.5-1.5B", "full", True, (2, 1024)),
    ("meta-llama/Llama-3.2-1B", "full", True, (2, 1024)),
)
LOGITS_KEY, ONE_KEY = ", full logits", ", one micro batch"
MODES = {"default": {}, "expandable": {"expandable_segments": True}}


def _zoo_dir(name: str, root: Path) -> str:
    """A directory holding family `name`'s config at the grid's width: all the trace reads (no weights)."""
    from devkit.zoo import estimator_config

    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(estimator_config(name)))
    return str(d)


def recipe(model: str, adapter: str, checkpointing: bool, batch: tuple[int, int], full_logits: bool = False):
    from lowmem_ft.recipe.load import resolve

    return resolve(
        None,
        {
            "model": {"name_or_path": model, "quantization": "nf4" if adapter == "qlora" else "none"},
            "adapter": {"kind": "full" if adapter == "full" else "lora"},
            "memory": {
                "gradient_checkpointing": checkpointing,
                "micro_batch_size": batch[0],
                "max_seq_len": batch[1],
                "gradient_accumulation": 1,
                "full_logits_loss": full_logits,
            },
        },
    )


def train_peaks(log: list) -> dict:
    """Each setting's replay of a log's training step (up to the evaluation forward): mode → {"live": its peak of
    requested bytes, "reserved": its peak of reserved bytes, "at_live_peak": the allocator's state when the live
    bytes peaked — [requested, allocated (the blocks handed out: 512 B rounding, unsplit remainders), reserved, the
    cached free blocks' bytes, the largest of them, how many]}; and "steady": the live bytes when step 1 ends
    (weights, adapters, optimizer states; the gradients set to None), where every later step starts."""
    from lowmem_ft.train.measure.allocator import Allocator

    out: dict = {}
    for mode, kw in MODES.items():
        alloc, blocks, top = Allocator(**kw), {}, None
        for kind, key, nbytes in log:
            if kind == "+" and nbytes:
                blocks[key] = alloc.malloc(nbytes)
                now = alloc.current
                if top is None or now.requested > top[0]:
                    free = alloc.cached_free()
                    top = [now.requested, now.allocated, now.reserved, sum(free), max(free, default=0), len(free)]
            elif kind == "-" and key in blocks:
                alloc.free(blocks.pop(key))
            elif kind == "mark" and key == "optimizer 1":
                out["steady"] = alloc.current.requested
            elif kind == "mark" and key == "eval":
                break
        out[mode] = {"live": top[0], "reserved": alloc.peak.reserved, "at_live_peak": top}
    return out


def stranded(log: list, mode: str, top: int = 8) -> dict:
    """What makes a replay's reserved peak exceed its live bytes, with `mode`'s settings: at the moment the reserved
    bytes reach their peak, the request that asked for the new segment (`trigger`), and the largest cached free
    blocks as (size, the request that last held the block, (the segment's size, the request it was mapped for) —
    None with expandable segments, whose one segment grows). A free block is pieces of an earlier tenant's space
    that no later request of the step filled; matched to the memory model's tensor sizes this names them."""
    from devkit.harness.allocator_tenants import Tenants
    from lowmem_ft.train.measure.allocator import Allocator

    replay = Tenants(Allocator(**MODES[mode]), segments=mode == "default")
    at: dict = {}
    for kind, key, nbytes in log:
        if kind == "+" and nbytes:
            replay.malloc(key, nbytes)
            now = replay.alloc.current
            if now.reserved > at.get("reserved", 0):
                free = sorted(replay.free_blocks(), key=lambda f: -f.size)
                at = {
                    "trigger": nbytes,
                    "live": now.requested,
                    "reserved": now.reserved,
                    "free": sum(f.size for f in free),
                    "blocks": [(f.size, f.last, f.made) for f in free[:top]],
                }
        elif kind == "-":
            replay.free(key)
        elif kind == "mark" and key == "eval":
            break
    return at


def explain(key: str) -> str:
    """`stranded` of one grid row (traced anew), both settings, as lines of MiB."""
    from lowmem_ft.train.trace.step import allocation_log, model_config

    with tempfile.TemporaryDirectory() as tmp:
        ((_, make, layers),) = [r for r in grid(Path(tmp)) if r[0] == key]
        rec = make()
        log = allocation_log(rec, model_config(rec), layers, steps=steps_of(key))
    lines = [key]
    for mode in MODES:
        at = stranded(log, mode)
        lines.append(
            f"  {mode}: at the reserved peak {at['reserved'] / MiB:.0f} MiB (live {at['live'] / MiB:.0f}), a "
            f"{at['trigger'] / MiB:.1f} MiB request opened it; cached free {at['free'] / MiB:.0f} MiB, the largest:"
        )
        for size, last, seg in at["blocks"]:
            where = "" if seg is None else f", in a {seg[0] / MiB:.1f} MiB segment mapped for {seg[1] / MiB:.1f}"
            lines.append(f"    {size / MiB:8.1f} MiB, last held by a {last / MiB:.1f} MiB request{where}")
    return "\n".join(lines)


def entry(rec, layers: int | None, steps) -> dict:
    """`rec`'s training step traced (cut to `layers` decoder layers; None: whole; the sequence `steps`) and
    replayed."""
    from lowmem_ft.train.trace.step import allocation_log, model_config

    started = time.perf_counter()
    log = allocation_log(rec, model_config(rec), layers, steps=steps)
    return {**train_peaks(log), "seconds": round(time.perf_counter() - started)}


def grid(zoo_root: Path) -> list[tuple[str, Callable, int | None]]:
    """(cache key, a function making the row's recipe, decoder layers to cut to) of every traced row (a key ending
    in ONE_KEY: traced with one micro batch per optimizer step)."""
    rows = []
    for model in CUT:
        for adapter, ckpt in KINDS:
            key = f"{model} ({CUT_LAYERS} layers) {adapter}{' ckpt' if ckpt else ''}, {CUT_BATCH[0]}×{CUT_BATCH[1]}"
            rows.append((key, partial(recipe, model, adapter, ckpt, CUT_BATCH), CUT_LAYERS))
    for model, adapter, ckpt, batch in WHOLE:
        key = f"{model} (whole) {adapter}{' ckpt' if ckpt else ''}, {batch[0]}×{batch[1]}"
        rows.append((key, partial(recipe, model, adapter, ckpt, batch), None))
    for name in ZOO:
        for adapter, ckpt in KINDS:
            key = f"zoo {name} {adapter}{' ckpt' if ckpt else ''}, {ZOO_BATCH[0]}×{ZOO_BATCH[1]}"
            make = partial(lambda n, a, c: recipe(_zoo_dir(n, zoo_root), a, c, ZOO_BATCH), name, adapter, ckpt)
            rows.append((key, make, None))
    for model, adapter, ckpt, batch in FULL_LOGITS:
        key = f"{model} (whole) {adapter}{' ckpt' if ckpt else ''}, {batch[0]}×{batch[1]}{LOGITS_KEY}"
        make = partial(recipe, model, adapter, ckpt, batch, True)
        rows += [(key, make, None), (key + ONE_KEY, make, None)]
    return rows


MiB = 1 << 20
GB = 1e9


def excess(e: dict, mode: str) -> tuple[int, int]:
    """(reserved − live, what the step allocates and frees: live peak − the state after step 1) of a row."""
    d = e[mode]
    return d["reserved"] - d["live"], d["live"] - e["steady"]


def real_width(key: str) -> bool:
    return not key.startswith("zoo ")


def whole(key: str) -> bool:
    """A model traced with all its layers: the whole real-size rows and the zoo's (cut rows are a depth check only:
    reserved bytes are not affine in the depth, benchmarks/allocator.md)."""
    return "(whole)" in key or not real_width(key)


def full(key: str) -> bool:
    """A full fine-tune's row (every weight trains), else an adapter's (LoRA, QLoRA)."""
    return " full" in key.replace(LOGITS_KEY, "")


def full_logits(key: str) -> bool:
    """A row whose loss runs over the full logits (`memory.full_logits_loss`)."""
    return LOGITS_KEY in key


# the kinds of step a term is derived for, (full fine-tune, full-logits loss), as the memory model tells them apart
# (`overheads.allocator_terms`): a full fine-tune with the full-logits loss takes the full fine-tunes' term
KINDS_OF_TERM = {
    (False, False): "adapters (LoRA, QLoRA)",
    (True, False): "full fine-tuning (the full-logits loss's rows included, not derived from)",
    (False, True): "adapters with the full-logits loss",
}


def kind(key: str) -> tuple[bool, bool]:
    """The kind of term (`KINDS_OF_TERM`) the memory model takes for a row."""
    return full(key), full_logits(key) and not full(key)


def allowance(terms: dict, mode: str, kind: tuple[bool, bool], block: float, churn: float) -> float:
    """A row's allowance under the derived `terms` ((mode, full fine-tune, full-logits loss) → term), combined as
    the memory model combines them (`overheads.allocator_terms`): with expandable segments an adapter step with the
    full-logits loss takes the larger of its own term and the other adapter steps' (which counts no block)."""
    own = [terms[(mode, *kind)]]
    if mode == "expandable" and kind[1]:
        own.append(terms[mode, False, False])
    return max(t.base + t.blocks * block + t.fraction * churn for t in own)


def _taken(taken, derived, mode: str, kind: tuple[bool, bool]) -> str:
    if taken != derived:
        return f"not taken: the model keeps {taken.fraction:.0%} of the transient"
    return "taken, or the adapters' term where larger" if mode == "expandable" and kind[1] else "taken"


def taken_term(mode: str, full_ft: bool, logits: bool):
    """The term the memory model takes for a kind: the first of `overheads.allocator_terms` for such a step."""
    from lowmem_ft.memory.overheads import allocator_terms
    from lowmem_ft.memory.records import Setup

    s = Setup(
        adapter="full" if full_ft else "lora",
        loss_impl="hf_full" if logits else "trl_fused",
        allocator="expandable segments" if mode == "expandable" else "default",
    )
    return allocator_terms(s)[0]


def steps_of(key: str):
    """The step sequence a row is traced with (`lowmem_ft.train.trace.step`)."""
    from lowmem_ft.train.trace.step import ONE_MICRO_BATCH, STEPS

    return ONE_MICRO_BATCH if key.endswith(ONE_KEY) else STEPS


def block_sizes(keys) -> dict[str, dict[str, float]]:
    """Each row's block size per setting, as the memory model computes it from the row's `Setup`
    (`overheads.allocator_block`): with the default settings the step's largest tensor — on the CPU path the trace
    ran (TRL's fused head folds its tiles in fp32 copies there) — with expandable segments a full fine-tune's tied
    embedding gradient (else 0)."""
    from dataclasses import replace

    from lowmem_ft.choosing import setup_from_recipe
    from lowmem_ft.memory.arch import load_architecture
    from lowmem_ft.memory.overheads import allocator_block

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for key, make, _ in grid(Path(tmp)):
            if key not in keys:
                continue
            rec = make()
            s = replace(setup_from_recipe(rec, "cuda"), device="cpu")
            arch = load_architecture(rec.model.name_or_path)
            out[key] = {
                "default": allocator_block(arch, replace(s, allocator="default")),
                "expandable": allocator_block(arch, replace(s, allocator="expandable segments")),
            }
    return out


def derive(cache: dict, blocks: dict, mode: str, full_ft: bool, logits: bool = False):
    """The allocator term (`overheads.AllocatorTerm`) for `mode` and the kind of training (`full_ft`; `logits`: the
    steps with the full-logits loss, else the others), from that kind's rows traced whole, as an upper envelope (a
    safety term takes the largest seen, not the median):
    - the default settings: base + k × the row's block (`block_sizes`), k the largest (excess − pages) / block of
      the real-size rows rounded up to 0.01;
    - expandable segments: base + fraction × churn (+ k × the row's block for full fine-tunes, the tied embedding
      gradient, and for the full-logits loss, its fp32 logits: k as above over the rows that have one; the
      fraction then the largest (excess − pages − k × block) / churn left, rounded up to 0.1 %).
    The base: the largest excess any whole row (the tiny zoo models among them) leaves beyond the rest, at least
    the pages, rounded up to a MiB."""
    from lowmem_ft.memory.calibration import ALLOCATOR_PAGE_BYTES
    from lowmem_ft.memory.overheads import AllocatorTerm

    rows = {
        k: (*excess(e, mode), blocks[k][mode])
        for k, e in cache.items()
        if full(k) == full_ft and full_logits(k) == logits and whole(k)
    }
    real = {k: r for k, r in rows.items() if real_width(k)}
    k_blocks = 0.0
    if mode == "default" or full_ft or logits:
        k_blocks = max((x - ALLOCATOR_PAGE_BYTES) / b for x, _, b in real.values() if b)
        k_blocks = math.ceil(k_blocks * 100) / 100
    fraction = 0.0
    if mode == "expandable":
        fraction = max(0.0, max((x - ALLOCATOR_PAGE_BYTES - k_blocks * b) / t for x, t, b in real.values()))
        fraction = math.ceil(fraction * 1000) / 1000
    rest = max(x - fraction * t - k_blocks * b for x, t, b in rows.values())
    base = max(ALLOCATOR_PAGE_BYTES, math.ceil(rest / MiB) * MiB)
    return AllocatorTerm(base, fraction, mode == "expandable", k_blocks)


def _cells(e: dict, mode: str) -> str:
    from lowmem_ft.memory.calibration import ALLOCATOR_PAGE_BYTES

    x, t = excess(e, mode)
    req, alloc, res, free, largest, n = e[mode]["at_live_peak"]
    return (
        f"{x / MiB:.0f} | {x / e[mode]['live']:.2%} | {(x - ALLOCATOR_PAGE_BYTES) / t:+.2%} | "
        f"{(alloc - req) / MiB:.0f} / {free / MiB:.0f} ({n}; {largest / MiB:.0f}) / {(e[mode]['reserved'] - res) / MiB:.0f}"
    )


HEADER = """# The caching allocator's allowance, derived from replayed training steps (PEFT's runs held out)

Written by `python -m devkit.bench.allocator_term --out benchmarks/allocator_term.md` (run under `nice -n 10`;
cached in `benchmarks/allocator_term.json`; `--rewrite` re-renders). Each row: a training step traced on the CPU on
shape-only tensors (`lowmem_ft.train.trace.step.allocation_log`: two optimizer steps, the second with two micro
batches, the last at the full batch) and its allocations replayed through the model of torch 2.13's CUDA caching
allocator (`lowmem_ft.train.measure.allocator`) with torch's default settings and with `expandable_segments:True`;
the evaluation forward is left out. **Predicted by a model of the allocator, not measured on a GPU.** Rows: zoo
families at the accuracy grid's width (`devkit.zoo.estimator_config`: hidden 256, 3 layers; 2 × 512 tokens),
catalog models at their real width cut to 2 decoder layers (2 × 1,024 tokens), 14 whole real-size steps of
catalog models (`WHOLE`: the settings of `lowmem-ft plan`'s Qwen2.5-0.5B 8 GB and Llama-3.1-8B 24 GB plans, then
LoRA, QLoRA and full fine-tunes of other families and sizes), and 7 whole real-size steps with the full-logits loss
(`memory.full_logits_loss`; `FULL_LOGITS`: `, full logits`), each also with one micro batch per optimizer step
(`, one micro batch`: `ONE_MICRO_BATCH`, the step a run of accumulation 1 takes); LoRA (r 16) and QLoRA (NF4) with
paged AdamW 8-bit, full fine-tuning with it too. PEFT's MetaMathQA runs (Llama-3.2-3B, `benchmarks/published.md`)
are not among them: they are the held-out test of what is derived here.

`live` = the step's peak of live tensor bytes (the trace's own figure); `churn` = what the step allocates and frees
at that peak: live peak − the live bytes after step 1 (weights, adapters, optimizer states; gradients set to None),
i.e. the memory model's transient peak plus the gradients; `excess` = the replay's peak reserved − live (MiB);
`(excess − pages) / churn` with pages = 22 MiB, one 2 MiB small-pool and one 20 MiB large-pool step of growth
(`calibration.ALLOCATOR_PAGE_BYTES`); `made of` = at the moment the live bytes peak: 512 B rounding and unsplit
remainders (allocated − live) / cached free blocks (how many; the largest) / reserved added after that moment, MiB.

| row | live GB | churn GB | default: excess MiB | ÷ live | (excess − pages) ÷ churn | made of | expandable: excess MiB | ÷ live | (excess − pages) ÷ churn | made of | s |
|---|---|---|---|---|---|---|---|---|---|---|---|
"""


def _form(t) -> str:
    parts = [f"{t.base / MiB:.0f} MiB"]
    if t.blocks:
        parts.append(f"{t.blocks:g} × the block")
    if t.fraction:
        parts.append(f"{t.fraction:.1%} of the churn")
    return " + ".join(parts)


CHECK_HEADER = """
## Each row against the term

`block` = the row's block size as the memory model computes it from the row's setup (`overheads.allocator_block`:
with the default settings the step's largest tensor, `loss.largest_step_block`, on the CPU path the trace ran; with
expandable segments a full fine-tune's tied embedding gradient, an adapter step's fp32 logits with the full-logits
loss, else 0); `allow` = the derived term's allowance
for the row; `excess` as above (MiB). A negative `allow − excess` is a row the term does not cover (the cut rows,
a depth check only, are not derived from).

| row | default: block | excess | allow | allow − excess | expandable: block | excess | allow | allow − excess |
|---|---|---|---|---|---|---|---|---|
"""


def render(cache: dict) -> str:
    lines = [HEADER]
    for key, e in cache.items():
        _, churn = excess(e, "default")
        lines.append(
            f"| {key} | {e['default']['live'] / GB:.3f} | {churn / GB:.3f} | {_cells(e, 'default')} | "
            f"{_cells(e, 'expandable')} | {e['seconds']} |\n"
        )
    blocks = block_sizes(set(cache))
    terms = {(mode, *k): derive(cache, blocks, mode, *k) for mode in MODES for k in KINDS_OF_TERM}
    lines.append(CHECK_HEADER)
    for key, e in cache.items():
        cells = []
        for mode in MODES:
            x, churn = excess(e, mode)
            allow = allowance(terms, mode, kind(key), blocks[key][mode], churn)
            cells.append(
                f"{blocks[key][mode] / MiB:.0f} | {x / MiB:.0f} | {allow / MiB:.0f} | {(allow - x) / MiB:+.0f}"
            )
        lines.append(f"| {key} | {' | '.join(cells)} |\n")
    lines.append("\n## The term the memory model takes\n\n")
    for mode, setting in (("expandable", "expandable segments"), ("default", "default settings")):
        for k, what in KINDS_OF_TERM.items():
            t = terms[(mode, *k)]
            taken = taken_term(mode, *k)
            short = [
                (allowance(terms, mode, k, blocks[key][mode], c) - x) / MiB
                for key, e in cache.items()
                if kind(key) == k
                for x, c in [excess(e, mode)]
            ]
            lines.append(
                f"- **{setting}, {what}**: {_form(t)} ({_taken(taken, t, mode, k)}); "
                f"allowance − excess over every row (cut rows included): {min(short):+.0f} to {max(short):+.0f} MiB\n"
            )
    return "".join(lines) + NOTES


NOTES = """
## Notes

- **The form.** The excess is a base plus a fraction of the churn, plus blocks of a size the memory model computes
  where the replays show such blocks (`derive`; `block` in the second table): the replay's excess at the live peak is cached
  free blocks (`made of`: allocated − live is 0–106 MiB, the 512 B rounding and, with the default settings, unsplit
  remainders), and what the step allocates and frees is what can leave them. The fraction is the largest
  (excess − pages) ÷ churn over the whole real-size rows of each kind (adapters; full fine-tunes), the base the
  largest excess left beyond it by any whole row (the zoo's 3-layer models set it: tens of MiB at any size).
  Only whole traces count: cut to 2 layers a model's churn shrinks but the head's and the embedding's blocks do
  not, so the cut rows (kept as a check) run up to 35 % where their whole models stay lower, as
  `benchmarks/allocator.md` found for depth extrapolation.
- **Expandable segments, adapters: the form holds.** Over the 10 whole real-size adapter steps (excess − pages) ÷
  churn is 0.2 to 3.7 %, the zoo's within the 34 MiB base; the cut rows agree (−1.1 to +3.3 %). The free blocks
  are a few MiB to 128 MiB each. The memory model takes 34 MiB + 3.8 % of the transient peak and gradients: for
  Llama-3.1-8B's 24 GB plan 0.20 GB where the assumed 10 % gave 0.42 (the replay: 0.19).
- **Expandable segments, full fine-tuning: blocks of the tied embedding's gradient.** As a share of the churn the
  whole full steps ran from 0.2 % (Qwen2.5-0.5B) to 17.8 % (gemma-3-1b). The allocator replay, instrumented at the
  reserved peak (`--explain ROW`: the cached free blocks by size, the request that last held each and the request
  its segment was mapped for), shows why: the excess of the tied large-vocabulary models is two free blocks of exactly the input
  embedding's bf16 gradient (501/502 MiB Llama-3.2-1B, 576 gemma-3-1b, 445/447 Qwen2.5-1.5B) — the tied weight's
  head and embedding gradients, freed each step where the next step's smaller requests do not fill them and the
  growing end cannot take them back. (excess − pages) ÷ that block: 2.00, 2.01, 1.98 (Qwen2.5-0.5B: 0.03), so
  2.02 blocks; an untied model has no such block (Phi-3-mini traced whole: 41 MiB of a 10.6 GB churn) and what is
  left over every whole row is 0.2 % of the churn and a 27 MiB base. For Phi-3-mini's full fine-tune this
  allows tens of MiB where 17.8 % of the churn allowed GBs; for the tied models it is within 0.1 GB of the replay.
- **Expandable segments, adapters with the full-logits loss: blocks of the fp32 logits.** The term above, derived
  from fused-head steps, left these 10 whole steps 0.4 to 1.5 c-byte logits short. Instrumented
  (`--explain ROW`), the excess is a hole the c-byte logits leave: they are freed when the loss's forward returns,
  between the saved activations, and the backward's fp32 gradients, twice their size, cannot fill it, so the segment
  grows past it. (excess − pages) ÷ the fp32 logits: 0.51 (gemma-3-1b, 262k vocabulary) to 0.95 (Phi-3-mini QLoRA
  with one micro batch per step); the memory model takes 22 MiB + 0.96 of them, or the adapters' term where that
  is larger, and keeps the adapters' term for an evaluation pass and for ORPO / SimPO (no backward frees their
  logits). Held out: lowmem-ft's own step at PEFT's five adapter settings (`benchmarks/published.md`, "The plan
  against lowmem-ft's own step"): +1.2 to +2.4 % over its replay. A full fine-tune with that loss keeps the
  full fine-tunes' term (these rows are not derived from): Qwen2.5-1.5B's step is left 370 MiB short, Llama-3.2-1B's
  212 MiB with one micro batch, while PEFT's Llama-3.2-3B full fine-tune is 0.7 GB over; no single count of logit
  blocks beside the tied gradient's holds.
- **Default settings: no derived form holds; the memory model keeps 10 % of the transient.** As a share of the
  churn the whole real-size adapter steps spread from 0.7 % to 31.5 %, full fine-tunes from 8 to 45 %. By blocks
  (the table above): instrumented, every whole row's reserved peak is the step's largest tensor
  (`loss.largest_step_block`, here the fused head's fp32 tile or accumulator on the CPU path) asking for a new
  segment while the cached free blocks — pieces of earlier segments of that size, the embedding gradient's, the
  MLP's — are each smaller than it (Llama-3.1-8B LoRA: three 448 MiB MLP-sized blocks against a 512 MiB tile;
  Llama-3.2-1B full: 502 + 501 + 256 + 256 + 216 MiB against the 1,002 MiB accumulator); but how many are stranded
  varies: 0.28 to 3.46 blocks for adapters, 1.71 to 3.28 for full fine-tunes. That envelope, tried on PEFT's
  published runs (the held-out test: 3.47 / 3.29 × their 1.44 GB fp32 logits), puts the memory model 16 to 19 %
  over the adapter runs and 3.7 to 8.3 % over the full fine-tunes, where the assumed 10 % is +2.3..+4.5 % and
  −4.4..−0.2 % (`benchmarks/published.md`); so it is not taken. Only a user who sets PYTORCH_CUDA_ALLOC_CONF runs
  it: `train` sets expandable segments otherwise (`lowmem_ft/cuda_alloc.py`, which `plan` reads too).
- **CPU-path logs.** The trace runs the CPU kernels: TRL's fused head does not fold the loss in Triton, nothing is
  offloaded, bitsandbytes' optimizers run their Python update. The sequences a GPU allocates differ in those places;
  the figures are a model's replay of the CPU path, not GPU measurements, and a GPU run's calibration
  (`lowmem_ft.calibrated`) adds what it measures beyond the term.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/allocator_term.md"))
    parser.add_argument("--rewrite", action="store_true", help="re-render the table from the cache, no tracing")
    parser.add_argument("--only", default="", help="trace only rows whose key contains this")
    parser.add_argument("--explain", metavar="ROW", help="trace one row and print what its excess is made of")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    if args.explain:
        print(explain(args.explain))
        return 0
    cache_path = args.out.with_suffix(".json")
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    if not args.rewrite:
        with tempfile.TemporaryDirectory() as tmp:
            for key, make, layers in grid(Path(tmp)):
                if key in cache or args.only not in key:
                    continue
                cache[key] = entry(make(), layers, steps_of(key))
                cache_path.write_text(json.dumps(cache, indent=1) + "\n")
                print(key, json.dumps(cache[key]), flush=True)
    args.out.write_text(render(cache))
    print(render(cache))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
