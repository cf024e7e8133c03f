"""The planner: fits under the budget, prefers fewer savings, keeps what the user fixed, explains failures."""

from __future__ import annotations

import pytest

from lowmem_ft.errors import UserError
from lowmem_ft.memory.arch import load_architecture
from lowmem_ft.memory.estimate import Setup, estimate
from lowmem_ft.memory.planner import LengthProfile, max_seq_len, plan
from lowmem_ft.recipe.load import resolve

QWEN7 = load_architecture("Qwen/Qwen2.5-7B")


def _plan(vram, tier, overrides=None, **kw):
    overrides = {"model": {"name_or_path": "Qwen/Qwen2.5-7B"}, **(overrides or {})}
    return plan(QWEN7, vram, resolve(tier, overrides), fixed=overrides, **kw)


@pytest.mark.parametrize(("vram", "tier"), [(8, "8gb"), (24, "24gb"), (40, "40gb")])
def test_plan_fits_budget(vram, tier):
    p = _plan(vram, tier)
    assert p.fits and p.estimate.peak_gb <= vram - p.margin_gb
    eff = resolve(tier).memory
    assert p.recipe.memory.micro_batch_size * p.recipe.memory.gradient_accumulation >= (
        eff.micro_batch_size * eff.gradient_accumulation
    )
    assert set(p.reasons) >= {"quantization", "gradient_checkpointing", "micro_batch_size", "max_seq_len"}


def test_more_vram_means_fewer_savings():
    small, big = _plan(24, "24gb"), _plan(80, "40gb")
    assert big.recipe.model.quantization == "none"
    assert not big.recipe.memory.gradient_checkpointing
    assert small.recipe.memory.gradient_checkpointing or small.recipe.model.quantization != "none"


def test_fixed_keys_are_kept():
    p = _plan(40, "40gb", {"memory": {"gradient_checkpointing": True, "micro_batch_size": 1}})
    assert p.recipe.memory.gradient_checkpointing and p.recipe.memory.micro_batch_size == 1
    assert "set by you" in p.reasons["gradient_checkpointing"]


def test_profile_picks_p99_length():
    p = _plan(24, "24gb", profile={"p50": 200, "p99": 900, "max": 3000})
    assert p.recipe.memory.max_seq_len == 960
    assert LengthProfile.from_any({"p99": 5}).p99 == 5


def test_nothing_fits_says_what_would():
    with pytest.raises(UserError, match=r"needs .* GB at seq 8192 even with NF4.*--seq-len \d+"):
        _plan(8, "8gb", seq_len=8192)
    big = load_architecture("Qwen/Qwen2.5-72B")
    with pytest.raises(UserError, match="smaller model"):
        plan(big, 8, resolve("8gb", {"model": {"name_or_path": "Qwen/Qwen2.5-72B"}}))


def test_savers_buy_context():
    base = {"model": {"name_or_path": "Qwen/Qwen2.5-7B"}, "memory": {"micro_batch_size": 1}}
    no_savers = {**base, "memory": {"micro_batch_size": 1, "activation_offloading": False, "chunked_loss": False}}
    start = resolve("24gb", base)
    assert max_seq_len(QWEN7, 24, start, base, limit=65536) > max_seq_len(QWEN7, 24, start, no_savers, limit=65536)


def test_estimate_components_respond_to_knobs():
    s = Setup(max_seq_len=2048)
    e = estimate(QWEN7, s).by_name()
    weights = QWEN7.num_layers * sum(lin.in_features * lin.out_features for lin in QWEN7.linears)  # biases stay 16-bit
    assert e["base weights (linears)"] == pytest.approx(weights * 4.127 / 8, rel=1e-3)
    no_dq = estimate(QWEN7, Setup(double_quant=False)).by_name()["base weights (linears)"]
    assert no_dq == pytest.approx(weights * 4.5 / 8, rel=1e-6)
    hf = estimate(QWEN7, Setup(max_seq_len=2048, loss_impl="hf_full")).by_name()["logits / loss working set"]
    assert hf > 10 * e["logits / loss working set"]  # full fp32 logits vs TRL's tiles
    off = estimate(QWEN7, Setup(max_seq_len=2048, activation_offloading=True)).by_name()
    assert off["checkpointed layer inputs (offloaded to host)"] == 0
    full = estimate(QWEN7, Setup(adapter="full", quantization="none", optimizer="adamw_torch")).by_name()
    assert full["optimizer states (adamw_torch)"] == pytest.approx(4 * QWEN7.total_params, rel=1e-6)


# -- several GPUs: the plan is per device ------------------------------------------------------------------------
def _qlora(name):
    overrides = {"model": {"name_or_path": name, "quantization": "nf4"}}
    return load_architecture(name), resolve("24gb", overrides), overrides


