"""The planner: fits under the budget, prefers fewer savings, keeps what the user fixed, explains failures."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lowmem_ft.errors import UserError
from lowmem_ft.memory.arch import load_architecture
from lowmem_ft.memory.estimate import NF4_STATE_BYTES, Setup, estimate
from lowmem_ft.memory.planner import Request, max_seq_len, plan, round_seq_len
from lowmem_ft.memory.target import Target
from lowmem_ft.planning import fixed_knobs, plan_setup, setup_from_recipe
from lowmem_ft.recipe.load import resolve

QWEN7 = load_architecture("Qwen/Qwen2.5-7B")


def request(vram, tier, overrides=None, gpus=1, **kw) -> Request:
    """What `lowmem_ft.planning` asks the planner for a tier recipe with these overrides."""
    recipe = resolve(tier, overrides)
    return Request(
        setup_from_recipe(recipe),
        Target(vram, recipe.memory.safety_margin_gb, gpus),
        recipe.memory.gradient_accumulation,
        recipe.memory.eval_batch_size,
        fixed=fixed_knobs(overrides or {}),
        **kw,
    )


def _plan(vram, tier, overrides=None, arch=QWEN7, **kw):
    return plan(arch, request(vram, tier, overrides, **kw))


def test_budget_is_vram_less_margin_in_one_place():
    target = Target(24, 1.5)
    assert target.budget_gb == 22.5 and target.to_dict()["budget_gb"] == 22.5
    p = _plan(24, "24gb")
    assert p.budget_gb == p.target.budget_gb == 22.5
    assert p.to_dict()["budget_gb"] == 22.5 and p.to_dict()["vram_gb"] == 24


def test_lengths_follow_one_rounding_rule():
    assert [round_seq_len(n) for n in (1, 16, 17, 49, 900)] == [16, 16, 32, 64, 912]
    assert [round_seq_len(n, up=False) for n in (15, 16, 31, 1000)] == [0, 16, 16, 992]


@pytest.mark.parametrize(("vram", "tier"), [(8, "8gb"), (24, "24gb"), (40, "40gb")])
def test_plan_fits_budget(vram, tier):
    p = _plan(vram, tier)
    assert p.fits and p.estimate.peak_gb <= vram - p.margin_gb
    eff = resolve(tier).memory
    assert p.effective_batch >= eff.micro_batch_size * eff.gradient_accumulation
    assert set(p.reasons) >= {"quantization", "gradient_checkpointing", "micro_batch_size", "max_seq_len"}


def test_more_vram_means_fewer_savings():
    small, big = _plan(24, "24gb"), _plan(80, "40gb")
    assert big.setup.quantization == "none"
    assert not big.setup.gradient_checkpointing
    assert small.setup.gradient_checkpointing or small.setup.quantization != "none"


def test_fixed_keys_are_kept():
    p = _plan(40, "40gb", {"memory": {"gradient_checkpointing": True, "micro_batch_size": 1}})
    assert p.setup.gradient_checkpointing and p.setup.micro_batch_size == 1
    assert "set by you" in p.reasons["gradient_checkpointing"]
    assert {"gradient_checkpointing", "micro_batch_size"}.isdisjoint(p.changeable) and "quantization" in p.changeable


def test_fixed_accumulation_is_kept_and_a_changed_effective_batch_is_said():
    """#16: the planner used to recompute a gradient_accumulation the user had fixed."""
    free = _plan(24, "24gb")
    assert free.setup.micro_batch_size * free.gradient_accumulation == 2 * 8  # the tier's effective batch kept
    fixed = _plan(24, "24gb", {"memory": {"gradient_accumulation": 2}})
    assert fixed.gradient_accumulation == 2 and fixed.setup.micro_batch_size == 4
    assert "accumulation 2 (set by you) makes the effective batch 8, not 4" in fixed.reasons["micro_batch_size"]


def test_nothing_fits_says_what_would():
    with pytest.raises(UserError, match=r"needs .* GB at seq 8192 even with NF4.*--seq-len \d+"):
        _plan(8, "8gb", {"memory": {"max_seq_len": 8192}})
    with pytest.raises(UserError, match="smaller model"):
        _plan(8, "8gb", arch=load_architecture("Qwen/Qwen2.5-72B"))


