"""lowmem_ft/memory/preference.py: the rows, the reference pass and the reference choice (pure arithmetic)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lowmem_ft.errors import UserError
from lowmem_ft.memory.arch import Architecture
from lowmem_ft.memory.estimate import Setup, estimate, phase_peak_bytes
from lowmem_ft.memory.preference import (
    choose_reference,
    method_estimate,
    method_setup,
    phase_peak,
    reference_kind,
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


def test_reference_choice_is_the_one_the_run_builds():
    a = arch()
    lora = Setup()
    assert choose_reference(a, lora, "dpo", pairs=1000).kind == "adapter_disabled"
    assert choose_reference(a, lora, "simpo", pairs=1000).kind == "none"
    full = Setup(adapter="full", quantization="none")
    auto = choose_reference(a, full, "dpo", pairs=1000)
    assert auto.kind == reference_kind("dpo", "full", "auto") == "precomputed" and auto.host_bytes == 8000
    copy = choose_reference(a, full, "dpo", given="copy", pairs=1000)
    assert copy.kind == "copy" and copy.device_bytes == reference_weight_bytes(a, full, "copy")
    tight = choose_reference(a, full, "dpo", pairs=1000, budget_bytes=10e9, policy_peak_bytes=1e9)
    assert tight.kind == "precomputed" and "not fit" in tight.why


def test_the_planners_estimate_holds_the_reference_pass_copy_and_orpo_logits():
    """`method_estimate` (what the planner scores) adds DPO's reference pass to the forward, a frozen copy to every
    phase, ORPO's chosen-logits copy to the backward — on the device too, with the overheads of the new transient."""
    a = arch()
    rows = method_setup("dpo", Setup(micro_batch_size=2, max_seq_len=2048, gradient_checkpointing=True))
    sft = estimate(a, rows)
    dpo = method_estimate(a, sft, "dpo")
    assert "reference pass (no grad, after the policy's forward)" in dpo.by_name()
    assert dpo.phases["forward"] > sft.phases["forward"] and dpo.phases["backward"] == sft.phases["backward"]
    assert dpo.peak_bytes >= sft.peak_bytes
    full = replace(rows, adapter="full", quantization="none")
    copy = method_estimate(a, estimate(a, full), "dpo", "copy")
    assert copy.phases["static"] == estimate(a, full).phases["static"] + reference_weight_bytes(a, full, "copy")
    pre = method_estimate(a, estimate(a, full), "dpo", "auto")  # precomputed: nothing on the device
    assert pre.model_peak_bytes == estimate(a, full).model_peak_bytes
    orpo_rows = method_setup("orpo", Setup(micro_batch_size=1, max_seq_len=1024))
    orpo = method_estimate(a, estimate(a, orpo_rows), "orpo")  # 16-bit logits: TRL's row-by-row log_softmax
    assert orpo.phases["backward"] < estimate(a, orpo_rows).phases["backward"]
    wide = replace(orpo_rows, compute_dtype="float32")  # fp32 logits: hf_full's count and ORPO's NLL copy
    assert method_estimate(a, estimate(a, wide), "orpo").phases["backward"] > estimate(a, wide).phases["backward"]
    assert method_estimate(a, sft, "sft") is sft


def test_the_planner_keeps_whole_pairs_and_lowers_the_length_when_one_pair_does_not_fit():
    """DPO on Gemma-2-9B at 8 GB (a 256k vocabulary; the reference pass after the policy's forward): the tier's 512
    tokens do not fit one pair, so the plan lowers the length and says why; every plan is of whole pairs and its
    peak includes the reference pass."""
    from lowmem_ft.choosing import choose_recipe
    from lowmem_ft.memory.preference import lowered_length_reason

    gemma = {"model": {"name_or_path": "google/gemma-2-9b"}, "training": {"method": "dpo"}}
    recipe, choice = choose_recipe(vram_gb=8, recipe=None, overrides=gemma)
    p = choice.plan
    assert recipe.memory.max_seq_len < 512 and p.setup.micro_batch_size % 2 == 0 and p.fits
    assert p.reasons["max_seq_len"] == lowered_length_reason("dpo", recipe.memory.max_seq_len, 512)
    assert "reference pass (no grad, after the policy's forward)" in p.estimate.by_name()
    model = {"model": {"name_or_path": "meta-llama/Llama-3.1-8B"}}
    recipe, choice = choose_recipe(vram_gb=24, recipe=None, overrides={**model, "training": {"method": "kto"}})
    assert recipe.memory.micro_batch_size == choice.plan.setup.micro_batch_size  # KTO's rows are its completions
    with pytest.raises(UserError, match="--seq-len"):  # a length the user fixed is not lowered
        choose_recipe(vram_gb=8, recipe=None, seq_len=4096, overrides=gemma)


