"""The estimator against exact CPU measurements on one tiny LoRA point.

The bound is loose on purpose and documents the current state: the CPU grid (benchmarks/estimator_cpu.md) shows the
model under-predicting by ~25-38 %, short of the 3 %/8 % targets; tighten this bound as the activation and
CPU-loss terms are calibrated.
"""

from __future__ import annotations

import pytest

from lowmem_ft.train.estimator_check import Point, run_point, write_model

CONFIG = {
    "model_type": "qwen2", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 192,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False,
}  # fmt: skip


@pytest.mark.slow
def test_lora_point_within_current_bound(tmp_path):
    model_dir = write_model(CONFIG, tmp_path / "m")
    p = run_point(model_dir, Point("qwen2-tiny", "lora", "adamw_torch", False, 1, 64))
    assert p.measured > 0
    assert abs(p.error) < 0.45, f"predicted {p.predicted:.0f} vs measured {p.measured} ({p.error:+.1%})"
