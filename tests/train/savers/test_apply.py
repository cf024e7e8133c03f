"""apply_memory_savers: the recipe's long-context keys reach the built model, and bad values are one-line errors."""

from __future__ import annotations

import pytest

from lowmem_ft.errors import UserError
from lowmem_ft.recipe.load import resolve
from lowmem_ft.train.model import build_model
from lowmem_ft.train.savers.apply import check_memory_keys
from lowmem_ft.train.savers.tiles import decoder_mlps


def test_build_model_applies_both_savers(tiny_model):
    recipe = resolve(
        "8gb", {"model": {"name_or_path": tiny_model}, "memory": {"tiled_mlp": True, "embeddings_on_host": True}}
    )
    model = build_model(recipe)
    hidden = model.config.hidden_size
    assert [m._lowmem_tile_tokens for _, m in decoder_mlps(model)] == [hidden] * model.config.num_hidden_layers
    assert model.get_base_model().get_input_embeddings()._lowmem_on_host


def test_bad_values_are_reported_together():
    """Out of range: the schema's declared range, when the recipe resolves; LoRA-only savers on a full fine-tune:
    when the savers are applied. Each names every key at fault."""
    with pytest.raises(UserError) as err:
        resolve(None, {"memory": {"loss_chunk_tokens": -1, "mlp_tile_tokens": -2}})
    for key in ("loss_chunk_tokens", "mlp_tile_tokens"):
        assert f"'memory.{key}' must be at least 0" in str(err.value)
    recipe = resolve(None, {"adapter": {"kind": "full"}, "model": {"quantization": "none"},
                            "memory": {"embeddings_on_host": True, "recompute_lora": True}})  # fmt: skip
    with pytest.raises(UserError) as err:
        check_memory_keys(recipe)
    for key in ("embeddings_on_host", "recompute_lora"):
        assert key in str(err.value)