def test_full_finetune_that_cannot_fit_names_the_adapter_that_does():
    with pytest.raises(UserError) as info:
        _plan(24, "40gb", {"adapter": {"kind": "full"}})
    message = str(info.value)
    assert "needs" in message and "even with 16-bit weights" in message
    assert "LoRA (16-bit weights) fits: predicted peak" in message and "drop adapter.kind=full" in message
    with pytest.raises(UserError, match=r"QLoRA \(nf4\) fits: predicted peak [\d.]+ GB of the 7.2 GB budget"):
        _plan(8, "8gb", {"adapter": {"kind": "full"}, "model": {"quantization": "none"}})


def test_savers_buy_context():
    base = {"memory": {"micro_batch_size": 1}}
    no_savers = {"memory": {"micro_batch_size": 1, "activation_offloading": False, "chunked_loss": False}}
    with_savers = max_seq_len(QWEN7, request(24, "24gb", base), limit=65536)
    assert with_savers > max_seq_len(QWEN7, request(24, "24gb", no_savers), limit=65536)
    assert with_savers % 16 == 0


def test_estimate_components_respond_to_knobs():
    s = Setup(max_seq_len=2048)
    e = estimate(QWEN7, s).by_name()
    weights = QWEN7.num_layers * sum(lin.in_features * lin.out_features for lin in QWEN7.linears)  # biases stay 16-bit
    assert e["base weights (linears)"] == pytest.approx(weights * 4.127 / 8, rel=1e-3)
    no_dq = estimate(QWEN7, Setup(double_quant=False)).by_name()["base weights (linears)"]
    constants = QWEN7.num_layers * len(QWEN7.linears) * NF4_STATE_BYTES  # each linear's NF4 code (QuantState)
    assert no_dq == pytest.approx(weights * 4.5 / 8 + constants, rel=1e-6)
    hf = estimate(QWEN7, Setup(max_seq_len=2048, loss_impl="hf_full")).by_name()["logits / loss working set"]
    assert hf > 10 * e["logits / loss working set"]  # full fp32 logits vs TRL's tiles
    off = estimate(QWEN7, Setup(max_seq_len=2048, activation_offloading=True)).by_name()
    assert off["checkpointed layer inputs (offloaded to host)"] == 0
    full = estimate(QWEN7, Setup(adapter="full", quantization="none", optimizer="adamw_torch")).by_name()
    assert full["optimizer states (adamw_torch)"] == pytest.approx(4 * QWEN7.total_params, rel=1e-6)


# -- several GPUs: the plan is per device ------------------------------------------------------------------------
QLORA = {"model": {"quantization": "nf4"}}


def test_72b_qlora_on_4x24_needs_fsdp():
    arch = load_architecture("Qwen/Qwen2.5-72B")
    p = _plan(24, "24gb", QLORA, arch=arch, gpus=4)
    assert p.strategy == "fsdp" and not p.offload and p.fits
    with pytest.raises(UserError, match="per device with DDP"):
        _plan(24, "24gb", QLORA, arch=arch, gpus=4, strategy="ddp")
    # the NF4 base (~36 GB of packed weights + 5 GB of 16-bit embeddings/head) is divided over 4, constants are not
    share = p.share
    assert share is not None and 10 < share.weights / 1e9 < 12.5
    assert p.to_dict()["per_device"]["gathered_gb"] > 5  # the root unit (embeddings + lm_head) stays gathered
    assert "DDP" in p.reasons["strategy"] and "over the budget" in p.reasons["strategy"]


