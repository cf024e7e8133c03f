"""A model_type read as Llama-shaped whose weights hold another block is named, not planned silently."""

from __future__ import annotations

import json
import logging

import numpy as np
from safetensors.numpy import save_file  # numpy, not torch: the memory model's tests run without torch

from lowmem_ft.memory.arch import load_architecture
from lowmem_ft.memory.layout import layout_mismatch

CONFIG = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
          "num_attention_heads": 2}  # fmt: skip


def _model(path, model_type: str, layer0: dict[str, tuple[int, int]], prefix: str = "model.layers.0."):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": model_type, **CONFIG}))
    tensors = {f"{prefix}{name}.weight": np.zeros(shape, dtype=np.float32) for name, shape in layer0.items()}
    save_file(
        {**tensors, "model.embed_tokens.weight": np.zeros((64, 16), dtype=np.float32)}, str(path / "model.safetensors")
    )
    return path


LLAMA = {"self_attn.q_proj": (16, 16), "self_attn.k_proj": (16, 16), "self_attn.v_proj": (16, 16),
         "self_attn.o_proj": (16, 16), "mlp.gate_proj": (32, 16), "mlp.up_proj": (32, 16), "mlp.down_proj": (16, 32)}  # fmt: skip


def test_a_llama_shaped_block_passes(tmp_path, caplog):
    path = _model(tmp_path / "m", "mymodel", LLAMA)
    with caplog.at_level(logging.WARNING, logger="lowmem_ft.memory.layout"):
        load_architecture(str(path))
    assert not [r for r in caplog.records if r.name == "lowmem_ft.memory.layout"]
    # the family itself is still unknown: its norms and biases are not checked by the linears' layout
    assert [r.name for r in caplog.records] == ["lowmem_ft.memory.arch"]


def test_another_block_under_an_unknown_model_type_is_named(tmp_path, caplog):
    """Persimmon-like: fused query_key_value, dense, a plain dense_h_to_4h / dense_4h_to_h MLP."""
    persimmon = {"self_attn.query_key_value": (48, 16), "self_attn.dense": (16, 16), "mlp.dense_h_to_4h": (32, 16),
                 "mlp.dense_4h_to_h": (16, 32)}  # fmt: skip
    path = _model(tmp_path / "m", "mymodel", persimmon)
    with caplog.at_level(logging.WARNING, logger="lowmem_ft.memory.layout"):
        load_architecture(str(path))
    assert "its weights' layers hold dense, dense_4h_to_h, dense_h_to_4h, query_key_value" in caplog.text
    assert "reads model_type 'mymodel' as q_proj, k_proj" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lowmem_ft.memory.layout"):
        load_architecture(str(path))  # `train` reads it again for its memory check: said once per command
    assert not caplog.records


def test_shapes_other_than_the_configs_are_named(tmp_path):
    wide = {**LLAMA, "mlp.gate_proj": (64, 16), "mlp.up_proj": (64, 16), "mlp.down_proj": (16, 64)}
    path = _model(tmp_path / "m", "llama", wide)
    why = layout_mismatch(load_architecture(str(path)), path)
    assert why and "gate_proj (64, 16)" in why
