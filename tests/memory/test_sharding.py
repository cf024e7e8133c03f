"""Per-device arithmetic against DeepSpeed's published ZeRO estimators, and what each strategy divides."""

import pytest

from lowmem_ft.memory.sharding import ModelStates, choose, deepspeed_states, per_device

GIB = 2**30


# DeepSpeed's estimators, transcribed from deepspeedai/DeepSpeed master (deepspeed/runtime/zero/stage_1_and_2.py
# `estimate_zero2_model_states_mem_needs`, stage3.py `estimate_zero3_model_states_mem_needs`, zero_init=True).
def ds_zero2(total_params, num_gpus_per_node=1, num_nodes=1, cpu_offload=True, additional_buffer_factor=1.5):
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem)


def ds_zero3(total_params, largest_layer_params, num_gpus_per_node=1, num_nodes=1, cpu_offload=True,
             cpu_offload_params=True, additional_buffer_factor=1.5):  # fmt: skip
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            gpu_mem = largest_layer_memory
            cpu_mem = total_params * 18 * gpus_factor * additional_buffer_factor
        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
            cpu_mem = total_params * 16 * gpus_factor * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        cpu_mem = None  # a loading buffer (largest layer × GPUs), not a training state: not modelled
    return cpu_mem, int(gpu_mem)


CASES = [  # (total params, largest layer params, gpus per node, nodes)
    (7_615_616_512, 544_997_376, 1, 1),  # Qwen2.5-7B-sized: embedding is the largest layer
    (7_615_616_512, 544_997_376, 4, 1),
    (72_706_203_648, 1_245_708_288, 8, 1),
    (72_706_203_648, 1_245_708_288, 8, 2),
    (2_783_500_000, 65_500_000, 2, 1),
]


@pytest.mark.parametrize("params,largest,gpus,nodes", CASES)
@pytest.mark.parametrize("offload_optimizer,offload_params", [(False, False), (True, False), (True, True)])
def test_zero3_matches_deepspeed(params, largest, gpus, nodes, offload_optimizer, offload_params):
    world = gpus * nodes
    share = per_device(
        deepspeed_states(params, largest),
        "zero3",
        world,
        offload_optimizer=offload_optimizer,
        offload_params=offload_params,
    )
    cpu, gpu = ds_zero3(params, largest, gpus, nodes, offload_optimizer, offload_params)
    assert share.device_bytes == pytest.approx(gpu, abs=1)
    if cpu is not None:
        assert share.host_per_node(gpus, buffer_factor=1.5) == pytest.approx(cpu, rel=1e-12)


@pytest.mark.parametrize("params,largest,gpus,nodes", CASES)
@pytest.mark.parametrize("offload", [False, True])
def test_zero2_matches_deepspeed(params, largest, gpus, nodes, offload):
    share = per_device(deepspeed_states(params, largest), "zero2", gpus * nodes, offload_optimizer=offload)
    cpu, gpu = ds_zero2(params, gpus, nodes, offload)
    assert share.device_bytes == pytest.approx(gpu, abs=1)
    if offload and nodes == 1 and gpus <= 4:
        # DeepSpeed's max(4 × GPUs, 16): above 4 GPUs, each process's fp32 copy at load time dominates
        assert share.host_per_node(gpus, buffer_factor=1.5) == pytest.approx(cpu, rel=1e-12)


def test_published_t0_3b_table():
    """transformers docs (deepspeed.md), `estimate_zero3_model_states_mem_needs_all_live` on bigscience/T0_3B:
    "2783M total params, 65M largest layer params" (printed truncated; midpoints used), GB = GiB, 2 decimals."""
    states = deepspeed_states(2_783_500_000, 65_500_000)
    published = {  # gpus: [(offload_param, offload_optimizer, per-CPU GB, per-GPU GB)]
        1: [(True, True, 70.00, 0.25), (False, True, 62.23, 5.43), (False, False, None, 46.91)],
        2: [(True, True, 70.00, 0.25), (False, True, 62.23, 2.84), (False, False, None, 23.58)],
    }
    for gpus, rows in published.items():
        for op, oo, cpu_gb, gpu_gb in rows:
            share = per_device(states, "zero3", gpus, offload_optimizer=oo, offload_params=op)
            assert share.device_bytes / GIB == pytest.approx(gpu_gb, abs=0.01)
            if cpu_gb is not None:
                assert share.host_per_node(gpus, 1.5) / GIB == pytest.approx(cpu_gb, abs=0.02)


