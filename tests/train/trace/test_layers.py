"""Tracing two small depths and extrapolating equals tracing the whole model, to the byte: every zoo family
deepened (its layer pattern repeated), each on a point of the fidelity grid, and mixtures of experts with a
dense/sparse layer pattern; the period and prefix found from the layers themselves."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from devkit.zoo import FAMILIES, NAMES
from lowmem_ft.recipe.load import resolve
from lowmem_ft.train.trace.layers import period_of, plan
from lowmem_ft.train.trace.step import trace

# The shallowest depths the tracer extrapolates at (trace_layers.plan: the two traced depths and SAVING layers fewer
# than the model), as the whole trace costs about its depth: a one-layer pattern is traced at 2 and 3 layers and
# extrapolated to 9; a two-layer pattern (Gemma) at 3 and 5 layers to 13, odd so that the model is cut mid-pattern.
DEPTH, PAIRED_DEPTH = 9, 13
# (adapter, optimizer, checkpointing, batch, seq): one per family, cycling as in test_step.py's grid
GRID = [
    ("lora", "adamw_torch", False, 1, 48),
    ("full", "adamw_8bit", True, 2, 32),
    ("qlora", "adamw_torch", True, 2, 32),
    ("lora", "adamw_8bit", False, 2, 40),
    ("qlora", "adamw_8bit", False, 1, 48),
    ("full", "adamw_torch", True, 1, 32),
]


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
    extrapolated = trace(r, config, eval_rows=eval_rows)
    whole = trace(r, config, eval_rows=eval_rows, whole=True)
    assert extrapolated.depth is not None and whole.depth is None
    assert max(extrapolated.depth.traced) < config.get_text_config().num_hidden_layers
    assert extrapolated.marks == whole.marks
    return extrapolated


# The community fine-tunes share their base family's model class (llama, qwen3), qwen-v1 loads as Qwen2, and
# gemma3-vision's decoder is gemma3's text model with its layer pattern (the tower does not run in a text step), so
# their layers extrapolate alike: left out here (each costs 20-30 s of one worker); test_step.py still traces them
# whole against the CPU run.
LAYER_NAMES = [n for n in NAMES if n not in ("llama-zephyr", "qwen3-finetune", "qwen-v1", "gemma3-vision")]


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYER_NAMES)
def test_extrapolated_trace_equals_the_whole_trace(name):
    config = AutoConfig.for_model(
        **deepened(FAMILIES[name].config, PAIRED_DEPTH if name.startswith("gemma") else DEPTH)
    )
    point = GRID[NAMES.index(name) % len(GRID)]
    result = assert_extrapolation_exact(config, recipe(*point), eval_rows=point[3])
    assert result.depth.traced == ((3, 5) if name.startswith("gemma") else (2, 3))


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


@pytest.mark.slow
@pytest.mark.parametrize(
    ("extra", "prefix_period"),
    [({"decoder_sparse_step": 2}, (0, 2)), ({"mlp_only_layers": [0]}, (1, 1))],
    ids=["dense-sparse-alternating", "first-layer-dense"],
)
def test_mixture_of_experts_patterns_extrapolate_exactly(extra, prefix_period):
    config = AutoConfig.for_model(**{**MOE, "num_hidden_layers": 10, **extra})  # the shallowest extrapolated
    r = recipe("lora", "adamw_torch", True, 2, 32)
    result = assert_extrapolation_exact(config, r, eval_rows=2)
    assert (result.depth.first, result.depth.period) == (2, prefix_period[1])


def test_period_of_finds_the_shortest_repetition_after_a_prefix():
    assert period_of(list("aaaaaa")) == (0, 1)
    assert period_of(list("ababab")) == (0, 2)
    assert period_of(list("baaaaaaa")) == (1, 1)
    assert period_of(list("aaaaabaaaaab")) == (0, 6)
    assert period_of(list("abcd")) == (0, 4)


def test_a_shallow_model_is_traced_whole_and_a_deep_one_from_two_depths():
    import torch
    from transformers import AutoModelForCausalLM

    config = AutoConfig.for_model(**deepened(FAMILIES["llama3"].config, 4))
    cls = AutoModelForCausalLM._model_mapping[type(config)]
    assert plan(cls, config, torch.bfloat16) is None  # 4 layers: tracing 2 and 3 would save nothing
    config = AutoConfig.for_model(**deepened(FAMILIES["llama3"].config, 32))
    depth = plan(cls, config, torch.bfloat16)
    assert depth is not None and depth.traced == (2, 3) and depth.extrapolate(10, 13) == 10 + 30 * 3
