"""Generation memory arithmetic, checked against the KV cache transformers actually allocates."""

from __future__ import annotations

import pytest

from lowmem_ft.memory.arch import Architecture
from lowmem_ft.memory.estimate import GB
from lowmem_ft.memory.inference import (
    kv_bytes_per_token,
    kv_cache_bytes,
    plan_generation,
    prefill_workspace_bytes,
)

# Qwen2.5-7B's config.json (hub: Qwen/Qwen2.5-7B), the keys the arch reads
QWEN25_7B = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "num_hidden_layers": 28,
    "vocab_size": 152064,
    "max_position_embeddings": 131072,
}


def test_kv_cache_of_qwen25_7b():
    arch = Architecture.from_config(QWEN25_7B)
    # 2 × 28 layers × 4 kv heads × 128 × 2 bytes = 57,344 B per token; the full 131,072-token context is 7 GiB
    assert kv_cache_bytes(arch, 1, 2) == 57_344
    assert kv_cache_bytes(arch, 131_072, 2) == 7 * 2**30
    assert kv_cache_bytes(arch, 10, 2, batch=3) == 3 * 10 * 57_344


def test_plan_bounds_new_tokens_by_what_is_left():
    arch = Architecture.from_config(QWEN25_7B)
    weights = 5 * GB
    common = dict(weights_bytes=weights, reserve_bytes=GB, prompt_tokens=100, bytes_per_value=2)
    roomy = plan_generation(arch, budget_bytes=24 * GB, requested_new_tokens=512, **common)
    assert roomy.max_new_tokens == 512 and not roomy.bounded

    workspace = prefill_workspace_bytes(arch, 100, 2)
    per_token = kv_bytes_per_token(arch, 2)
    budget = weights + GB + workspace + int(300 * per_token)  # room for exactly 300 cached tokens
    tight = plan_generation(arch, budget_bytes=budget, requested_new_tokens=512, **common)
    assert tight.max_total_tokens == 300
    assert tight.max_new_tokens == 200 and tight.bounded
    assert "300 tokens" in tight.describe()

    over = plan_generation(arch, budget_bytes=weights, requested_new_tokens=512, **common)
    assert over.max_new_tokens < 1
    assert "over the" in over.describe()


def test_plan_never_exceeds_the_models_positions():
    arch = Architecture.from_config({**QWEN25_7B, "max_position_embeddings": 1000})
    plan = plan_generation(
        arch,
        budget_bytes=80 * GB,
        weights_bytes=GB,
        reserve_bytes=0,
        prompt_tokens=900,
        requested_new_tokens=512,
        bytes_per_value=2,
    )
    assert plan.max_new_tokens == 100


def test_kv_term_matches_the_cache_transformers_allocates(tiny_model):
    """Measured: the bytes of every key/value tensor in the DynamicCache after a real generate()."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    out = model.generate(
        ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, return_dict_in_generate=True, pad_token_id=0
    )
    cache = getattr(out, "cache", None) or out.past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    # the last generated token is never fed back, so the cache holds prompt + new - 1 positions
    tokens = ids.shape[1] + 6 - 1
    arch = Architecture.from_config(model.config.to_dict())
    assert held == kv_cache_bytes(arch, tokens, bytes_per_value=2)
    assert held == pytest.approx(kv_bytes_per_token(arch, 2) * tokens, rel=1 / arch.num_layers)


def test_moe_prefill_workspace_covers_the_experts_forward():
    """A mixture of experts runs each prompt token through top-k experts: the dense formula with one expert's width
    (3 × I) was 7 × short of the measured no-grad forward of a Qwen3-MoE-shaped model (top-8); the MoE term covers
    it (measured with PeakMemory, prompt of 512 tokens, bf16; logits excluded on both sides)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from devkit.harness.moe import MOE_SHAPES
    from lowmem_ft.train.measure.peak import PeakMemory

    config = {**MOE_SHAPES["qwen3_moe"], "num_hidden_layers": 1}
    arch = Architecture.from_config(config)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.bfloat16)
    ids = torch.randint(0, 1000, (1, 512))
    with torch.no_grad(), PeakMemory(roots=[model, ids]) as pm:
        base = pm.live_bytes
        model.model(input_ids=ids, use_cache=False)
    measured = pm.peak_bytes - base
    predicted = prefill_workspace_bytes(arch, 512, 2) - arch.vocab_size * 4
    dense = (4 * arch.hidden_size + 3 * arch.moe.intermediate_size) * 512 * 2
    assert dense < measured / 4
    assert measured <= predicted <= 1.5 * measured
