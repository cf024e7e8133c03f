"""The estimator against exact CPU measurements on two tiny points (the CPU grid is benchmarks/estimator_cpu.md).

The bound is the issue's max-error target (8 %); the calibrated model lands within ~1 % on these points, so a
wrong constant in the activation, loss or optimizer terms fails the test.
"""

from __future__ import annotations

import pytest

from devkit.harness.estimator import Point, run_point, write_model

CONFIG = {
    "model_type": "qwen2", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 192,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False,
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "point",
    [
        Point("qwen2-tiny", "lora", "adamw_torch", False, 1, 64),  # LoRA dropout masks, first-layer discount
        Point("qwen2-tiny", "full", "adamw_8bit", True, 2, 32),  # padded batch, recompute, bnb CPU step
    ],
    ids=lambda p: f"{p.adapter}-{p.optimizer}-ckpt{int(p.checkpointing)}",
)
def test_point_within_target(tmp_path, point):
    model_dir = write_model(CONFIG, tmp_path / "m")
    p = run_point(model_dir, point)
    assert p.measured > p.phases["static"][1] > 0  # something was measured beyond the weights
    assert abs(p.error) <= 0.08, f"predicted {p.predicted:.0f} vs measured {p.measured} ({p.error:+.1%})"


# Blocks that are not Llama-shaped: Cohere (parallel attention + MLP on one mean-centred LayerNorm, per-head q/k
# norms) and Apertus (xIELU). Without checkpointing every layer's saved tensors are in the peak, so their per-layer
# terms show: before they were counted the model was 1.0-2.9 % under these peaks (Cohere LoRA / full, Apertus LoRA /
# full: -1.0, -1.7, -2.2, -2.9 %); now within 0.2 %, and the bound is 0.5 %.
BLOCKS = {
    "cohere": {
        "model_type": "cohere", "vocab_size": 2048, "hidden_size": 128, "intermediate_size": 352,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "use_qk_norm": True,
    },
    "apertus": {
        "model_type": "apertus", "vocab_size": 2048, "hidden_size": 128, "intermediate_size": 352,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "xielu",
    },
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("family", list(BLOCKS))
@pytest.mark.parametrize("adapter", ["full", "lora"])
def test_cohere_and_apertus_blocks_within_half_a_percent(tmp_path, family, adapter):
    model_dir = write_model(BLOCKS[family], tmp_path / family)
    p = run_point(model_dir, Point(family, adapter, "adamw_torch", False, 1, 256))
    assert abs(p.error) <= 0.005, f"predicted {p.predicted:.0f} vs measured {p.measured} ({p.error:+.1%})"


@pytest.mark.requires_cuda
def test_cuda_point_measures_three_ways_and_predicts_live_bytes(tmp_path):
    """The GPU harness: allocator peak ≥ exact live bytes, reserved ≥ allocated, and the prediction without
    overheads near the allocator peak. The bound is loose (25 %) until a GPU table calibrates the CUDA terms."""
    from devkit.harness.estimator import measure_cuda, predict

    model_dir = write_model(CONFIG, tmp_path / "m")
    point = Point("qwen2-tiny", "qlora", "paged_adamw_8bit", True, 2, 64)
    m = measure_cuda(model_dir, point, vram_gb=8)
    assert m["allocated"] >= 0.99 * m["exact"] > 0
    assert m["reserved"] >= m["allocated"]
    est = predict(model_dir, point, device="cuda")
    assert abs(est.model_peak_bytes - m["allocated"]) / m["allocated"] <= 0.25


@pytest.mark.slow
def test_full_fine_tune_gradients_appear_in_the_first_backward(tmp_path):
    """Full fine-tuning, every micro-step at full size: step 1 (one micro batch per step, no gradient and no
    optimizer state when it begins), micro-step 2.1 (states, no gradient: the Trainer's zero_grad set them to None)
    and 2.2 (accumulating into them). The first backward's peak is the loss's, before any gradient exists
    (`Estimate.first_micro_batch`); counting every gradient there, as the steady state does, is 9 % over here.
    The bound, 0.5 %, is a tenth of the gradients' share."""
    from devkit.harness.estimator import measure, predict
    from lowmem_ft.memory.arch import Architecture
    from lowmem_ft.memory.estimate import phase_peak_bytes

    model_dir = write_model(CONFIG, tmp_path / "m")
    p = Point("qwen2-tiny", "full", "adamw_torch", False, 2, 64)
    measured = measure(model_dir, p, warmup_seq=p.seq)
    est = predict(model_dir, p)
    arch, s = Architecture.from_config(CONFIG, name="qwen2-tiny"), est.setup
    grads = est.by_name()["gradients"]
    for label, phase, alive, states in (
        ("forward 1.1", "forward", False, False), ("backward 1.1", "backward", False, False),
        ("forward 2.1", "forward", False, True), ("backward 2.1", "backward", False, True),
        ("forward 2.2", "forward", True, True), ("backward 2.2", "backward", True, True),
    ):  # fmt: skip
        predicted = phase_peak_bytes(arch, s, phase, grads=alive, states=states)
        got = measured[label][0]
        assert abs(predicted - got) <= 0.005 * got, f"{label}: predicted {predicted:.0f}, measured {got}"
    # the gradients are what the first backward lacks, and the plan at accumulation 1 prices that moment
    assert measured["backward 2.2"][0] - measured["backward 2.1"][0] == pytest.approx(grads, rel=0.01)
    assert est.model_peak_bytes == max(est.first_micro_batch["backward"], est.phases["optimizer step"])
