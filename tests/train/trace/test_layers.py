"""Tracing two small depths and extrapolating equals tracing the whole model, to the byte, at the depths the tracer
itself first extrapolates at (`layers.SAVING` as shipped): one model of each layer pattern, the period and prefix
found from the layers themselves.

What is proven where (the whole trace costs about its depth, so the deep proof is kept to one model a pattern):
- here, deep: a one-layer pattern (Llama-3, 9 layers, traced at 2 and 3), a two-layer pattern read from
  `layer_types` (Gemma-3, 13 layers, traced at 3 and 5: cut mid-pattern), and a mixture of experts whose dense and
  sparse layers alternate (10 layers, traced at 2 and 4); between them every adapter kind (full, QLoRA, LoRA), both
  optimizer families and checkpointing on and off;
- `test_layers_families.py`, shallow: every other zoo family and a mixture of experts with a dense first layer (a
  prefix), at the least depth that still extrapolates beyond both traced depths, each on a point of the grid so
  that all six points run; a period or prefix found wrong fails there as it does here.
"""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from devkit.zoo import FAMILIES
from lowmem_ft.train.trace.layers import period_of, plan
from tests.train.trace.depths import DEEP, MOE, assert_extrapolation_exact, deepened, recipe


@pytest.mark.slow
@pytest.mark.parametrize("name", DEEP)
def test_extrapolated_trace_equals_the_whole_trace(name):
    depth, point, traced = DEEP[name]
    config = AutoConfig.for_model(**deepened(FAMILIES[name].config, depth))
    result = assert_extrapolation_exact(config, recipe(*point), eval_rows=point[3])
    assert result.depth.traced == traced


@pytest.mark.slow
def test_alternating_dense_and_sparse_experts_extrapolate_exactly():
    config = AutoConfig.for_model(**{**MOE, "num_hidden_layers": 10, "decoder_sparse_step": 2})  # the shallowest
    result = assert_extrapolation_exact(config, recipe("lora", "adamw_torch", True, 2, 32), eval_rows=2)
    assert (result.depth.first, result.depth.period) == (2, 2)


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
