"""The estimate's family-dependent terms: the attention that actually runs, masked layers, q/k norms, softcaps.

Exactness against measurement is benchmarks/estimator_zoo.md (scripts/validate_estimator.py --zoo); these tests pin
what each term depends on, from the arithmetic alone.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from devkit.zoo import estimator_config
from lowmem_ft.memory.arch import Architecture, load_architecture
from lowmem_ft.memory.estimate import (
    Setup,
    eager_scores_bytes,
    effective_setup,
    estimate,
    layer_activation_bytes,
    loss_bytes,
    masked_layers,
)

CPU = Setup(device="cpu", quantization="none", micro_batch_size=1, max_seq_len=256)


def test_plan_counts_eager_where_sdpa_is_refused():
    """Gemma-2 asked for sdpa trains with eager: its s² scores are in the estimate, and a note says why."""
    gemma2 = load_architecture("google/gemma-2-9b")
    s = Setup(max_seq_len=4096, gradient_checkpointing=True)
    est = estimate(gemma2, s)
    assert est.setup.attn_implementation == "eager"
    assert any(n.startswith("attention: SDPA cannot apply Gemma-2") for n in est.notes)
    eager = est.by_name()["eager attention scores (s²)"]
    # bf16: fp32 softmax output + bf16 probabilities + bf16 tanh output, 16 heads × 4096², one layer (checkpointing)
    assert eager == (4 + 2 + 2) * 16 * 4096**2
    llama = load_architecture("meta-llama/Llama-3.1-8B")
    assert "eager attention scores (s²)" not in estimate(llama, s).by_name()
    assert effective_setup(llama, s) == (s, None)


def test_eager_scores_without_softcap():
    arch = Architecture.from_config(estimator_config("llama3"))
    s = replace(CPU, attn_implementation="eager", compute_dtype="bfloat16")
    assert eager_scores_bytes(arch, s) == (4 + 2) * arch.num_heads * 256**2


def test_sliding_window_layers_get_a_mask_once_the_sequence_reaches_the_window():
    gemma3 = Architecture.from_config(estimator_config("gemma3"))  # window 64, 2 of 3 layers sliding
    assert masked_layers(gemma3, replace(CPU, max_seq_len=63)) == 0
    assert masked_layers(gemma3, replace(CPU, max_seq_len=64)) == 2  # kv_length >= window
    assert masked_layers(gemma3, replace(CPU, micro_batch_size=2, max_seq_len=32)) == 3  # padding: every layer
    assert masked_layers(gemma3, replace(CPU, attn_implementation="eager")) == 0
    s = replace(CPU, max_seq_len=128)
    c, q, kv = 2, gemma3.num_heads * gemma3.head_dim, gemma3.num_kv_heads * gemma3.head_dim
    extra = layer_activation_bytes(gemma3, s, masked=True) - layer_activation_bytes(gemma3, s, masked=False)
    assert extra == c * 128 + 2 * c * (q - kv)  # the c-byte mask row and k/v repeated to every head
    mistral = load_architecture("mistralai/Mistral-7B-v0.1")
    assert masked_layers(mistral, replace(CPU, max_seq_len=4095)) == 0
    assert masked_layers(mistral, replace(CPU, max_seq_len=8192)) == 32


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_qk_norm_keeps_fp32_q_and_k(family):
    config = estimator_config(family)
    with_norm = Architecture.from_config(config)
    without = replace(with_norm, qk_norm=False)
    q, kv = with_norm.num_heads * with_norm.head_dim, with_norm.num_kv_heads * with_norm.head_dim
    heads = with_norm.num_heads + with_norm.num_kv_heads
    diff = layer_activation_bytes(with_norm, CPU) - layer_activation_bytes(without, CPU)
    assert diff == 4 * (q + kv) + 4 * heads


def test_trl_head_softcap_holds_one_more_fp32_tile_on_the_cpu():
    gemma2 = Architecture.from_config(estimator_config("gemma2"))
    plain = replace(gemma2, final_logit_softcapping=None)
    s = replace(CPU, loss_impl="trl_fused")
    fwd, bwd, _ = loss_bytes(gemma2, s)
    fwd0, bwd0, _ = loss_bytes(plain, s)
    tile = min(255, 4096) * min(gemma2.vocab_size, 32768) * 4
    assert fwd == fwd0 and bwd - bwd0 == tile
    assert loss_bytes(gemma2, replace(s, device="cuda")) == loss_bytes(plain, replace(s, device="cuda"))
