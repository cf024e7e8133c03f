"""The memory model's terms found by measuring real runs exactly (lowmem_ft/memory/estimate.py): the phases of a real
run (`phase_peak_bytes`), 32-bit optimizer states of embeddings under the Trainer, bitsandbytes' CPU step
temporaries, the evaluation peak, and NF4's per-linear constants. (Not test_estimate.py: branches in flight add that
file; these tests join it at the merge.)"""

from __future__ import annotations

from dataclasses import replace

import pytest

from lowmem_ft.memory.arch import Architecture
from lowmem_ft.memory.estimate import (
    NF4_DQ_STATE_BYTES,
    Setup,
    estimate,
    eval_mlp_bytes,
    eval_peak_bytes,
    optimizer_state_bytes,
    optimizer_step_temp,
    phase_peak_bytes,
    trainer_fp32_states,
    weight_bytes,
)

TINY = Architecture.from_config(
    {"model_type": "qwen2", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
     "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False},
    "tiny",
)  # fmt: skip
CPU = Setup(gradient_accumulation=1, quantization="none", compute_dtype="float32", optimizer="adamw_torch", gradient_checkpointing=False,
            micro_batch_size=4, max_seq_len=48, device="cpu")  # fmt: skip


def test_phases_of_a_real_run_drop_what_is_not_alive_yet():
    est = estimate(TINY, CPU).by_name()
    steady = phase_peak_bytes(TINY, CPU, "forward")
    assert steady == estimate(TINY, CPU).phases["forward"]
    # the first forward of an optimizer step runs without gradients (zero_grad sets them to None) ...
    assert steady - phase_peak_bytes(TINY, CPU, "forward", grads=False) == est["gradients"]
    # ... and its backward creates them as it goes: at the loss's backward, which sets this peak, none exist yet
    first = phase_peak_bytes(TINY, CPU, "backward", grads=False)
    assert phase_peak_bytes(TINY, CPU, "backward") - first == est["gradients"]
    assert first == estimate(TINY, CPU).first_micro_batch["backward"]
    # before the first optimizer step there are no states
    states = est["optimizer states (adamw_torch)"]
    assert steady - phase_peak_bytes(TINY, CPU, "forward", states=False) == states
    assert phase_peak_bytes(TINY, CPU, "eval") == eval_peak_bytes(TINY, CPU, CPU.micro_batch_size)


def test_one_micro_batch_per_step_never_holds_the_gradients_beside_the_activations():
    """The plan's peak: at accumulation 1 every micro batch is a first one (zero_grad set the gradients to None);
    above 1 the later ones accumulate into the gradients, so the steady state holds them all."""
    full = replace(CPU, adapter="full")
    one, two = estimate(TINY, full), estimate(TINY, replace(full, gradient_accumulation=2))
    grads = one.by_name()["gradients"]
    assert two.model_peak_bytes == two.steady_peak_bytes == two.phases["backward"]
    assert one.model_peak_bytes == one.first_micro_batch["backward"] == one.phases["backward"] - grads


def test_ddp_optimizer_phase_holds_a_flat_copy_of_the_gradients():
    full = replace(CPU, adapter="full")  # gradients as large as the weights
    est = estimate(TINY, full)
    ddp = phase_peak_bytes(TINY, full, "optimizer step", ddp=True)
    assert ddp == max(est.phases["optimizer step"], est.phases["static"] + est.by_name()["gradients"])
    assert ddp > phase_peak_bytes(TINY, full, "optimizer step")


def test_phases_are_the_cpu_form_only():
    with pytest.raises(ValueError, match="CPU form"):
        phase_peak_bytes(TINY, replace(CPU, device="cuda"), "forward")


def test_the_trainer_keeps_embedding_states_in_32_bits_under_8bit_optimizers():
    full8 = replace(CPU, adapter="full", optimizer="adamw_8bit")
    assert trainer_fp32_states(TINY, full8) == TINY.embedding_params
    assert trainer_fp32_states(TINY, replace(full8, adapter="lora")) == 0  # LoRA trains no embedding
    assert trainer_fp32_states(TINY, replace(full8, optimizer="adamw_torch")) == 0
    v_h = TINY.embedding_params  # the untied lm_head has the same shape: only one of the two stays 32-bit
    tensors = [(v_h, 4), (v_h, 4)]
    eight_bit = 2 * v_h + 2 * 4 * -(-v_h // 256)
    states, _ = optimizer_state_bytes(tensors, "adamw_8bit", "cpu", fp32_numel=v_h)
    assert states == eight_bit + 2 * 4 * v_h
    assert optimizer_state_bytes(tensors, "adamw_8bit", "cpu")[0] == 2 * eight_bit


@pytest.mark.parametrize(
    ("elem", "min_numel", "copies"),
    [(2, 4096, 6), (4, 4096, 5), (2, 10**9, 4), (4, 10**9, 3)],
    ids=["8bit-bf16", "8bit-fp32", "32bit-bf16", "32bit-fp32"],
)
def test_bitsandbytes_cpu_step_copies(elem, min_numel, copies):
    """Measured with PeakMemory inside the kernels (tests/train/measure/test_peak.py): fp32 copies per tensor."""
    n = 100_000
    fp32 = n if min_numel > n else 0  # a tensor below min_8bit_size, or one the Trainer keeps 32-bit
    temp, _ = optimizer_step_temp([(n, elem)], "adamw_8bit", "cpu", fp32_numel=fp32)
    assert temp == 4 * copies * n


def test_eval_peak_is_the_layer_or_the_loss_not_their_sum():
    """The tiny vocabulary's loss dominates: the eval peak is the loss's forward beside the final norm's output and
    the loss input, not the loss plus a layer's tensors (what the model summed before real runs were measured), and
    not beside the bool attention mask either: the base model's local, freed before the head runs."""
    from lowmem_ft.memory.estimate import BATCH_BYTES_PER_TOKEN, attention_mask_bytes, head_saved_bytes, loss_bytes
    from lowmem_ft.memory.evaluation import eval_layer_bytes

    s = replace(CPU, lora_dropout=0.0)
    static = sum(c.bytes for c in estimate(TINY, s).components if c.phase == "static" and c.name != "gradients")
    loss_fwd, _, _ = loss_bytes(TINY, s)
    batch = BATCH_BYTES_PER_TOKEN * s.tokens * 2  # the eval batch and the loader's next one
    mask = attention_mask_bytes(TINY, s)  # a padded batch: its bool mask, b × s × s
    assert mask == 4 * s.max_seq_len**2
    c = 4  # float32
    assert head_saved_bytes(TINY, s, eval_only=True) == c * TINY.hidden_size  # TRL's fused head: its c-byte copy
    head = 2 * c * TINY.hidden_size * s.tokens  # the final norm's output and that copy
    assert head + loss_fwd > eval_layer_bytes(TINY, s) + mask
    assert eval_peak_bytes(TINY, s, 4) == static + head + loss_fwd + batch


def test_eval_mlp_in_flight_as_measured():
    """Qwen2MLP under no_grad (PeakMemory, i 16384): 12.0 / 6.0 B per i-element plain (fp32 / bf16), 16.0 / 12.06
    with LoRA on its linears."""
    wide = replace(TINY, intermediate_size=16384)
    for dtype, plain, lora in (("float32", 12, 16), ("bfloat16", 6, 12)):
        s = replace(CPU, compute_dtype=dtype)
        assert eval_mlp_bytes(wide, replace(s, adapter="full")) == plain * 16384
        assert eval_mlp_bytes(wide, s) == lora * 16384


def test_nf4_weights_count_each_linears_quantization_constants():
    s = replace(CPU, quantization="nf4")
    packed, _, _ = weight_bytes(TINY, replace(s, double_quant=True))
    n_lin = TINY.num_layers * sum(lin.in_features * lin.out_features for lin in TINY.linears)
    linears = TINY.num_layers * len(TINY.linears)
    assert packed - n_lin * (4 + 8 / 64 + 32 / (64 * 256)) / 8 == pytest.approx(linears * NF4_DQ_STATE_BYTES)
    assert NF4_DQ_STATE_BYTES == 1092  # code 16 fp32 + offset + the 256-entry code of the absmax quantization


def test_a_sliding_window_the_sequence_reaches_costs_its_masks():
    """Mistral-7B-v0.1's 4,096-token window: at 8,192 tokens transformers builds a b × s × s bool mask (shared) and
    each layer's SDPA a c-byte additive copy; below the window neither exists (measured on the long-context
    yardstick: the model under-predicted such a run by 28 % without them)."""
    from lowmem_ft.memory.arch import load_architecture
    from lowmem_ft.memory.estimate import attention_mask_bytes

    arch = load_architecture("mistralai/Mistral-7B-v0.1")
    assert arch.sliding_window == 4096
    short, long = Setup(max_seq_len=4095), Setup(max_seq_len=8192)
    assert attention_mask_bytes(arch, short) == 0 and attention_mask_bytes(arch, long) == 8192**2
    names = estimate(arch, long).by_name()
    assert names["attention masks (s², bool)"] == 8192**2
    windowless = replace(arch, sliding_window=None, sliding_layers=0)
    extra = estimate(arch, long).model_peak_bytes - estimate(windowless, long).model_peak_bytes
    assert extra >= 8192**2 * (1 + 2)  # the shared bool mask and, at least, one layer's bf16 additive copy