def test_7b_qlora_on_2x24_stays_ddp():
    p = _plan(24, "24gb", QLORA, gpus=2)
    assert p.strategy == "ddp" and p.fits and "fits whole" in p.reasons["strategy"]
    one = _plan(24, "24gb", QLORA)
    # DDP keeps everything of one device and adds its gradient buckets (one more copy of the LoRA gradients)
    grads = one.estimate.by_name()["gradients"]
    assert p.share.comm_buffers == pytest.approx(grads)
    assert p.effective_batch >= one.effective_batch
    assert f"= {p.effective_batch} per optimizer step" in p.reasons["micro_batch_size"]


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
    arch = load_architecture("Qwen/Qwen2.5-72B")
    fixed = {**QLORA, "memory": {"max_seq_len": 1024}}
    p = _plan(16, "24gb", fixed, arch=arch, gpus=2)
    assert p.strategy == "fsdp" and p.offload
    assert p.setup.optimizer == "adamw_torch"  # bitsandbytes optimizers cannot step on the host
    assert p.share.host > 0 and p.share.weights < 2e9  # only the replicated NF4 constants stay
    with pytest.raises(UserError, match="FSDP full shard"):
        _plan(16, "24gb", fixed, arch=arch, gpus=2, offload=False)


def test_eval_batch_is_the_widest_whose_eval_forward_fits():
    from lowmem_ft.memory.estimate import GB, eval_peak_bytes

    p = _plan(24, "24gb")
    b, setup = p.setup.micro_batch_size, p.setup
    assert p.eval_batch_size >= b
    assert eval_peak_bytes(QWEN7, setup, p.eval_batch_size) / GB <= p.budget_gb
    wider = min(64, p.eval_batch_size * 2)
    if wider > p.eval_batch_size and wider <= 8 * b:
        assert eval_peak_bytes(QWEN7, setup, wider) / GB > p.budget_gb
    # no gradients or saved activations: an eval forward at the training batch needs less than the training step
    assert eval_peak_bytes(QWEN7, setup, b) < p.estimate.peak_bytes
    assert "eval forward needs" in p.reasons["eval_batch_size"]


def test_eval_batch_set_by_the_user_is_kept():
    p = _plan(24, "24gb", {"memory": {"eval_batch_size": 3}})
    assert p.eval_batch_size == 3 and "set by you" in p.reasons["eval_batch_size"]


# -- the sequence length: chosen from the data by lowmem_ft.planning -----------------------------------------------
def _plan_for_data(vram, tier, profile, overrides=None):
    recipe = resolve(tier, overrides)
    target = Target(vram, recipe.memory.safety_margin_gb)
    return plan_setup(QWEN7, recipe, target, fixed_knobs(overrides or {}), profile=profile)


def test_profile_picks_p99_length_rounded_up():
    from lowmem_ft.data.profile import LengthProfile

    p = _plan_for_data(24, "24gb", LengthProfile.from_lengths([200] * 50 + [900] * 49 + [3000]))
    assert p.setup.max_seq_len == 912  # p99 900, up to a multiple of 16
    assert p.reasons["max_seq_len"] == "912 tokens covers 99 % of samples (longer ones truncate) (p99 900, max 3000)"


def test_p99_too_long_for_the_budget_plans_the_longest_length_that_fits():
    from lowmem_ft.data.profile import LengthProfile

    profile = LengthProfile.from_lengths([500] * 90 + [30_000] * 10)  # p99 30,000 tokens: far over 8 GB
    p = _plan_for_data(8, "8gb", profile)
    length = p.setup.max_seq_len
    assert p.fits and 500 <= length < 30_000 and length % 16 == 0
    assert "the longest that fits (p99 30000 does not); 10 samples longer" in p.reasons["max_seq_len"]
    with pytest.raises(UserError):  # one more step of 16 tokens no longer fits
        _plan(8, "8gb", {"memory": {"max_seq_len": length + 16}})


def test_a_length_the_user_fixed_is_not_shortened():
    from lowmem_ft.data.profile import LengthProfile

    with pytest.raises(UserError, match="needs .* at seq 30000"):
        _plan_for_data(8, "8gb", LengthProfile.from_lengths([100] * 10), {"memory": {"max_seq_len": 30_000}})


def test_the_planner_searches_setups_not_recipes():
    """No recipe round-trip per candidate: every setup the planner tries is a `replace` of the start."""
    start = request(24, "24gb")
    p = plan(QWEN7, start)
    assert replace(start.start, **{k: getattr(p.setup, k) for k in ("quantization", "optimizer", "micro_batch_size",
                   "gradient_checkpointing", "activation_offloading", "loss_impl")}) == p.setup  # fmt: skip