def qlora_70b() -> ModelStates:
    """A QLoRA 72B-like model: ~40 GB NF4 base, 0.2 B fp32 LoRA params with 8-bit Adam (2 B/param)."""
    return ModelStates(
        frozen_weight_bytes=40e9,
        trainable_params=0.2e9,
        weight_bytes_per_param=4,
        grad_bytes_per_param=4,
        optimizer_bytes_per_param=2,
        largest_unit_params=0.97e9,
        largest_unit_bytes=0.52e9,
        largest_unit_trainable_params=2.5e6,
    )


def test_what_each_strategy_divides():
    s, n = qlora_70b(), 4
    ddp, z2, fsdp = (per_device(s, k, n) for k in ("ddp", "zero2", "fsdp"))
    assert ddp.weights == pytest.approx(40e9 + 0.8e9)
    assert ddp.comm_buffers == pytest.approx(ddp.gradients)  # DDP buckets: one more copy of the gradients
    assert z2.weights == ddp.weights and z2.gradients == pytest.approx(ddp.gradients / n)
    assert z2.optimizer == pytest.approx(ddp.optimizer / n)
    assert fsdp.weights == pytest.approx(ddp.weights / n)
    # BACKWARD_PRE: two units' parameters and one unit's gradients gathered at once
    assert fsdp.gathered == pytest.approx(2 * 0.52e9 + 2.5e6 * 4)
    off = per_device(s, "fsdp", n, offload_optimizer=True, offload_params=True)
    assert off.weights == off.gradients == off.optimizer == 0
    assert off.host == pytest.approx(fsdp.weights + ddp.optimizer / n)


def test_activations_pass_through_per_device():
    for strategy in ("ddp", "zero3", "fsdp"):
        assert per_device(qlora_70b(), strategy, 8, activations=3e9).activations == 3e9


def test_choose_prefers_ddp_when_the_model_fits_and_shards_when_not():
    small = ModelStates(
        frozen_weight_bytes=5e9, trainable_params=40e6, weight_bytes_per_param=4, grad_bytes_per_param=4
    )
    share, fits = choose(small, 4, 24e9, activations=2e9)
    assert fits and share.strategy == "ddp"
    share, fits = choose(qlora_70b(), 4, 24e9, activations=2e9)
    assert fits and share.strategy == "fsdp" and not share.offload_params
    assert share.device_bytes < 24e9 < per_device(qlora_70b(), "ddp", 4, activations=2e9).device_bytes
    share, fits = choose(qlora_70b(), 2, 8e9, activations=2e9)
    assert fits and share.offload_params  # 20 GB of base per device is too much: offload it
    share, fits = choose(qlora_70b(), 2, 2e9, activations=2e9)
    assert not fits and share.offload_params  # nothing fits: the smallest candidate


def test_invalid_combinations():
    with pytest.raises(ValueError, match="full-shard"):
        per_device(qlora_70b(), "zero2", 2, offload_params=True)
    with pytest.raises(ValueError, match="DDP"):
        per_device(qlora_70b(), "ddp", 2, offload_optimizer=True)


def test_fsdp2_rank_phases_shard_the_states_and_add_the_gathered_units():
    from lowmem_ft.memory.arch import Architecture
    from lowmem_ft.memory.estimate import Setup, estimate, phase_peak_bytes
    from lowmem_ft.memory.sharding import fsdp2_phase_bytes, states_of

    arch = Architecture.from_config(
        {"model_type": "llama", "vocab_size": 8192, "hidden_size": 256, "intermediate_size": 704,
         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True},
        name="llama",
    )  # fmt: skip
    s = Setup(adapter="lora", quantization="none", device="cpu", micro_batch_size=2, max_seq_len=128)
    states, est = states_of(arch, s), estimate(arch, s)
    two, four = fsdp2_phase_bytes(arch, s, 2), fsdp2_phase_bytes(arch, s, 4)
    whole = states.frozen_weight_bytes + states.trainable_params * (
        states.weight_bytes_per_param + states.grad_bytes_per_param + states.optimizer_bytes_per_param
    )
    # static: every state divided by the ranks, nothing gathered
    assert two["static"] == pytest.approx(est.phases["static"] - whole / 2)
    assert two["static"] - four["static"] == pytest.approx(whole / 4)
    # at the LM head (the LoRA forward's peak): the root unit and the last layer's all-gather buffer on top
    extra = states.resident_unit_bytes + states.unit_bytes
    assert two["forward"] == pytest.approx(phase_peak_bytes(arch, s, "forward") - whole / 2 + extra)
    assert two["optimizer step"] > two["static"]


