"""lowmem_ft/memory/preference.py: the rows, the reference pass and the reference choice (pure arithmetic)."""

from __future__ import annotations

from dataclasses import replace

from lowmem_ft.memory.arch import Architecture
from lowmem_ft.memory.estimate import Setup, phase_peak_bytes
from lowmem_ft.memory.preference import (
    choose_reference,
    method_setup,
    phase_peak,
    reference_pass_bytes,
    reference_weight_bytes,
    rows_per_micro_batch,
)

LLAMA_8B = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
}  # fmt: skip


def arch() -> Architecture:
    return Architecture.from_config(LLAMA_8B, "llama-8b")


def test_paired_methods_stack_two_rows_per_pair_without_dropout():
    s = Setup(micro_batch_size=3, lora_dropout=0.05)
    assert rows_per_micro_batch("sft", 3) == 3 and rows_per_micro_batch("dpo", 3) == 6
    dpo = method_setup("dpo", s)
    assert dpo.micro_batch_size == 6 and dpo.lora_dropout == 0.0 and dpo.loss_impl == "trl_fused"
    assert method_setup("orpo", s).loss_impl == "hf_full"  # TRL's experimental ORPO/CPO materialise the logits


def test_reference_pass_adds_to_the_forward_only_and_a_copy_adds_its_weights():
    a = arch()
    s = method_setup("dpo", Setup(device="cpu", gradient_checkpointing=True, micro_batch_size=1, max_seq_len=1024))
    assert reference_pass_bytes(a, s) > 0
    for phase in ("backward", "optimizer step"):
        sft = phase_peak_bytes(a, s, phase)
        assert phase_peak(a, s, phase, method="dpo", reference="adapter_disabled") == sft
    assert phase_peak(a, s, "forward", method="dpo", reference="adapter_disabled") >= phase_peak_bytes(a, s, "forward")
    full = replace(s, adapter="full", quantization="none")
    copy = reference_weight_bytes(a, full, "copy")
    assert copy == 2 * a.total_params  # bf16 weights, every parameter once
    assert (
        phase_peak(a, full, "backward", method="dpo", reference="copy") == phase_peak_bytes(a, full, "backward") + copy
    )


def test_reference_choice():
    a = arch()
    lora = Setup()
    assert choose_reference(a, lora, "dpo", pairs=1000, passes_over_data=1, budget_bytes=None,
                            policy_peak_bytes=0).kind == "adapter_disabled"  # fmt: skip
    assert choose_reference(a, lora, "simpo", pairs=1000, passes_over_data=1, budget_bytes=None,
                            policy_peak_bytes=0).kind == "none"  # fmt: skip
    full = Setup(adapter="full", quantization="none")
    epoch = choose_reference(a, full, "dpo", pairs=1000, passes_over_data=2, budget_bytes=None, policy_peak_bytes=0)
    assert epoch.kind == "precomputed" and epoch.host_bytes == 8000
    short = choose_reference(a, full, "dpo", pairs=1000, passes_over_data=0.1, budget_bytes=80e9, policy_peak_bytes=1e9)
    assert short.kind == "copy"
    tight = choose_reference(a, full, "dpo", pairs=1000, passes_over_data=0.1, budget_bytes=10e9, policy_peak_bytes=1e9)
    assert tight.kind == "precomputed" and "not fit" in tight.why
