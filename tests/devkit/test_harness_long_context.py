"""The long-context terms against exact CPU measurement on two quick points (the grid is
benchmarks/long_context_cpu.md); the bound is the issue's max-error target, 8 %."""

from __future__ import annotations

import pytest

from devkit.harness.long_context import LongPoint, run_point, write_model

CONFIG = {
    "model_type": "qwen2", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 320,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False,
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "point",
    [
        LongPoint(
            "qwen2-tiny",
            "lora",
            True,
            1536,
            tiled_mlp=True,
            tiled_norms=True,
            recompute_lora=True,
            host_embeddings=True,
            loss_chunk_tokens=64,
        ),  # fmt: skip
        LongPoint("qwen2-tiny", "lora", False, 1024, tiled_mlp=True, tile_tokens=512, loss_chunk_tokens=32),
    ],
    ids=["ckpt-all-savers", "no-ckpt-tiled-big-tile"],
)
def test_long_context_point_within_target(tmp_path, point):
    p = run_point(write_model(CONFIG, tmp_path / "m"), point)
    assert p.measured > p.phases["static"][1] > 0
    assert abs(p.error) <= 0.08, f"predicted {p.predicted:.0f} vs measured {p.measured} ({p.error:+.1%})"
    # the untiled prediction for the same point would be far off: the tiled terms are what is being checked
    from dataclasses import replace

    from devkit.harness.long_context import predict

    untiled = predict(tmp_path / "m", replace(p, tiled_mlp=False)).model_peak_bytes
    assert untiled > 1.2 * p.measured
