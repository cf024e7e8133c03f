"""The device overheads (`lowmem_ft.memory.overheads`): the allocator's term by its setting, derived from the replays
that `devkit.bench.allocator_term` committed."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from lowmem_ft.memory import calibration as cal
from lowmem_ft.memory.arch import load_architecture
from lowmem_ft.memory.estimate import estimate
from lowmem_ft.memory.overheads import (
    ALLOCATOR_TERM_FULL_LOGITS,
    ALLOCATOR_TERMS,
    AllocatorTerm,
    allocator_block,
    allocator_name,
    device_overheads,
    transient_without_overheads,
)
from lowmem_ft.memory.records import Setup

ROOT = Path(__file__).resolve().parents[2]
ARCH = load_architecture("Qwen/Qwen2.5-0.5B")


def test_the_constants_are_what_the_committed_replays_give():
    """Expandable segments' terms are `derive` over benchmarks/allocator_term.json (the largest seen, as committed);
    the default settings keep the assumed fraction: the block form the same derivation gives is not taken
    (calibration says why)."""
    from devkit.bench.allocator_term import block_sizes, derive

    cache = json.loads((ROOT / "benchmarks" / "allocator_term.json").read_text())
    blocks = block_sizes(set(cache))
    for full in (False, True):
        term = ALLOCATOR_TERMS["expandable segments", full]
        assert derive(cache, blocks, "expandable", full) == term and term.with_gradients
        assert term.base >= cal.ALLOCATOR_PAGE_BYTES
        assert ALLOCATOR_TERMS["default", full] == AllocatorTerm(0, cal.ALLOCATOR_FRACTION, False)
        assert derive(cache, blocks, "default", full).blocks > 1
    # an adapter step with the full-logits loss: its own rows, blocks of its fp32 logits
    assert derive(cache, blocks, "expandable", False, True) == ALLOCATOR_TERM_FULL_LOGITS
    # the product's setting for adapters: well under the assumed 10 %; a full fine-tune: blocks and a small share
    assert ALLOCATOR_TERMS["expandable segments", False].fraction < cal.ALLOCATOR_FRACTION / 2
    assert ALLOCATOR_TERMS["expandable segments", True].fraction < 0.01
    assert ALLOCATOR_TERMS["expandable segments", True].blocks == pytest.approx(2.02)


def test_a_full_fine_tune_counts_the_tied_embedding_gradient_blocks_only():
    """Expandable segments: Llama-3.2-1B (tied) is allowed 2.02 of its 501 MiB bf16 embedding gradients beyond the
    base; Phi-3-mini (untied) the base alone, whatever its size; adapters no block."""
    s = Setup(quantization="none", adapter="full", optimizer="adamw_torch", max_seq_len=512)
    tied, untied = load_architecture("meta-llama/Llama-3.2-1B"), load_architecture("microsoft/Phi-3-mini-4k-instruct")
    assert tied.tie_embeddings and not untied.tie_embeddings
    assert allocator_block(tied, s) == 2 * tied.vocab_size * tied.hidden_size
    assert allocator_block(untied, s) == 0.0
    assert allocator_block(tied, replace(s, adapter="lora")) == 0.0
    for arch in (tied, untied):
        est = estimate(arch, s)
        (component,) = [c for c in est.components if c.name.startswith("allocator (")]
        share = component.bytes - cal.ALLOCATOR_BASE_EXPANDABLE_FULL - 2.02 * allocator_block(arch, s)
        assert 0 < share < 0.002 * est.model_peak_bytes  # 0.2 % of the churn, less than the live peak
        assert ("2.02 × the 0.53 GB block" in component.source) == (arch is tied)


def test_an_adapter_step_with_the_full_logits_loss_counts_blocks_of_its_fp32_logits():
    """Expandable segments: the full-logits loss's adapter step is allowed blocks of its fp32 logits and a base, no
    share of the churn; the fused head's step keeps the share and no block; a full fine-tune keeps its own term."""
    s = Setup(quantization="none", adapter="lora", loss_impl="hf_full", max_seq_len=512)
    fp32_logits = 4 * s.micro_batch_size * 512 * ARCH.vocab_size
    assert allocator_block(ARCH, s) == fp32_logits
    assert allocator_block(ARCH, replace(s, loss_impl="trl_fused")) == 0.0
    est = estimate(ARCH, s)
    (component,) = [c for c in est.components if c.name.startswith("allocator (")]
    term = ALLOCATOR_TERM_FULL_LOGITS
    assert term.blocks > 0 and not term.fraction
    assert component.bytes == pytest.approx(term.base + term.blocks * fp32_logits)
    assert f"{term.blocks:g} × the {fp32_logits / 1e9:.2f} GB block" in component.source
    assert allocator_block(ARCH, s, training=False) == 0.0  # an evaluation pass: no backward, no hole
    full = replace(s, adapter="full", optimizer="adamw_torch")
    assert allocator_block(ARCH, full) == 2 * ARCH.vocab_size * ARCH.hidden_size  # the tied embedding's gradient
    assert estimate(ARCH, full).allocator_block == allocator_block(ARCH, full)
    # far more churn than logits (a 32k vocabulary, 8k tokens, no checkpointing): the other adapters' share is larger
    phi3 = load_architecture("microsoft/Phi-3-mini-4k-instruct")
    long = replace(s, micro_batch_size=1, max_seq_len=8192, gradient_checkpointing=False)
    est = estimate(phi3, long)
    (component,) = [c for c in est.components if c.name.startswith("allocator (")]
    hole = term.base + term.blocks * allocator_block(phi3, long)
    assert component.bytes > hole and component.source.startswith("the larger of ")
    share = ALLOCATOR_TERMS["expandable segments", False]
    churn = (component.bytes - share.base) / share.fraction  # the transient and gradients it is a share of
    assert est.model_peak_bytes / 2 < churn < est.model_peak_bytes


