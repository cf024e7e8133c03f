"""The planner: fits under the budget, prefers fewer savings, keeps what the user fixed, explains failures."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lowmem_ft.choosing import fixed_knobs, plan_setup, setup_from_recipe
from lowmem_ft.errors import UserError
from lowmem_ft.memory.arch import load_architecture
from lowmem_ft.memory.estimate import NF4_STATE_BYTES, Setup, estimate
from lowmem_ft.memory.lengths import round_seq_len
from lowmem_ft.memory.planner import Request, max_seq_len, plan
from lowmem_ft.memory.target import Target
from lowmem_ft.recipe.load import resolve

QWEN7 = load_architecture("Qwen/Qwen2.5-7B")


def request(vram, tier, overrides=None, gpus=1, **kw) -> Request:
    """What `lowmem_ft.choosing` asks the planner for a tier recipe with these overrides."""
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
    with pytest.raises(UserError, match=r"needs .* GB at seq 65536 even with NF4.*tiled MLP.*--seq-len \d+"):
        _plan(8, "8gb", {"memory": {"max_seq_len": 65536}})
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
    from lowmem_ft.memory.estimate import BATCH
    from lowmem_ft.memory.sharding import per_device, states_of

    arch = load_architecture("Qwen/Qwen2.5-7B")
    for setup in (Setup(max_seq_len=512), Setup(quantization="none", adapter="full", optimizer="adamw_torch")):
        est = estimate(arch, setup)
        static = sum(c.bytes for c in est.components if c.phase == "static" and c.name != BATCH)  # not a state
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


# -- the sequence length: chosen from the data by lowmem_ft.choosing -----------------------------------------------
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
                   "gradient_accumulation", "gradient_checkpointing", "activation_offloading", "loss_impl")}) == p.setup  # fmt: skip
    assert p.setup.gradient_accumulation == p.gradient_accumulation  # the memory model holds the plan's window


def test_chunked_loss_is_never_chosen_where_it_is_not_verified():
    """A remote-code model (InternLM2's config shape, its `auto_map`): its forward may transform the logits, so the
    chunked loss is not among the setups the planner tries there (it is for a verified family), the reason line
    says why, and asking for it is refused."""
    from lowmem_ft.memory.arch import Architecture
    from lowmem_ft.memory.planner import _candidates

    remote = Architecture.from_config(
        {"model_type": "internlm2", "auto_map": {"AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM"},
         "vocab_size": 92544, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 32768},
        name="internlm/internlm2-7b",
    )  # fmt: skip
    assert remote.remote_code and not remote.chunked_loss_exact and QWEN7.chunked_loss_exact
    start = request(8, "8gb").start
    assert {s.loss_impl for s in _candidates(start, frozenset(), QWEN7)} == {"trl_fused", "chunked"}
    assert {s.loss_impl for s in _candidates(start, frozenset(), remote)} == {"trl_fused"}
    p = _plan(8, "8gb", {"memory": {"max_seq_len": 1024}}, arch=remote)
    assert p.setup.loss_impl == "trl_fused"
    assert p.reasons["chunked_loss"].startswith("off: not verified for model_type 'internlm2'")
    with pytest.raises(UserError, match="memory.chunked_loss is not verified for model_type 'internlm2'"):
        _plan(8, "8gb", {"memory": {"max_seq_len": 1024, "chunked_loss": True}}, arch=remote)


def test_qwen_v1_plans_as_qwen2_with_the_chunked_loss():
    """Qwen (v1) loads as the native Qwen2 (lowmem_ft.native): verified, so the chunked loss is a choice there."""
    from lowmem_ft.memory.planner import _candidates

    qwen_v1 = load_architecture("Qwen/Qwen-7B")
    assert qwen_v1.chunked_loss_exact and qwen_v1.model_type == "qwen2"
    assert {s.loss_impl for s in _candidates(request(8, "8gb").start, frozenset(), qwen_v1)} == {"trl_fused", "chunked"}


# -- the long-context savers: turned on by the planner only when needed (issue #13) --------------------------------
LLAMA8 = load_architecture("meta-llama/Llama-3.1-8B")
SAVERS = ("embeddings_on_host", "tiled_norms", "tiled_mlp", "recompute_lora")
LONG_CONTEXT = {"tiled_mlp", "tiled_norms", "recompute_lora", "embeddings_on_host", "mlp_tile_tokens",
                "loss_chunk_tokens"}  # fmt: skip


def _at(vram, tier, seq, overrides=None, arch=LLAMA8, **kw):
    return _plan(vram, tier, {**(overrides or {}), "memory": {**(overrides or {}).get("memory", {}),
                 "max_seq_len": seq}}, arch=arch, **kw)  # fmt: skip


def test_short_sequences_turn_no_saver_on_and_say_so():
    p = _at(24, "24gb", 2048)
    assert not any(getattr(p.setup, name) for name in SAVERS)
    assert all(p.reasons[name] == "off: not needed" for name in SAVERS)
    assert p.reasons["mlp_tile_tokens"] == "unused: no tiled saver is on"
    assert p.reasons["loss_chunk_tokens"] == "off: no chunked loss"
    assert p.to_dict()["host_gb"] == pytest.approx(p.host_gb, abs=1e-3)


def test_a_long_sequence_turns_on_the_savers_it_needs_and_each_is_needed():
    """Llama-3.1-8B, 100k tokens in 24 GB: the savers the plan turns on each say what the setup needs without them
    (over the budget), and fixing any of them off makes the planner settle for a costlier setup or none."""
    from lowmem_ft.memory.planner import _cost

    p = _at(24, "24gb", 100_000)
    assert p.fits and p.setup.tiled_mlp
    on = [name for name in SAVERS if getattr(p.setup, name)]
    for name in on:
        why = p.reasons[name]
        need = float(why.split("without it this setup needs ")[1].split(" GB")[0])
        assert why.startswith("on: ") and need > p.budget_gb, why
        without = replace(p.setup, **{name: False})
        assert estimate(LLAMA8, without).peak_gb > p.budget_gb
        try:
            other = _at(24, "24gb", 100_000, {"memory": {name: False}})
        except UserError:
            continue
        assert _cost(other.setup) >= _cost(p.setup) and not getattr(other.setup, name)
        assert other.reasons[name] == "set by you (--set)"
    assert all(p.reasons[name] == "off: not needed" for name in SAVERS if name not in on)


def test_the_old_choice_stays_wherever_it_fits_without_the_new_savers():
    """Savers free or fixed off: the same plan whenever the latter fits (the planner's earlier choices are kept)."""
    fixed_off = {"memory": dict.fromkeys(("tiled_mlp", "tiled_norms", "recompute_lora", "embeddings_on_host"), False)}
    for arch in (LLAMA8, QWEN7):
        for vram, tier in ((8, "8gb"), (24, "24gb"), (40, "40gb")):
            for seq in (1024, 4096, 16384, 32768):
                try:
                    old = _at(vram, tier, seq, fixed_off, arch=arch)
                except UserError:
                    continue
                new = _at(vram, tier, seq, arch=arch)
                assert new.setup == old.setup and new.gradient_accumulation == old.gradient_accumulation


def test_savers_and_tiles_the_user_fixed_are_kept():
    on = _at(24, "24gb", 2048, {"memory": {"tiled_mlp": True, "mlp_tile_tokens": 512}})
    assert on.setup.tiled_mlp and on.setup.mlp_tile_tokens == 512
    assert on.reasons["tiled_mlp"] == "set by you (--set)"
    assert on.reasons["mlp_tile_tokens"] == "512 tokens, set by you (--set)"
    off = _at(24, "24gb", 50_000, {"memory": {"tiled_mlp": False}})  # other savers make up for it
    assert not off.setup.tiled_mlp and off.reasons["tiled_mlp"] == "set by you (--set)"
    assert off.setup.embeddings_on_host and off.setup.recompute_lora
    assert {"tiled_mlp", "mlp_tile_tokens"}.isdisjoint(on.changeable) and "tiled_norms" in on.changeable


def test_a_smaller_tile_is_chosen_only_when_the_default_one_does_not_fit():
    p = _at(8, "8gb", 12_000)
    tile = p.setup.mlp_tile_tokens
    assert p.setup.tiled_mlp and tile in (1024, 256)
    assert p.reasons["mlp_tile_tokens"].startswith(f"{tile:,} tokens: the largest tile that fits (tiles of ")
    larger = 4096 if tile == 1024 else 1024
    assert estimate(LLAMA8, replace(p.setup, mlp_tile_tokens=larger)).peak_gb > p.budget_gb


def test_the_loss_chunk_is_the_largest_that_fits_the_budget():
    """With the chunked loss on, the chunk grows into what the rest of the step leaves (never above the micro
    batch's tokens or TRL's 4,096-token tile); one more step of the sizes would not fit; a fixed chunk is kept."""
    from lowmem_ft.memory.estimate import loss_chunk_tokens
    from lowmem_ft.memory.long_context import LOSS_CHUNK_MAX, chunk_sizes

    chunked = {"memory": {"chunked_loss": True}}
    p = _at(12, "8gb", 2048, chunked)  # at 24 GB the chunk reaches its 4,096-token cap
    s = p.setup
    n = s.micro_batch_size * (s.max_seq_len - 1)
    sizes = chunk_sizes(n, loss_chunk_tokens(LLAMA8, replace(s, loss_chunk_tokens=None)))
    assert s.loss_chunk_tokens in sizes and s.loss_chunk_tokens > CHUNK_AUTO_LLAMA  # larger than the 64 MiB default
    larger = sizes[sizes.index(s.loss_chunk_tokens) + 1]
    assert estimate(LLAMA8, replace(s, loss_chunk_tokens=larger)).peak_gb > p.budget_gb >= p.estimate.peak_gb
    assert p.reasons["loss_chunk_tokens"].startswith(f"{s.loss_chunk_tokens:,} tokens: the largest chunk that fits")
    roomy = _at(40, "40gb", 1024, {**chunked, "memory": {"chunked_loss": True, "micro_batch_size": 1}})
    assert (
        roomy.setup.loss_chunk_tokens == 1023 and "the micro batch in one chunk" in roomy.reasons["loss_chunk_tokens"]
    )
    long = _at(24, "24gb", 65536, chunked)
    assert long.setup.loss_chunk_tokens == LOSS_CHUNK_MAX
    fixed = _at(24, "24gb", 2048, {"memory": {"chunked_loss": True, "loss_chunk_tokens": 64}})
    assert fixed.setup.loss_chunk_tokens == 64 and fixed.reasons["loss_chunk_tokens"] == "64 tokens, set by you (--set)"


CHUNK_AUTO_LLAMA = 64 * 2**20 // (4 * 128256)  # 130 tokens: losses.py's 64 MiB of fp32 logits


def test_a_stage_is_skipped_only_when_its_smallest_setup_does_not_fit():
    """`_smallest` needs no more than any setup of its stage (the planner skips a stage on it): checked on every
    saver stage of two models at three lengths and a full fine-tune (the whole catalog was checked when this was
    written: 313k setups, none below their stage's smallest)."""
    from lowmem_ft.memory.planner import _prepare, _score, _score_stage, _search_order, _smallest, _stage_start

    full = {"adapter": {"kind": "full"}, "model": {"quantization": "none"}}
    for arch, overrides in ((LLAMA8, None), (QWEN7, None), (QWEN7, full)):
        for seq in (512, 8192, 65536):
            req = request(24, "24gb", {**(overrides or {}), "memory": {"max_seq_len": seq}})
            req, _, stages = _prepare(arch, req)
            for strat, off, savers, first in _search_order(arch, req, stages)[1::3]:
                start = _stage_start(req, off, savers, first)
                smallest = _smallest(arch, req, start, strat, off)
                least = _score(arch, req, smallest, strat, off).estimate.peak_bytes
                assert all(x.estimate.peak_bytes >= least for x in _score_stage(arch, req, start, strat, off))


def test_max_seq_len_with_the_savers_is_the_planners_limit():
    limit = max_seq_len(LLAMA8, request(8, "8gb"))
    assert limit > 3000
    _at(8, "8gb", limit)  # fits
    with pytest.raises(UserError, match=r"even with NF4, .*host embeddings, tiled norms, tiled MLP, LoRA recompute"):
        _at(8, "8gb", limit + 16)


def test_the_length_search_decides_at_the_least_micro_batch_with_the_same_effective_batch():
    """`max_seq_len` asks whether a length fits at the least micro batch the planner would try, the effective batch
    kept, and leaves a fixed micro batch, a fixed accumulation and a pair method's least rows as they are."""
    from lowmem_ft.memory import planner

    def least(r: Request) -> tuple[int, int, bool]:
        out = planner._least_micro_batch(LLAMA8, r)
        assert out.effective_batch == r.effective_batch or "gradient_accumulation" in r.fixed
        return out.start.micro_batch_size, out.gradient_accumulation, "micro_batch_size" in out.fixed

    free = request(24, "24gb")  # 2 rows × 8 micro batches
    assert (free.start.micro_batch_size, free.gradient_accumulation) == (2, 8)
    assert least(free) == (1, 16, True)
    assert least(request(24, "24gb", {"memory": {"gradient_accumulation": 8}})) == (1, 8, True)
    assert least(request(24, "24gb", {"memory": {"micro_batch_size": 2}})) == (2, 8, True)
    dpo = request(24, "24gb", method="dpo")  # a chosen / rejected pair: 2 rows at least
    assert least(dpo) == (2, 8, True)
    # the answer is what a search over every micro batch finds: at the first refused length the plan refuses too
    limit = max_seq_len(LLAMA8, free)
    _at(24, "24gb", limit)
    with pytest.raises(UserError):
        _at(24, "24gb", limit + 16)


@pytest.mark.parametrize(("vram", "tokens"), [(8, 3000), (24, 100_000), (40, 200_000)])
def test_issue_13_targets_llama_8b_qlora_r32_all_linear_batch_1(vram, tokens):
    """The issue's targets, as benchmarks/max_context.md tabulates them (predicted by the CPU-checked model; not
    capped at the model's 131,072 positions, which `train` caps a run at)."""
    from lowmem_ft.longest_context import longest_context

    fixed = {"model": {"quantization": "nf4"}, "adapter": {"kind": "lora", "r": 32, "target_modules": ["all-linear"]},
             "memory": {"micro_batch_size": 1}}  # fmt: skip
    assert longest_context("meta-llama/Llama-3.1-8B", vram, fixed, limit=1 << 20, positions=False) >= tokens
    before = longest_context("meta-llama/Llama-3.1-8B", vram, fixed, savers="previous", limit=1 << 20)
    assert before < tokens  # what the planner reached before issue #13


def test_recipe_targets_the_model_only_partly_has_are_named():
    """The recipes' Llama names on Phi-2 match q/k/v_proj only: its dense, fc1, fc2 stay frozen. The adapter line
    says so (and how to adapt them) rather than the run quietly adapting three of seven kinds of layer."""
    from lowmem_ft.memory.arch import Architecture

    phi2 = Architecture.from_config(
        {"model_type": "phi", "vocab_size": 51200, "hidden_size": 2560, "intermediate_size": 10240,
         "num_hidden_layers": 32, "num_attention_heads": 32}, name="microsoft/phi-2",
    )  # fmt: skip
    p = plan(phi2, request(24, "24gb"))
    assert p.setup.lora_targets == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert (
        "adapts q_proj, k_proj, v_proj only: o_proj, gate_proj, up_proj, down_proj are absent" in p.reasons["adapter"]
    )
    assert "dense, fc1, fc2 stay frozen" in p.reasons["adapter"]
    llama = plan(LLAMA8, request(24, "24gb"))
    assert "absent" not in llama.reasons["adapter"]


def test_a_mixture_that_fits_no_device_share_is_refused_in_one_line():
    """The refusal names the 16-bit experts of a single device's estimate; a per-device share has no such component
    and used to raise KeyError instead of the refusal."""
    mixtral = load_architecture("mistralai/Mixtral-8x7B-v0.1")
    with pytest.raises(UserError, match="needs .* GB at seq 4096 .* per device"):
        _plan(24, "24gb", {"memory": {"max_seq_len": 4096}}, arch=mixtral, gpus=2)
