"""The layer-extrapolation proof's parts (`test_layers.py`, `test_layers_families.py`): a zoo config deepened to a
given number of decoder layers, the grid's recipes, and the check that the extrapolated trace equals the whole one."""

from __future__ import annotations

from lowmem_ft.recipe.load import resolve
from lowmem_ft.train.trace.step import trace
from tests.train.trace.test_step import GRID as STEP_GRID

# (adapter, optimizer, checkpointing, batch, seq): the points of test_step.py's grid, each proven on some family; the
# last with checkpointing on, as the layer proof always had it
GRID = [*STEP_GRID[:-1], ("full", "adamw_torch", True, 1, 32)]

# The families test_layers.py proves at depth (the others: test_layers_families.py): family → (depth, grid point,
# traced depths), the shallowest depths the tracer extrapolates at (layers.plan: the two traced depths and SAVING
# layers fewer than the model)
DEEP = {
    "llama3": (9, GRID[1], (2, 3)),  # full fine-tune, 8-bit Adam, checkpointing
    "gemma3": (13, GRID[4], (3, 5)),  # QLoRA, 8-bit Adam, no checkpointing; odd, so the model is cut mid-pattern
}


def deepened(config: dict, depth: int) -> dict:
    """`config` with `depth` decoder layers, its per-layer pattern (layer_types) repeated."""
    config = {**config}
    text = config
    if "text_config" in config:
        text = config["text_config"] = {**config["text_config"]}
    text["num_hidden_layers"] = depth
    text.setdefault("pad_token_id", 0)  # as the zoo's tokenizer sets it (Phi-3's default id is beyond a tiny vocab)
    if "layer_types" in text:
        pattern = text["layer_types"]
        text["layer_types"] = [pattern[i % len(pattern)] for i in range(depth)]
    return config


def recipe(adapter: str, optimizer: str, checkpointing: bool, batch: int, seq: int):
    return resolve(
        None,
        {
            "model": {"name_or_path": "zoo", "quantization": "nf4" if adapter == "qlora" else "none"},
            "adapter": {"kind": "full" if adapter == "full" else "lora", "r": 8},
            "optimizer": {"name": optimizer},
            "memory": {"gradient_checkpointing": checkpointing, "micro_batch_size": batch, "max_seq_len": seq,
                       "gradient_accumulation": 1},
        },
    )  # fmt: skip


def assert_extrapolation_exact(config, r, eval_rows: int = 0):
    """Trace `config`'s model as the tracer chooses (from two smaller depths) and whole; every mark's peak and live
    bytes must be equal. Returns the extrapolated trace (its `depth` says which depths were traced)."""
    extrapolated = trace(r, config, eval_rows=eval_rows)
    whole = trace(r, config, eval_rows=eval_rows, whole=True)
    assert extrapolated.depth is not None and whole.depth is None
    assert max(extrapolated.depth.traced) < config.get_text_config().num_hidden_layers
    assert extrapolated.marks == whole.marks
    return extrapolated


# A tiny Qwen2-MoE: `decoder_sparse_step` / `mlp_only_layers` give it a dense/sparse layer pattern
MOE = {
    "model_type": "qwen2_moe",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
}
