"""The long-context savers as planner knobs: which apply, the order they are tried in, the loss chunk sizes."""

from __future__ import annotations

import math
from dataclasses import replace

from lowmem_ft.choosing import fixed_knobs, setup_from_recipe
from lowmem_ft.memory.arch import load_architecture
from lowmem_ft.memory.long_context import SAVER_COST, SAVERS, chunk_sizes, saver_stages
from lowmem_ft.memory.planner import Request, plan
from lowmem_ft.memory.target import Target
from lowmem_ft.recipe.load import resolve

LLAMA8 = load_architecture("meta-llama/Llama-3.1-8B")


def request(vram, tier, overrides=None, gpus=1) -> Request:
    """What `lowmem_ft.choosing` asks the planner for a tier recipe with these overrides."""
    recipe = resolve(tier, overrides)
    return Request(
        setup_from_recipe(recipe),
        Target(vram, recipe.memory.safety_margin_gb, gpus),
        recipe.memory.gradient_accumulation,
        fixed=fixed_knobs(overrides or {}),
    )


def _at(vram, tier, seq, arch=LLAMA8):
    return plan(arch, request(vram, tier, {"memory": {"max_seq_len": seq}}))


def test_saver_stages_go_cheapest_first_with_tiles_from_large_to_small():
    start = request(24, "24gb").start
    stages = saver_stages(LLAMA8, start, frozenset(), 1)
    assert stages[0] == {"mlp_tile_tokens": 0}  # the start as it is
    costs = [math.prod(SAVER_COST[name] for name in SAVERS if stage.get(name)) for stage in stages]
    assert costs == sorted(costs)
    sets = {tuple(name for name in SAVERS if stage.get(name)) for stage in stages}
    assert len(sets) == 2 ** len(SAVERS)  # every set of the four, once
    tiled = [s["mlp_tile_tokens"] for s in stages if s.get("tiled_mlp") and not s.get("tiled_norms")
             and not s.get("recompute_lora") and not s.get("embeddings_on_host")]  # fmt: skip
    assert tiled == [0, 1024, 256]  # hidden_size (4096) first, then smaller tiles


def test_savers_are_tried_only_where_they_apply():
    def tried(arch, vram=24, tier="24gb", overrides=None, gpus=1) -> set[str]:
        r = request(vram, tier, overrides, gpus=gpus)
        stages = saver_stages(arch, r.start, r.fixed, gpus)
        return {name for stage in stages for name in SAVERS if stage.get(name)}

    assert tried(LLAMA8) == set(SAVERS)
    tied = load_architecture("Qwen/Qwen2.5-0.5B")  # tie_word_embeddings: the table is the lm_head too
    assert tied.tie_embeddings and "embeddings_on_host" not in tried(tied)
    assert "embeddings_on_host" not in tried(LLAMA8, gpus=2)  # one process per device: not with DDP / FSDP
    full = {"adapter": {"kind": "full"}, "model": {"quantization": "none"}}
    assert tried(LLAMA8, 40, "40gb", full) == {"tiled_norms", "tiled_mlp"}
    moe = replace(LLAMA8, experts=8)
    assert "tiled_mlp" not in tried(moe)
    assert not {"tiled_norms", "recompute_lora"} & tried(moe)  # their terms are fitted on dense blocks only
    p = _at(24, "24gb", 24_576, arch=moe)
    assert not p.setup.tiled_mlp and p.reasons["tiled_mlp"].startswith("off: a mixture of 8 experts")
    assert p.reasons["tiled_norms"].startswith("off: not measured on a mixture of experts")
    p = _at(24, "24gb", 65536, arch=tied)
    assert p.reasons["embeddings_on_host"].startswith("off: the input embeddings are tied")


def test_chunk_sizes_are_kernel_friendly_and_only_grow():
    assert chunk_sizes(100_000, 16)[:5] == [16, 32, 64, 128, 256] and chunk_sizes(100_000, 16)[-1] == 4096
    assert all(k % 128 == 0 for k in chunk_sizes(100_000, 16) if k >= 128)
    assert chunk_sizes(300, 130) == [130, 256, 300]  # the searched chunk first, then larger, then all 300 at once
    assert chunk_sizes(10, 10) == [10]