def test_the_gpu_plan_of_fsdp2_is_per_phase_and_fsdp1_keeps_its_allowance():
    """`--strategy fsdp` on GPUs: FSDP2's per-phase rules (gathered units in the forward and backward only, the
    optimizer step on the shards); 4-bit weights stay on FSDP1, with the gathered allowance in every phase."""
    from dataclasses import replace

    from lowmem_ft.memory.arch import load_architecture
    from lowmem_ft.memory.estimate import Setup, estimate
    from lowmem_ft.memory.sharding import fsdp2_phases, per_device_estimate, states_of

    arch = load_architecture("meta-llama/Llama-3.1-8B")
    s = Setup(adapter="full", quantization="none", optimizer="adamw_torch", device="cuda", max_seq_len=4096)
    est, share = per_device_estimate(arch, s, 4, "fsdp", False)
    phases, held = fsdp2_phases(arch, estimate(arch, s), states_of(arch, s, fsdp2=True), share)
    assert est.phases == phases
    assert est.model_peak_bytes == max(phases[p] for p in ("forward", "backward", "optimizer step"))
    gathered = next(c for c in est.components if c.name == "gathered units (all-gather)")
    assert gathered.phase == "forward/backward" and gathered.bytes == held[max(("forward", "backward"), key=phases.get)]
    static = sum(c.bytes for c in est.components if c.phase == "static")
    assert static == pytest.approx(phases["static"])  # nothing gathered between micro-steps
    # AdamW on the 1/4 shards, fp32 under accelerate's mixed precision (foreach: one copy of the parameters)
    assert phases["optimizer step"] - phases["static"] == pytest.approx(4 * arch.total_params / 4, rel=1e-3)
    # ... whose weights, gradients and AdamW states are fp32 (16 B/param): twice a 16-bit full fine-tune's
    assert share.weights + share.gradients + share.optimizer == pytest.approx(16 * arch.total_params / 4, rel=1e-3)
    assert est.peak_bytes < per_device_estimate(arch, s, 2, "fsdp", False)[0].peak_bytes

    q = replace(s, adapter="lora", quantization="nf4", optimizer="paged_adamw_8bit")
    est1, share1 = per_device_estimate(arch, q, 4, "fsdp", False)
    assert not est1.phases and share1.gathered > 0
    assert next(c for c in est1.components if c.name.startswith("gathered")).phase == "static"


@pytest.mark.parametrize("dropout", [0.05, 0.0])
def test_fsdp_on_gpus_prices_lora_branches_in_the_compute_dtype(dropout):
    """Under FSDP's 16-bit mixed precision the LoRA weights are gathered in bf16, so peft casts no input to fp32
    (`_cast_input_dtype`): each adapted linear keeps its dropout mask and c-byte dropped copy, or without dropout the
    input itself, once per tensor (q/k/v share the norm's output, gate/up the MLP's, o_proj reads the attention
    output the attention keeps); lora_A's output is c bytes. DDP and one device keep peft's fp32 adapters."""
    from dataclasses import replace

    from lowmem_ft.memory.arch import load_architecture
    from lowmem_ft.memory.estimate import Setup
    from lowmem_ft.memory.linears import dropout_mask_bytes, lora_linears, peft_lora_input_bytes
    from lowmem_ft.memory.sharding import per_device_estimate

    arch = load_architecture("meta-llama/Llama-3.1-8B")
    s = Setup(quantization="none", optimizer="adamw_torch", lora_dropout=dropout, device="cuda", max_seq_len=4096)
    assert per_device_estimate(arch, s, 4, "fsdp", False)[0].setup.lora_in_compute_dtype
    assert not per_device_estimate(arch, s, 4, "ddp", False)[0].setup.lora_in_compute_dtype
    assert not per_device_estimate(arch, s, 1, "fsdp", False)[0].setup.lora_in_compute_dtype
    assert not per_device_estimate(arch, replace(s, device="cpu"), 4, "fsdp", False)[0].setup.lora_in_compute_dtype

    h, i, r = arch.hidden_size, arch.intermediate_size, s.lora_r
    lins = lora_linears(arch, s)  # q, k, v, o (h wide), gate, up (h), down (i)
    mixed = replace(s, lora_in_compute_dtype=True)
    for device, mask in (("cuda", 1), ("cpu", 2)):  # CUDA's bool mask; the CPU's noise in the input's dtype
        m = replace(mixed, device=device)
        drop = dropout_mask_bytes(m)
        inputs = (2 + mask) * (6 * h + i) if dropout else 2 * (h + h + i)
        assert drop == (mask if dropout else 0)
        assert peft_lora_input_bytes(arch, m, lins, drop) == inputs + 7 * 2 * r
    one = dropout_mask_bytes(s)  # peft's fp32 cast on one device: 4 B per input element, per linear
    assert peft_lora_input_bytes(arch, s, lins, one) == (4 + one) * (6 * h + i) + 7 * 4 * r