def test_the_planners_and_the_monitors_forms_agree_on_the_cpu():
    """The planner's estimate (`method_estimate`) and the CPU monitor's phase peaks (`phase_peak`, what the grid in
    benchmarks/estimator_preference.md measures) are the same terms."""
    a = arch()
    for method, adapter, reference in [("dpo", "lora", "auto"), ("dpo", "full", "copy"), ("orpo", "lora", "auto"),
                                       ("simpo", "lora", "auto"), ("kto", "full", "precomputed")]:  # fmt: skip
        s = Setup(device="cpu", adapter=adapter, quantization="none" if adapter == "full" else "nf4",
                  micro_batch_size=2, max_seq_len=512, gradient_checkpointing=method != "kto")  # fmt: skip
        rows = method_setup(method, s)
        planned = method_estimate(a, estimate(a, rows), method, reference)
        kind = reference_kind(method, adapter, reference)
        for phase in ("static", "forward", "backward", "optimizer step"):
            monitored = phase_peak(a, rows, phase, method=method, reference=kind)
            assert planned.phases[phase] == pytest.approx(monitored, rel=1e-9), (method, adapter, phase)


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "zero3", "fsdp"])
@pytest.mark.parametrize(("method", "adapter", "reference"), [
    ("dpo", "lora", "auto"), ("kto", "lora", "auto"), ("orpo", "lora", "auto"), ("simpo", "lora", "auto"),
    ("dpo", "full", "copy"), ("dpo", "full", "precomputed"),
])  # fmt: skip
def test_a_preference_steps_terms_are_per_device_under_every_strategy(method, adapter, reference, strategy):
    """Issue 32: on several devices the method's terms sit on the per-device estimate (`device_phases`: the single
    device's phases, shifted to the device's static state): the reference pass and ORPO's logits are per device (the micro
    batch is), so a preference step adds to the per-device SFT step what it adds on one device; a reference copy is
    whole on every device under DDP / ZeRO-2, a shard and one gathered layer under FSDP / ZeRO-3."""
    from dataclasses import replace

    from lowmem_ft.memory.preference import device_phases, reference_share_bytes
    from lowmem_ft.memory.sharding import lora_in_compute_dtype, per_device_estimate

    a = arch()
    rows = method_setup(method, Setup(adapter=adapter, quantization="none" if adapter == "full" else "nf4",
                                      micro_batch_size=2, max_seq_len=1024, gradient_checkpointing=True))  # fmt: skip
    # the single device running LoRA as the strategy does (FSDP's mixed precision: in the compute dtype)
    one = estimate(a, replace(rows, lora_in_compute_dtype=lora_in_compute_dtype(rows, strategy)))
    dev, share = per_device_estimate(a, rows, 4, strategy, False)
    phases = device_phases(a, dev)
    assert set(phases) == set(one.phases)
    assert phases["static"] == pytest.approx(sum(c.bytes for c in dev.components if c.phase == "static"))
    if strategy == "fsdp" and rows.quantization == "none":  # FSDP2, phase by phase: units gathered in the forward
        assert phases == dev.phases
        assert phases["forward"] - phases["static"] > one.phases["forward"] - one.phases["static"]
    else:
        assert phases["forward"] - phases["static"] == pytest.approx(one.phases["forward"] - one.phases["static"])
    assert max(phases[p] for p in ("forward", "backward", "optimizer step")) == pytest.approx(dev.model_peak_bytes)
    planned_one = method_estimate(a, one, method, reference)
    planned = method_estimate(a, dev, method, reference, share)
    kind = reference_kind(method, adapter, reference)
    copy = reference_weight_bytes(a, rows, kind)
    on_device = reference_share_bytes(a, rows, kind, share)
    assert on_device == (copy / 4 + copy / a.num_layers if strategy in ("fsdp", "zero3") else copy)
    for phase in ("forward", "backward", "optimizer step"):
        added_one = planned_one.phases[phase] - one.phases[phase] - copy
        added = planned.phases[phase] - phases[phase] - on_device
        if strategy == "fsdp" and rows.quantization == "none" and phase == "forward":
            # FSDP2's forward already holds its gathered units, above the reference pass's moment by up to them
            assert 0.0 <= added <= added_one + 1.0, phase
            continue
        assert added == pytest.approx(added_one, rel=1e-9, abs=1.0), phase
    assert planned.model_peak_bytes == max(planned.phases[p] for p in ("forward", "backward", "optimizer step"))


@pytest.mark.parametrize("method", ["dpo", "orpo", "simpo", "kto", "grpo"])
@pytest.mark.parametrize("strategy", ["auto", "ddp", "fsdp", "zero3"])
def test_every_method_plans_on_two_devices(method, strategy, capsys):
    """`plan --method M --gpus 2 [--strategy S]` (issue 32: `KeyError: 'static'` / `'forward'` before): a plan
    per device, or, for GRPO under a sharded strategy, one line naming what is not supported."""
    from lowmem_ft.cli import main

    argv = ["plan", "--vram", "24", "--model", "meta-llama/Llama-3.1-8B", "--method", method, "--gpus", "2",
            "--strategy", strategy, "--host-ram", "256", "--json"]  # fmt: skip
    code = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    if method == "grpo" and strategy in ("fsdp", "zero3"):
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"--method grpo --strategy {strategy}" in err and "--strategy ddp" in err, err
        return
    assert code == 0, err
    import json

    plan = json.loads(out)
    assert plan["fits"] and plan["gpus"] == 2, plan


@pytest.mark.parametrize("vram", [6, 8, 12, 24])
@pytest.mark.parametrize("gpus", [1, 2])
def test_the_planner_never_gives_kto_a_micro_batch_of_one(vram, gpus):
    """TRL 1.16's KTOTrainer refuses a per-device batch of 1 (its KL term pairs each completion with another of the
    micro batch): the planner's least is 2 (`least_micro_batch`), from the 8gb tier's 1 too; one it cannot fit is
    one line, not a plan TRL refuses after the launch."""
    from lowmem_ft.choosing import choose_recipe
    from lowmem_ft.memory.preference import least_micro_batch, micro_batch_problem

    assert least_micro_batch("kto") == 2 and least_micro_batch("dpo") == 1
    assert micro_batch_problem("kto", 1, "recipe 8gb") is not None and micro_batch_problem("kto", 2, "x") is None
    overrides = {"model": {"name_or_path": "meta-llama/Llama-3.1-8B"}, "training": {"method": "kto"}}
    try:
        recipe, choice = choose_recipe(vram_gb=vram, recipe=None, overrides=overrides, gpus=gpus)
    except UserError as exc:
        assert "\n" not in str(exc)
        return
    assert recipe.memory.micro_batch_size >= 2 and choice.plan.setup.micro_batch_size >= 2
