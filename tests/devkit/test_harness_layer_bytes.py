"""The per-layer harness (devkit/harness/layer_bytes.py) on a block whose heads·head_dim is not its hidden size: the measured
bytes one layer keeps equal the memory model's, for a full fine-tune (where the linears' inputs decide) and LoRA."""

from __future__ import annotations

import pytest

from devkit.harness.layer_bytes import SHAPES, measured_layer_bytes, predicted_layer_bytes


@pytest.mark.slow
@pytest.mark.parametrize("adapter", ["full", "lora"])
def test_a_wide_attention_layer_keeps_what_the_model_says(adapter):
    """Llama-shaped, hidden 256, 4 heads × 96: before the linears' inputs were grouped by tensor the full fine-tune
    was predicted 256 B/token over (c · (384 − 256): o_proj's width counted for the MLP's norm output)."""
    config = {**SHAPES["llama 4×96"], "intermediate_size": 352}
    measured = measured_layer_bytes(config, adapter, seq=64)
    assert measured > 0
    assert predicted_layer_bytes(config, adapter, seq=64) == pytest.approx(measured, rel=0.005)