def test_72b_qlora_on_4x24_needs_fsdp():
    arch, start, fixed = _qlora("Qwen/Qwen2.5-72B")
    p = plan(arch, 24, start, fixed=fixed, gpus=4)
    assert p.strategy == "fsdp" and not p.offload and p.fits
    with pytest.raises(UserError, match="per device with DDP"):
        plan(arch, 24, start, fixed=fixed, gpus=4, strategy="ddp")
    # the NF4 base (~36 GB of packed weights + 5 GB of 16-bit embeddings/head) is divided over 4, constants are not
    share = p.share
    assert share is not None and 10 < share.weights / 1e9 < 12.5
    assert p.to_dict()["per_device"]["gathered_gb"] > 5  # the root unit (embeddings + lm_head) stays gathered
    assert "DDP" in p.reasons["strategy"] and "over the budget" in p.reasons["strategy"]


def test_7b_qlora_on_2x24_stays_ddp():
    arch, start, fixed = _qlora("Qwen/Qwen2.5-7B")
    p = plan(arch, 24, start, fixed=fixed, gpus=2)
    assert p.strategy == "ddp" and p.fits and "fits whole" in p.reasons["strategy"]
    one = plan(arch, 24, start, fixed=fixed)
    # DDP keeps everything of one device and adds its gradient buckets (one more copy of the LoRA gradients)
    grads = one.estimate.by_name()["gradients"]
    assert p.share.comm_buffers == pytest.approx(grads)
    assert p.recipe.memory.gradient_accumulation * 2 * p.recipe.memory.micro_batch_size >= (
        one.recipe.memory.gradient_accumulation * one.recipe.memory.micro_batch_size
    )


def test_per_device_states_add_up_on_one_device():
    """With N = 1 the split of the states is the single-device estimate's static part, kind by kind."""
    from lowmem_ft.memory.sharding import per_device, states_of

    arch = load_architecture("Qwen/Qwen2.5-7B")
    for setup in (Setup(max_seq_len=512), Setup(quantization="none", adapter="full", optimizer="adamw_torch")):
        est = estimate(arch, setup)
        static = sum(c.bytes for c in est.components if c.phase == "static")
        share = per_device(states_of(arch, setup), "zero1", 1)  # zero1 on 1 device: no buckets, nothing gathered
        assert share.weights + share.gradients + share.optimizer == pytest.approx(static, rel=1e-9)


def test_offload_is_the_last_step_and_moves_states_to_host():
    arch, start, fixed = _qlora("Qwen/Qwen2.5-72B")
    fixed = {**fixed, "memory": {"max_seq_len": 1024}}
    p = plan(arch, 16, start, fixed=fixed, gpus=2)
    assert p.strategy == "fsdp" and p.offload
    assert p.recipe.optimizer.name == "adamw_torch"  # bitsandbytes optimizers cannot step on the host
    assert p.share.host > 0 and p.share.weights < 2e9  # only the replicated NF4 constants stay
    with pytest.raises(UserError, match="FSDP full shard"):
        plan(arch, 16, start, fixed=fixed, gpus=2, offload=False)


def test_eval_batch_is_the_widest_whose_eval_forward_fits():
    from lowmem_ft.memory.estimate import GB, eval_peak_bytes, setup_from_recipe

    arch = load_architecture("Qwen/Qwen2.5-7B")
    p = plan(arch, 24, resolve("24gb"))
    m = p.recipe.memory
    assert m.eval_batch_size >= m.micro_batch_size
    setup = setup_from_recipe(p.recipe)
    assert eval_peak_bytes(arch, setup, m.eval_batch_size) / GB <= p.budget_gb
    wider = min(64, m.eval_batch_size * 2)
    if wider > m.eval_batch_size and wider <= 8 * m.micro_batch_size:
        assert eval_peak_bytes(arch, setup, wider) / GB > p.budget_gb
    # no gradients or saved activations: an eval forward at the training batch needs less than the training step
    assert eval_peak_bytes(arch, setup, m.micro_batch_size) < p.estimate.peak_bytes
    assert "eval forward needs" in p.reasons["eval_batch_size"]


def test_eval_batch_set_by_the_user_is_kept():
    p = plan(load_architecture("Qwen/Qwen2.5-7B"), 24, resolve("24gb", {"memory": {"eval_batch_size": 3}}),
             fixed={"memory": {"eval_batch_size": 3}})  # fmt: skip
    assert p.recipe.memory.eval_batch_size == 3 and "set by you" in p.reasons["eval_batch_size"]


def test_p99_too_long_for_the_budget_plans_the_longest_length_that_fits():
    from lowmem_ft.data.profile import LengthProfile as DataProfile

    profile = DataProfile.from_lengths([500] * 90 + [30_000] * 10)  # p99 30,000 tokens: far over 8 GB
    p = plan(QWEN7, 8, resolve("8gb"), profile=profile)
    length = p.recipe.memory.max_seq_len
    assert p.fits and 500 <= length < 30_000
    assert "the longest that fits (p99 30000 does not); 10 samples longer" in p.reasons["max_seq_len"]
    with pytest.raises(UserError):  # one more step of 16 tokens no longer fits
        plan(QWEN7, 8, resolve("8gb"), seq_len=length + 16)


def test_a_length_the_user_fixed_is_not_shortened():
    with pytest.raises(UserError, match="needs .* at seq 30000"):
        plan(QWEN7, 8, resolve("8gb"), seq_len=30_000, profile={"p99": 100, "max": 100})
