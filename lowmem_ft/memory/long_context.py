"""The long-context savers as the planner's knobs: which apply to a model, the order they are added in, the MLP tiles
and loss chunks the planner may choose, and the reason line of each (pure arithmetic; no recipe, no torch).

One idea: each saver (host embeddings, tiled norms, tiled MLP, LoRA recompute: `lowmem_ft.memory.savers`, where
each one's memory terms, cost, reason line and refusals are; `lowmem_ft.train.savers.apply` applies them) costs
step time, so `lowmem_ft.memory.planner` searches without them first and, only when nothing fits, with
sets of them in order of cost (`saver_stages`): the first set where something fits wins, so each saver a plan turns
on is needed. Once a setup is chosen, its loss chunk grows into what the rest of the step leaves of the budget
(`size_loss_chunk`). What needs the planner's estimate of a variant takes it as `score` (a setup → its scored
per-device estimate), so this module knows nothing of the planner.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from lowmem_ft.memory.arch import Architecture
from lowmem_ft.memory.estimate import (
    DTYPE_BYTES,
    GB,
    TRL_TOKEN_CHUNK,
    Estimate,
    Setup,
    largest_loss_chunk,
    loss_chunk_tokens,
    mlp_tile_tokens,
)
from lowmem_ft.memory.overheads import allocator_growth
from lowmem_ft.memory.savers import LONG_CONTEXT_SAVERS

# Relative step-time cost of each saver (`Saver.cost`, where the figures and where they come from are), for the
# planner's ranking (`lowmem_ft.memory.planner.COST`).
SAVER_COST = {saver.name: saver.cost for saver in LONG_CONTEXT_SAVERS}
SAVERS = tuple(SAVER_COST)  # `Setup` fields
BY_NAME = {saver.name: saver for saver in LONG_CONTEXT_SAVERS}
TILED = tuple(saver.name for saver in LONG_CONTEXT_SAVERS if saver.tiled)  # the savers `mlp_tile_tokens` sizes
# every knob of the long-context search: the savers, their tile and the loss chunk (`Setup` fields)
KNOBS = frozenset({*SAVERS, "mlp_tile_tokens", "loss_chunk_tokens"})
# The tiles tried below the default (hidden_size) when a tiled saver is on: smaller tiles decide tight cards
# (benchmarks/long_context_predicted.md: Llama-3.1-8B at 8 GB, 2,960 tokens with tiles of 4,096, 12,768 with tiles of
# 1,024). A smaller tile costs kernel launches, not FLOPs (a 256-token tile of a 7B's MLP is still a ~15 GFLOP
# matmul), so it is tried before another saver is added — an assumption: no GPU step time was measured.
SMALLER_TILES = (1024, 256)
# The loss chunk sized from the budget (`chunk_sizes`): a multiple of 128 tokens (below that a power of two, at least
# 16), at most TRL's own token tile of 4,096 (a matmul that size already fills a GPU: larger chunks only take memory),
# at most the micro batch's tokens (one chunk).
LOSS_CHUNK_MIN, LOSS_CHUNK_STEP, LOSS_CHUNK_MAX = 16, 128, TRL_TOKEN_CHUNK


class Scored(Protocol):
    """A setup with its per-device estimate (the planner's scored candidate)."""

    setup: Setup
    estimate: Estimate

    @property
    def peak_gb(self) -> float: ...


Score = Callable[[Setup], Scored]


# -- which savers, in what order ---------------------------------------------------------------------------------
def refusal(name: str, arch: Architecture, s: Setup, gpus: int) -> str | None:
    """Why the saver `name` cannot be used for this setup (the reason line's "off: …"), None when it can."""
    return BY_NAME[name].refusal(arch, s, gpus)


def tiled(s: Setup) -> bool:
    """Whether a saver that `mlp_tile_tokens` sizes is on."""
    return any(getattr(s, name) for name in TILED)


def tile_options(arch: Architecture, s: Setup, fixed: frozenset[str]) -> list[int]:
    """MLP tile sizes to try, largest first: the start's (0 = hidden_size), then the smaller of SMALLER_TILES."""
    if "mlp_tile_tokens" in fixed:
        return [s.mlp_tile_tokens]
    largest = s.mlp_tile_tokens or arch.hidden_size
    return [s.mlp_tile_tokens, *(tile for tile in SMALLER_TILES if tile < largest)]


def saver_stages(arch: Architecture, start: Setup, fixed: frozenset[str], gpus: int) -> list[dict[str, Any]]:
    """The saver settings to search, in order (`Setup` fields to replace): the start's first, then every set of the
    savers that apply and the user did not fix, cheapest set first (the product of their `SAVER_COST`), each with its
    MLP tiles from the largest down. Every saver of the first set that fits is needed: each subset of it costs less,
    so it was searched before and nothing fitted."""
    free = [
        name
        for name in SAVERS
        if name not in fixed and not getattr(start, name) and refusal(name, arch, start, gpus) is None
    ]
    sets = [names for r in range(len(free) + 1) for names in itertools.combinations(free, r)]
    sets.sort(key=lambda names: math.prod(SAVER_COST[name] for name in names))
    stages = []
    for names in sets:
        is_tiled = tiled(start) or any(name in TILED for name in names)
        for tile in tile_options(arch, start, fixed) if is_tiled else [start.mlp_tile_tokens]:
            stages.append({**dict.fromkeys(names, True), "mlp_tile_tokens": tile})
    return stages


# -- the loss chunk, sized from the budget -----------------------------------------------------------------------
def chunk_sizes(n: int, least: int) -> list[int]:
    """The loss chunks the planner may choose for a micro batch of `n` tokens, ascending: powers of two from
    LOSS_CHUNK_MIN below LOSS_CHUNK_STEP, multiples of LOSS_CHUNK_STEP up to LOSS_CHUNK_MAX, and all `n` tokens in one
    chunk when that is within LOSS_CHUNK_MAX — none below `least` (the chunk the setup was searched with, which is
    one of them: a sized chunk only grows) and none above `n`."""
    ladder = {1 << p for p in range(LOSS_CHUNK_MIN.bit_length() - 1, LOSS_CHUNK_STEP.bit_length() - 1)}
    ladder |= set(range(LOSS_CHUNK_STEP, LOSS_CHUNK_MAX + 1, LOSS_CHUNK_STEP))
    if n <= LOSS_CHUNK_MAX:
        ladder.add(n)
    return sorted({size for size in ladder if least < size <= n} | {least})


def size_loss_chunk(arch: Architecture, best: Scored, budget_gb: float, score: Score) -> tuple[Scored, str]:
    """`best` (a chunked-loss setup that fits) with the largest chunk of `chunk_sizes` whose working set fits what
    the rest of the step leaves of the budget: fewer, larger chunks when there is room. `largest_loss_chunk` over that
    room is the first guess, checked (and moved up or down the sizes) with the whole estimate. Returns the setup
    scored and its reason line."""
    s = best.setup
    n = s.micro_batch_size * (s.max_seq_len - 1)
    sizes = chunk_sizes(n, loss_chunk_tokens(arch, s))
    least = score(replace(s, loss_chunk_tokens=1)).estimate
    loss_least = least.by_name()["logits / loss working set"]
    allocator = allocator_growth(s)  # the allocator's term grows with the transient peak
    room = max(0.0, (budget_gb * GB - least.peak_bytes) / allocator + loss_least)
    guess = largest_loss_chunk(arch, s, room)
    i = max((j for j, size in enumerate(sizes) if size <= guess), default=0)

    def at(j: int) -> Scored:
        return best if j == 0 else score(replace(s, loss_chunk_tokens=sizes[j]))

    sized = at(i)
    while i > 0 and sized.peak_gb > budget_gb:  # the room is an estimate: the whole estimate decides
        i -= 1
        sized = at(i)
    while i + 1 < len(sizes) and (larger := at(i + 1)).peak_gb <= budget_gb:
        i, sized = i + 1, larger
    chunk, working = sizes[i], sized.estimate.by_name()["logits / loss working set"] / GB
    if chunk == n:
        return sized, f"{chunk:,} tokens: the micro batch in one chunk (working set {working:.2f} GB)"
    if i + 1 == len(sizes):  # LOSS_CHUNK_MAX, or an automatic chunk above it (a small vocabulary)
        return sized, f"{chunk:,} tokens (working set {working:.2f} GB): larger chunks would add memory, not speed"
    return sized, (
        f"{chunk:,} tokens: the largest chunk that fits (working set {working:.2f} GB; {sizes[i + 1]:,} tokens need "
        f"{at(i + 1).peak_gb:.2f} GB of the {budget_gb:.2f} GB budget)"
    )


# -- why each saver is on or off ---------------------------------------------------------------------------------
def saver_reasons(
    arch: Architecture, s: Setup, start: Setup, fixed: frozenset[str], gpus: int, budget_gb: float, score: Score
) -> dict[str, str]:
    """A line per saver — "on: …" with what `s` would need without it, "off: not needed", or why it cannot be used
    — and the MLP tile's. `s` is the setup as searched (its loss chunk not yet sized), `start` the request's."""
    figures = {"table": DTYPE_BYTES[s.compute_dtype] * arch.embedding_params / GB, "tile": mlp_tile_tokens(arch, s)}
    out = {}
    for name in SAVERS:
        why_not = refusal(name, arch, s, gpus)
        if name in fixed:
            out[name] = "set by you (--set)"
        elif not getattr(s, name):
            out[name] = f"off: {why_not}" if why_not else "off: not needed"
        elif getattr(start, name):
            out[name] = "on (from the recipe)"
        else:
            without = score(replace(s, **{name: False})).peak_gb
            what = BY_NAME[name].what.format(**figures)
            out[name] = f"on: {what}; without it this setup needs {without:.2f} GB of the {budget_gb:.2f} GB budget"
    out["mlp_tile_tokens"] = tile_reason(arch, s, start, fixed, budget_gb, score)
    return out


def tile_reason(
    arch: Architecture, s: Setup, start: Setup, fixed: frozenset[str], budget_gb: float, score: Score
) -> str:
    """Why the MLP tile is what it is: unused, fixed, the start's, or the largest that fits (the larger one's need)."""
    tile = mlp_tile_tokens(arch, s)
    if not tiled(s):
        return "unused: no tiled saver is on"
    if "mlp_tile_tokens" in fixed:
        return f"{tile:,} tokens, set by you (--set)"
    if s.mlp_tile_tokens == start.mlp_tile_tokens:
        return f"{tile:,} tokens" + (" (hidden_size, the default)" if not s.mlp_tile_tokens else " (from the recipe)")
    options = tile_options(arch, start, fixed)
    larger = options[options.index(s.mlp_tile_tokens) - 1]
    need = score(replace(s, mlp_tile_tokens=larger)).peak_gb
    return (
        f"{tile:,} tokens: the largest tile that fits (tiles of {larger or arch.hidden_size:,} need {need:.2f} GB of "
        f"the {budget_gb:.2f} GB budget)"
    )
