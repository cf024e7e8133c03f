"""The layer-extrapolation proof on every other zoo family, at the least depth that still extrapolates: tracing two
small depths and extrapolating equals tracing the whole model, to the byte.

`test_layers.py` proves it for one model of each layer pattern at the depths the tracer itself first extrapolates
at (9 layers and more: the whole trace costs about its depth). Here the tracer's saving margin (`layers.SAVING`) is
set to 0, so the same planning, truncation and extrapolation run on shallower models: a one-layer pattern traced at
2 and 3 layers and extrapolated to 5, Gemma-2's sliding/global pair at 3 and 5 to 9 (odd, so the model is cut
mid-pattern), and a mixture of experts whose first layer is dense (a prefix) at 2 and 3 to 5. The extrapolated
depth lies beyond both traced ones, so a period or prefix found wrong, or bytes that are not affine in the depth,
fail here as they would at full depth. Each family runs on its own point of the grid, so all six points run.
"""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from devkit.zoo import FAMILIES, NAMES
from tests.train.trace.depths import DEEP, GRID, MOE, assert_extrapolation_exact, deepened, recipe

# The community fine-tunes share their base family's model class (llama, qwen3), qwen-v1 loads as Qwen2, and
# gemma3-vision's decoder is gemma3's text model with its layer pattern (the tower does not run in a text step), so
# their layers extrapolate alike: left out (each costs 10-20 s of one worker); test_step.py still traces them whole
# against the CPU run.
SAME_CLASS = ("llama-zephyr", "qwen3-finetune", "qwen-v1", "gemma3-vision")
SHALLOW = [n for n in NAMES if n not in DEEP and n not in SAME_CLASS]


@pytest.fixture(autouse=True)
def _no_saving_margin(monkeypatch):
    """Extrapolate as soon as the two traced depths are fewer layers than the model (the tracer waits for SAVING more,
    to gain time; the proof does not depend on it)."""
    monkeypatch.setattr("lowmem_ft.train.trace.layers.SAVING", 0)


@pytest.mark.slow
@pytest.mark.parametrize("name", SHALLOW)
def test_extrapolated_trace_equals_the_whole_trace(name):
    paired = name.startswith("gemma")
    config = AutoConfig.for_model(**deepened(FAMILIES[name].config, 9 if paired else 5))
    point = GRID[SHALLOW.index(name) % len(GRID)]
    result = assert_extrapolation_exact(config, recipe(*point), eval_rows=point[3])
    assert result.depth.traced == ((3, 5) if paired else (2, 3))


@pytest.mark.slow
def test_a_dense_first_layer_then_experts_extrapolates_exactly():
    config = AutoConfig.for_model(**{**MOE, "num_hidden_layers": 5, "mlp_only_layers": [0]})
    result = assert_extrapolation_exact(config, recipe("lora", "adamw_torch", True, 2, 32), eval_rows=2)
    assert (result.depth.first, result.depth.period) == (2, 1)
    assert result.depth.traced == (2, 3)


def test_every_grid_point_runs_on_some_family():
    assert len(SHALLOW) >= len(GRID)