def test_orpo_and_simpo_keep_the_other_adapters_term():
    """Their trainer keeps the logits through the backward, so the full-logits loss leaves no hole of them: their
    estimate prices the allocator as the other adapter steps' share, though their policy's setup is `hf_full`."""
    from lowmem_ft.memory.preference import method_estimate, method_setup

    share = ALLOCATOR_TERMS["expandable segments", False]
    for method in ("orpo", "simpo"):
        s = method_setup(method, Setup(quantization="none", adapter="lora", max_seq_len=512))
        assert s.loss_impl == "hf_full"
        est = method_estimate(ARCH, estimate(ARCH, s), method)
        (component,) = [c for c in est.components if c.name.startswith("allocator (")]
        assert f"{share.fraction:.1%}" in component.source and "block" not in component.source


def test_the_default_settings_block_is_the_steps_largest_tensor():
    """`largest_step_block`: the full-logits loss's fp32 logits; a full fine-tune's embedding gradient when larger."""
    s = Setup(quantization="none", adapter="lora", allocator="default", loss_impl="hf_full", max_seq_len=512)
    assert allocator_block(ARCH, s) == 4 * s.micro_batch_size * 512 * ARCH.vocab_size
    small = replace(s, adapter="full", micro_batch_size=1, max_seq_len=64)
    assert allocator_block(ARCH, small) == 2 * ARCH.vocab_size * ARCH.hidden_size


@pytest.mark.parametrize("adapter", ["lora", "full"])
@pytest.mark.parametrize("setting", ["expandable segments", "default"])
def test_the_plan_names_the_setting_and_prices_its_term(setting, adapter):
    s = Setup(quantization="none", adapter=adapter, optimizer="adamw_torch", allocator=setting, max_seq_len=512)
    est = estimate(ARCH, s)
    (component,) = [c for c in est.components if c.name.startswith("allocator (")]
    assert component.name == allocator_name(setting) == f"allocator ({setting.replace('default', 'default settings')})"
    term = ALLOCATOR_TERMS[setting, adapter == "full"]
    block = allocator_block(ARCH, s)
    assert est.allocator_block == block
    if not term.fraction:
        assert component.bytes == pytest.approx(term.base + term.blocks * block) and term.blocks
        return
    assert (
        f"{term.fraction:.1%}" in component.source or f"{term.fraction:.0%} of the transient peak" in component.source
    )
    assert component.source.endswith("(assumed)") == (setting == "default")  # no derived form for torch's defaults
    # what it is a fraction of: the step's transient peak (plus, where derived so, the gradients, which every
    # optimizer step frees): more than the gradients, less than the whole live peak
    of = (component.bytes - term.base - term.blocks * block) / term.fraction
    gradients = est.by_name()["gradients"]
    assert (of > gradients) == term.with_gradients or adapter == "lora"
    assert of < est.model_peak_bytes - (0 if term.with_gradients else gradients)
    assert sum(c.bytes for c in est.components if c.phase == "overhead") == pytest.approx(est.overhead_bytes)


@pytest.mark.parametrize("adapter", ["lora", "full"])
def test_the_overheads_taken_back_out_give_the_transient(adapter):
    for setting in ("expandable segments", "default"):
        s = Setup(allocator=setting, adapter=adapter)
        for block in (0.0, 5e8):
            with_overheads = 3e9 + sum(c.bytes for c in device_overheads(s, 3e9, block=block))
            assert transient_without_overheads(s, with_overheads, block=block) == pytest.approx(3e9)
    assert transient_without_overheads(Setup(device="cpu"), 3e9, block=5e8) == 3e9
    assert device_overheads(Setup(device="cpu"), 3e9, block=5e8) == []
