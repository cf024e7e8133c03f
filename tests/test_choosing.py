"""Choosing a run's recipe: tiers, the recipe ⇄ setup mapping, plans applied back, and the record of the choice."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from lowmem_ft.choosing import (
    Choice,
    apply_plan,
    choose_recipe,
    fixed_knobs,
    setup_from_recipe,
    start_recipe,
    tier_for_vram,
)
from lowmem_ft.errors import UserError
from lowmem_ft.memory.target import Target
from lowmem_ft.recipe.load import resolve

QWEN7 = {"model": {"name_or_path": "Qwen/Qwen2.5-7B"}}


@pytest.mark.parametrize(("vram", "tier"), [(8, "8gb"), (12, "8gb"), (24, "24gb"), (39.5, "24gb"), (80, "40gb")])
def test_tier_is_the_largest_not_above_the_target(vram, tier):
    assert tier_for_vram(vram) == tier


def test_no_tier_below_the_smallest():
    with pytest.raises(UserError, match="no recipe tier fits"):
        tier_for_vram(4)


def test_choose_needs_a_target_or_a_recipe():
    with pytest.raises(UserError, match="--vram"):
        choose_recipe(vram_gb=None, recipe=None, overrides={})


def test_fixed_knobs_are_the_planners_names_of_the_keys_set():
    overrides = {"model": {"quantization": "nf4", "name_or_path": "x"}, "memory": {"chunked_loss": True,
                 "gradient_accumulation": 2}, "training": {"max_steps": 5}}  # fmt: skip
    assert fixed_knobs(overrides) == {"quantization", "loss_impl", "gradient_accumulation"}


def test_planned_recipe_carries_the_plan_and_keeps_everything_else():
    recipe, choice = choose_recipe(vram_gb=24, recipe=None, overrides={**QWEN7, "training": {"max_steps": 7}})
    p = choice.plan
    assert choice.how == "plan" and choice.recipe == "24gb" and choice.model == "Qwen/Qwen2.5-7B"
    assert recipe.training.max_steps == 7 and recipe.adapter.r == resolve("24gb").adapter.r
    assert setup_from_recipe(recipe) == p.setup
    assert recipe.memory.gradient_accumulation == p.gradient_accumulation
    assert recipe.memory.eval_batch_size == p.eval_batch_size
    assert apply_plan(recipe, p) == recipe


def test_choice_means_one_thing_per_field_and_round_trips():
    _, choice = choose_recipe(vram_gb=24, recipe=None, overrides=QWEN7)
    record = choice.to_dict()
    assert record["vram_gb"] == 24 and record["safety_margin_gb"] == 1.5 and record["budget_gb"] == 22.5
    assert record["predicted_peak_gb"] <= record["budget_gb"] and record["fits"] is True
    again = Choice.from_dict(record)
    assert again == choice and again.plan is None and again.target == Target(24, 1.5, 1, 512.0, 4.0)
    assert again.resumed("runs/x/recipe.yaml").how == "resume"
    plan_record = choice.plan_record(resolve("24gb", QWEN7))
    assert plan_record["budget_gb"] == 22.5 and plan_record["model"] == "Qwen/Qwen2.5-7B" and "recipe" in plan_record


def test_without_vram_the_recipe_is_used_as_given():
    recipe, choice = choose_recipe(vram_gb=None, recipe="24gb", overrides=QWEN7)
    assert recipe == resolve("24gb", QWEN7)
    assert choice.how == "recipe" and choice.target is None and choice.to_dict()["vram_gb"] is None


def test_full_finetune_from_a_qlora_tier_plans_16bit_storage():
    """`--set adapter.kind=full` on a 4-bit tier used to stop with 'full cannot train nf4-quantized weights'."""
    overrides = {"model": {"name_or_path": "Qwen/Qwen2.5-0.5B"}, "adapter": {"kind": "full"}}
    assert start_recipe(24, None, overrides).model.quantization == "none"
    recipe, choice = choose_recipe(vram_gb=24, recipe=None, overrides=overrides)
    assert recipe.adapter.kind == "full" and recipe.model.quantization == "none" and choice.fits
    assert "full fine-tuning" in choice.reasons["quantization"]
    # a quantization the user fixed too is theirs: the recipe's rule still applies
    with pytest.raises(UserError, match="full cannot train nf4"):
        choose_recipe(vram_gb=24, recipe=None, overrides={**overrides, "model": {**overrides["model"],
                      "quantization": "nf4"}})  # fmt: skip


def test_seq_len_fixes_the_length_and_is_named_in_errors():
    recipe, choice = choose_recipe(vram_gb=24, recipe=None, overrides=QWEN7, seq_len=4096)
    assert recipe.memory.max_seq_len == 4096 and choice.reasons["max_seq_len"] == "4096 tokens, as --seq-len asked"
    with pytest.raises(UserError, match="^--seq-len: 'memory.max_seq_len' must be at least 16"):
        choose_recipe(vram_gb=24, recipe=None, overrides=QWEN7, seq_len=8)


# -- the model's positions and the VRAM target bound what is planned (issue #16) ---------------------------------
PHI3 = {"model": {"name_or_path": "microsoft/Phi-3-mini-4k-instruct"}}  # max_position_embeddings 4096 (catalog)


def test_a_long_sample_never_plans_beyond_the_models_positions():
    """Issue #16: one 5 MB line made the planner choose max_seq_len 984272. The data's p99 beyond the model's
    positions is capped there (longer samples follow data.truncate), and the reason says so."""
    from lowmem_ft.data.profile import LengthProfile

    profile = LengthProfile.from_lengths([200] * 50 + [984_272])
    recipe, choice = choose_recipe(vram_gb=80, recipe=None, overrides=PHI3, profile=profile)
    assert recipe.memory.max_seq_len == 4096
    why = choice.reasons["max_seq_len"]
    assert why.startswith("4096 tokens: the model's 4096 positions") and "p99 984272 is beyond them" in why
    assert "1 samples longer, 980176 tokens beyond it" in why


def test_a_capped_length_that_does_not_fit_is_shortened_further():
    from lowmem_ft.data.profile import LengthProfile

    profile = LengthProfile.from_lengths([100_000] * 10)  # Qwen-7B (v1): 8192 positions, ~5k tokens fit in 7 GB
    recipe, choice = choose_recipe(vram_gb=7, recipe=None, overrides={"model": {"name_or_path": "Qwen/Qwen-7B"}},
                                   profile=profile)  # fmt: skip
    assert 0 < recipe.memory.max_seq_len < 8192 and "the longest that fits" in choice.reasons["max_seq_len"]


def test_a_tier_length_beyond_the_positions_is_capped_and_an_asked_one_is_an_error():
    from dataclasses import replace

    from lowmem_ft.choosing import plan_setup
    from lowmem_ft.memory.arch import load_architecture

    arch = replace(load_architecture("Qwen/Qwen2.5-0.5B"), max_position_embeddings=1000)
    recipe = resolve("24gb", QWEN7)  # max_seq_len 2048
    planned = plan_setup(arch, recipe, Target(24, 1), frozenset())
    assert planned.setup.max_seq_len == 992  # 1000 rounded down to a multiple of 16
    assert planned.reasons["max_seq_len"] == "992 tokens: the recipe's 2048 capped at the model's 1000 positions"
    with pytest.raises(UserError, match=r"^--set memory.max_seq_len=2048: .* beyond the 1000 positions"):
        plan_setup(arch, recipe, Target(24, 1), frozenset({"max_seq_len"}))
    unknown = replace(arch, max_position_embeddings=0)  # not in the config: no bound
    assert plan_setup(unknown, recipe, Target(24, 1), frozenset()).setup.max_seq_len == 2048


@pytest.mark.parametrize("vram", [0.75, 0.5, 0.0])
def test_vram_must_leave_a_budget_above_the_margin(vram):
    with pytest.raises(UserError, match="0.75 GB safety margin .* smallest sensible --vram is 1.25"):
        choose_recipe(vram_gb=vram, recipe=None, overrides=QWEN7)
    for infinite in (float("inf"), float("nan")):
        with pytest.raises(UserError, match="not a finite number of GB"):
            choose_recipe(vram_gb=infinite, recipe=None, overrides=QWEN7)


def test_a_choice_record_with_figures_no_run_wrote_is_refused():
    for record in ({"vram_gb": float("inf")}, {"vram_gb": 8, "safety_margin_gb": 9}, {"vram_gb": "lots"},
                   {"vram_gb": 8, "predicted_peak_gb": "high"}):  # fmt: skip
        with pytest.raises((ValueError, TypeError)):
            Choice.from_dict(record)
    assert Choice.from_dict({"vram_gb": 8, "safety_margin_gb": 1}).target == Target(8, 1)


# -- continuing an existing adapter --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qv_adapter(tiny_model, tmp_path_factory):
    from tests.saved_adapters import save_adapter

    return str(save_adapter(tiny_model, tmp_path_factory.mktemp("adapters") / "qv", r=4, alpha=8))


def _with_adapter(tiny_model, path, **sections):
    overrides = {"model": {"name_or_path": tiny_model}, "adapter": {"name_or_path": path}}
    for section, values in sections.items():
        overrides[section] = {**overrides.get(section, {}), **values}
    return overrides


def test_the_plan_counts_the_adapter_that_is_loaded(tiny_model, qv_adapter):
    origins = {"adapter.name_or_path": "--adapter"}
    recipe, choice = choose_recipe(vram_gb=8, recipe=None, overrides=_with_adapter(tiny_model, qv_adapter),
                                   origins=origins)  # fmt: skip
    a = recipe.adapter
    assert (a.kind, a.r, a.alpha, a.dropout, a.target_modules) == ("lora", 4, 8, 0.0, ["q_proj", "v_proj"])
    assert choice.plan.setup.lora_r == 4 and choice.plan.setup.lora_targets == ("q_proj", "v_proj")
    assert (
        choice.reasons["adapter"] == f"lora, rank 4 on q_proj, v_proj: the adapter loaded from --adapter {qv_adapter}"
    )
    # the same figures as a plan for that shape written out by hand, and not those of the tier's own adapter
    by_hand = {"model": {"name_or_path": tiny_model}, "adapter": {"r": 4, "alpha": 8, "dropout": 0.0,
               "target_modules": ["q_proj", "v_proj"]}}  # fmt: skip
    _, same = choose_recipe(vram_gb=8, recipe=None, overrides=by_hand)
    _, tier = choose_recipe(vram_gb=8, recipe=None, overrides={"model": {"name_or_path": tiny_model}})

    def lora_bytes(c):
        return sum(x.bytes for x in c.plan.estimate.components if "LoRA" in x.name or "adapter" in x.name.lower())

    assert choice.plan.estimate.components == same.plan.estimate.components
    assert lora_bytes(choice) > 0 and lora_bytes(choice) < lora_bytes(tier)  # rank 4 on 2 modules < rank 8 on 7


def test_without_a_model_the_adapters_base_is_the_model(tiny_model, qv_adapter):
    recipe, choice = choose_recipe(vram_gb=None, recipe="8gb", overrides={"adapter": {"name_or_path": qv_adapter}})
    assert recipe.model.name_or_path == tiny_model and recipe.adapter.r == 4
    assert choice.how == "recipe"


def test_a_key_that_contradicts_the_adapter_is_an_error(tiny_model, qv_adapter):
    overrides = _with_adapter(tiny_model, qv_adapter, adapter={"r": 16})
    with pytest.raises(UserError, match=r"has kind=lora, r=4, .*; --set adapter.r=16 contradicts it"):
        choose_recipe(vram_gb=8, recipe=None, overrides=overrides)


def test_a_full_fine_tune_cannot_continue_an_adapter(tiny_model, qv_adapter):
    overrides = _with_adapter(tiny_model, qv_adapter, adapter={"kind": "full"}, model={"quantization": "none"})
    with pytest.raises(UserError, match="continues a LoRA adapter, but adapter.kind is full"):
        choose_recipe(vram_gb=8, recipe=None, overrides=overrides)


def test_an_adapter_of_another_shape_stops_before_the_data(tiny_model, tmp_path):
    import json

    import torch
    from safetensors.torch import save_file

    wide = tmp_path / "wide"
    wide.mkdir()
    (wide / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                          "base_model_name_or_path": "other/model"}))  # fmt: skip
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    save_file({key.format("A"): torch.zeros(4, 4096), key.format("B"): torch.zeros(4096, 4)},
              str(wide / "adapter_model.safetensors"))  # fmt: skip
    with pytest.raises(UserError, match=r"does not fit .*: q_proj is 4096 → 4096 in the adapter but .* pass the "
                                        r"--model it was trained on \(other/model\)"):  # fmt: skip
        choose_recipe(vram_gb=8, recipe=None, overrides=_with_adapter(tiny_model, str(wide)))


def test_a_base_of_another_name_is_a_warning(tiny_model, qv_adapter, tmp_path, caplog):
    import shutil

    from tests.saved_adapters import edit_config

    renamed = edit_config(Path(shutil.copytree(qv_adapter, tmp_path / "renamed")), base_model_name_or_path="x/other")
    with caplog.at_level(logging.WARNING, logger="lowmem_ft.choosing"):
        recipe, _ = choose_recipe(vram_gb=8, recipe=None, overrides=_with_adapter(tiny_model, str(renamed)))
    assert recipe.model.name_or_path == tiny_model
    assert f"was trained on x/other, not {tiny_model}" in caplog.text


# -- long documents: the planner turns the long-context savers on by itself (issue #13) ---------------------------
LLAMA8 = {"model": {"name_or_path": "meta-llama/Llama-3.1-8B"}}
SAVERS = ("embeddings_on_host", "tiled_norms", "tiled_mlp", "recompute_lora")


def test_train_vram_24_on_long_documents_picks_the_savers_by_itself():
    """`train --vram 24 --data long.jsonl` on Llama-3.1-8B: documents of 60k-110k tokens (p99 ~110k, within the
    model's 131,072 positions) get the whole length, with the savers on and a reason line for each, carried into the
    recipe the run trains with."""
    from lowmem_ft.data.profile import LengthProfile

    profile = LengthProfile.from_lengths(list(range(60_000, 110_001, 500)))
    recipe, choice = choose_recipe(vram_gb=24, recipe=None, overrides=LLAMA8, profile=profile)
    p, m = choice.plan, recipe.memory
    assert p.fits and m.max_seq_len == p.setup.max_seq_len >= 109_000
    assert "covers" in choice.reasons["max_seq_len"]
    assert m.tiled_mlp and m.tiled_norms and m.activation_offloading and recipe.model.quantization == "nf4"
    for name in SAVERS:
        assert getattr(m, name) == getattr(p.setup, name)
        expected = "on: " if getattr(m, name) else "off: not needed"
        assert choice.reasons[name].startswith(expected), (name, choice.reasons[name])
    assert "without it this setup needs" in choice.reasons["tiled_mlp"]
    assert choice.reasons["mlp_tile_tokens"].startswith(f"{p.setup.mlp_tile_tokens or 4096:,} tokens")
    assert setup_from_recipe(recipe) == p.setup  # the recipe is the plan: what train builds is what was predicted
    record = choice.plan_record(recipe)
    assert record["recipe"]["memory"]["tiled_mlp"] is True and record["host_gb"] > 20  # offloaded layer inputs
    assert choice.reasons["host_ram"].startswith(f"{p.host_gb:.1f} GB (")


def test_the_same_documents_on_a_short_budget_are_cut_with_the_savers_on():
    from lowmem_ft.data.profile import LengthProfile

    profile = LengthProfile.from_lengths([100_000] * 20)
    recipe, choice = choose_recipe(vram_gb=8, recipe=None, overrides=LLAMA8, profile=profile)
    assert 3000 < recipe.memory.max_seq_len < 100_000 and "the longest that fits" in choice.reasons["max_seq_len"]
    assert recipe.memory.tiled_mlp and recipe.memory.embeddings_on_host


def test_new_savers_are_fixed_knobs_and_round_trip():
    overrides = {"memory": {"tiled_mlp": True, "mlp_tile_tokens": 512, "loss_chunk_tokens": 256,
                            "embeddings_on_host": False, "recompute_lora": True, "tiled_norms": False}}  # fmt: skip
    assert fixed_knobs(overrides) == {"tiled_mlp", "mlp_tile_tokens", "loss_chunk_tokens", "embeddings_on_host",
                                      "recompute_lora", "tiled_norms"}  # fmt: skip
    recipe, choice = choose_recipe(vram_gb=24, recipe=None, overrides={**QWEN7, **overrides})
    m = recipe.memory
    assert (m.tiled_mlp, m.mlp_tile_tokens, m.loss_chunk_tokens, m.recompute_lora) == (True, 512, 256, True)
    assert setup_from_recipe(recipe) == choice.plan.setup and apply_plan(recipe, choice.plan) == recipe


def test_host_ram_is_said_against_the_host_budget():
    _, choice = choose_recipe(vram_gb=24, recipe=None, overrides=LLAMA8, seq_len=100_000)
    p = choice.plan
    assert p.host_gb > 26 and p.host_fits  # 26.2 GB of offloaded layer inputs at 100k tokens, of the suite's 512 GB
    assert choice.reasons["host_ram"] == (
        f"{p.host_gb:.1f} GB (input embeddings (host) 1.05, paged optimizer states 0.04, offloaded layer inputs 26.21) "
        "of the 508.0 GB host budget "
        "(RAM 512.0 − margin 4)"
    )
    assert p.to_dict()["host_budget_gb"] == 508.0 and p.to_dict()["host_fits"] is True
    _, short = choose_recipe(vram_gb=80, recipe=None, overrides={"model": {"name_or_path": "Qwen/Qwen2.5-0.5B"}})
    assert short.plan.host_gb < 0.1 and "host_ram" not in short.reasons  # only bnb's paged states (on the device)


def with_host_ram(overrides: dict, gb: float) -> dict:
    return {**overrides, "memory": {**overrides.get("memory", {}), "host_ram_gb": gb}}


def test_a_setup_that_needs_more_host_ram_than_the_machine_has_does_not_fit():
    """Offloading 100k tokens' layer inputs needs 26.3 GB of host RAM: with 16 GB (12 GB after the margin) nothing
    fits, and the one line says what would — a length the planner checked, or the RAM."""
    with pytest.raises(UserError) as refused:
        choose_recipe(vram_gb=24, recipe=None, overrides=with_host_ram(LLAMA8, 16), seq_len=100_000)
    line = str(refused.value)
    assert "keeps 26.3 GB in host RAM" in line and "over the 12.0 GB host budget (--host-ram 16 − margin 4" in line
    shorter = int(re.search(r"what fits: --seq-len (\d+) or --host-ram 31 ", line).group(1))
    assert 16_000 < shorter < 100_000
    _, fits = choose_recipe(vram_gb=24, recipe=None, overrides=with_host_ram(LLAMA8, 16), seq_len=shorter)
    assert fits.plan.fits and fits.plan.host_need_gb <= 12 and fits.plan.setup.max_seq_len == shorter
    with pytest.raises(UserError):  # the length offered is the longest that fits
        choose_recipe(vram_gb=24, recipe=None, overrides=with_host_ram(LLAMA8, 16), seq_len=shorter + 16)
    _, roomy = choose_recipe(vram_gb=24, recipe=None, overrides=with_host_ram(LLAMA8, 31), seq_len=100_000)
    assert roomy.plan.fits


def test_the_length_from_the_data_is_capped_by_host_ram():
    from lowmem_ft.data.profile import LengthProfile

    profile = LengthProfile.from_lengths(list(range(60_000, 110_001, 500)))
    recipe, choice = choose_recipe(vram_gb=24, recipe=None, overrides=with_host_ram(LLAMA8, 16), profile=profile)
    assert choice.plan.fits and choice.plan.host_need_gb <= 12
    assert 16_000 < recipe.memory.max_seq_len < 60_000 and "the longest that fits" in choice.reasons["max_seq_len"]


def test_host_ram_makes_the_planner_drop_offloading_where_the_device_allows():
    """At 16k tokens on 80 GB the device fits without offloading: a host budget of nothing still plans."""
    _, choice = choose_recipe(vram_gb=80, recipe=None, overrides=with_host_ram(LLAMA8, 4.1), seq_len=16_384)
    assert choice.plan.fits and not choice.plan.setup.activation_offloading


def test_a_recipe_over_the_host_budget_is_checked_not_to_fit(tmp_path):
    from lowmem_ft.recipe.load import dump

    planned, _ = choose_recipe(vram_gb=24, recipe=None, overrides=LLAMA8, seq_len=100_000)  # fits 512 GB of RAM
    recipe_file = tmp_path / "offload.yaml"
    recipe_file.write_text(dump(planned), "utf-8")
    _, choice = choose_recipe(vram_gb=24, recipe=str(recipe_file), overrides=with_host_ram(LLAMA8, 16))
    p = choice.plan
    assert not p.fits and not p.host_fits and choice.fits is False
    # the planned recipe keeps its input embeddings on the host too (1.05 GB): 27.3 GB in all
    assert p.to_dict()["unfit_reason"].startswith("keeps 27.3 GB in host RAM")
    assert re.search(r"what fits: --seq-len \d+ or --host-ram 32 ", choice.reasons["host_ram"])


def test_the_detected_ram_is_the_default_and_host_ram_gb_overrides_it(monkeypatch):
    from lowmem_ft.choosing import target_for
    from lowmem_ft.recipe.load import resolve

    monkeypatch.setattr("lowmem_ft.choosing.detected_host_ram_gb", lambda: 20.0)
    assert target_for(24, resolve("24gb", {})).host_budget_gb == 16.0
    given = resolve("24gb", {"memory": {"host_ram_gb": 100, "host_margin_gb": 10}})
    assert target_for(24, given).host_budget_gb == 90.0


def replace_reasons(p):
    from dataclasses import replace

    return replace(p, reasons={k: v for k, v in p.reasons.items() if k != "host_ram"})


def test_longest_context_grows_with_each_saver_set_up_to_the_models_positions():
    from lowmem_ft.longest_context import longest_context

    fixed = {"model": {"quantization": "nf4"}, "memory": {"micro_batch_size": 1}}
    none, previous, every = (
        longest_context("Qwen/Qwen2.5-7B", 24, fixed, savers=s, limit=1 << 20, positions=False)
        for s in ("none", "previous", "all")
    )
    assert 0 < none < previous < every
    assert every > 131_072 == longest_context("Qwen/Qwen2.5-7B", 24, fixed, limit=1 << 20)  # capped as train caps


MIXTRAL_8X7B = {  # mistralai/Mixtral-8x7B-v0.1 config.json (the keys that set its shape)
    "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "num_experts_per_tok": 2, "max_position_embeddings": 32768,
}  # fmt: skip


def test_mixtral_at_24_gb_is_refused_for_its_16_bit_experts(tmp_path):
    """Mixtral-8x7B read as 7.2B parameters (one dense MLP per layer) was planned in 16-bit at 24 GB, a certain OOM;
    counted whole, its 45.1B expert parameters stay bf16 under NF4 (bitsandbytes quantizes nn.Linear only): 90 GB
    before any activation. One line with those numbers; without --vram the recipe trains as given."""
    import json

    (tmp_path / "config.json").write_text(json.dumps(MIXTRAL_8X7B))
    with pytest.raises(UserError, match=r"needs 9\d\.\d GB .*90\.2 GB are its 45\.1B expert parameters \(of 46\.7B\)"
                       r".*16-bit.*nn\.Linear") as info:  # fmt: skip
        choose_recipe(vram_gb=24, recipe=None, overrides={"model": {"name_or_path": str(tmp_path)}})
    assert "\n" not in str(info.value)
    _, as_given = choose_recipe(vram_gb=24, recipe="24gb", overrides={"model": {"name_or_path": str(tmp_path)}})
    assert as_given.fits is False and as_given.plan.estimate.by_name()["experts + routers (16-bit)"] > 90e9
    recipe_only, _ = choose_recipe(vram_gb=None, recipe="24gb", overrides={"model": {"name_or_path": str(tmp_path)}})
    assert recipe_only.model.name_or_path == str(tmp_path)  # without --vram nothing is planned: the recipe as given


def test_a_mixture_of_experts_is_planned_with_its_experts_counted():
    """OLMoE-1B-7B (6.9B parameters, 6.4B in experts) fits 24 GB with LoRA on the attention; the plan's peak holds
    the experts' 16-bit weights and says the experts stay frozen."""
    recipe, choice = choose_recipe(
        vram_gb=24, recipe=None, overrides={"model": {"name_or_path": "allenai/OLMoE-1B-7B-0924"}}
    )
    p = choice.plan
    parts = p.estimate.by_name()
    assert parts["experts + routers (16-bit)"] == pytest.approx(2 * 16 * (3 * 64 * 1024 * 2048 + 64 * 2048))
    assert p.estimate.peak_gb <= p.target.budget_gb
    assert "experts per layer and the router stay frozen" in p.reasons["adapter"]
    assert not (recipe.memory.tiled_norms or recipe.memory.recompute_lora or recipe.memory.tiled_mlp)


PHI_35_MOE = {  # microsoft/Phi-3.5-MoE-instruct config.json (the keys that set its shape)
    "model_type": "phimoe", "vocab_size": 32064, "hidden_size": 4096, "intermediate_size": 6400,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 16,
    "num_experts_per_tok": 2, "attention_bias": True, "lm_head_bias": True, "max_position_embeddings": 131072,
}  # fmt: skip


def test_phi_35_moe_needs_its_16_bit_experts(tmp_path):
    """Phi-3.5-MoE: 41.9B parameters, 40.3B in experts bitsandbytes leaves in 16-bit — refused at 24 GB with those
    numbers, planned (16-bit LoRA on the attention) at 96 GB."""
    import json

    (tmp_path / "config.json").write_text(json.dumps(PHI_35_MOE))
    overrides = {"model": {"name_or_path": str(tmp_path)}}
    with pytest.raises(UserError, match=r"80\.5 GB are its 40\.3B expert parameters \(of 41\.9B\)"):
        choose_recipe(vram_gb=24, recipe=None, overrides=overrides)
    _, choice = choose_recipe(vram_gb=96, recipe=None, overrides=overrides)
    assert choice.plan.estimate.peak_gb <= choice.plan.target.budget_gb


def test_mixtures_the_memory_model_does_not_describe_are_refused_with_their_numbers(tmp_path):
    """A DeepSeek-style config (n_routed_experts) read as Llama-shaped counts one dense MLP per layer."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({**MIXTRAL_8X7B, "model_type": "llama", "n_routed_experts": 64}))
    with pytest.raises(UserError, match=r"\(llama: 7\.2B parameters, of which the memory model counts one dense MLP "
                       r"per layer\); lowmem-ft plans the mixtures of mixtral.*--recipe and no --vram"):  # fmt: skip
        choose_recipe(vram_gb=80, recipe=None, overrides={"model": {"name_or_path": str(tmp_path)}})


def test_full_fine_tuning_of_a_mixture_is_refused():
    with pytest.raises(UserError, match=r"full fine-tuning trains the expert stacks.*adapter.kind=lora"):
        choose_recipe(vram_gb=80, recipe=None,
                      overrides={"model": {"name_or_path": "allenai/OLMoE-1B-7B-0924"}, "adapter": {"kind": "full"}})  # fmt: skip


def test_a_mixture_is_planned_on_one_device_only():
    """The sharded strategies size their units from the block's linears, which leave the expert stacks out."""
    with pytest.raises(UserError, match=r"one device only.*--gpus 1"):
        choose_recipe(
            vram_gb=80, recipe=None, gpus=2, overrides={"model": {"name_or_path": "allenai/OLMoE-1B-7B-0924"}}
        )


def test_host_ram_counts_the_processes_of_one_node():
    """--gpus 4 --nodes 2: eight processes, four on each machine's RAM (the plan's host need is one machine's)."""
    overrides = with_host_ram(LLAMA8, 512)
    _, one = choose_recipe(vram_gb=24, recipe=None, overrides=overrides, seq_len=65_536, gpus=4)
    _, two = choose_recipe(vram_gb=24, recipe=None, overrides=overrides, seq_len=65_536, gpus=8, nodes=2)
    assert two.plan.target.node_gpus == 4 and one.plan.target.node_gpus == 4
    per_process = two.plan.estimate.components
    assert two.plan.host_need_gb == pytest.approx(4 * sum(c.gb for c in per_process if c.phase == "host"))
    assert two.plan.host_need_gb > 0
