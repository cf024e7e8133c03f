"""The tracer against the exact CPU measurement of the same step: every zoo family, every adapter kind, both
optimizer families, checkpointing on and off, padded and unpadded batches, the long-context savers, evaluation.

The yardstick is `devkit.harness.estimator.measure` (and `devkit.harness.long_context.measure` for the savers), run on
the same zoo model with its weights; the trace builds the model from its config alone, with no weights. The target
is 0.1 % per phase mark; on these points the trace equals the measurement to the byte.
"""

from __future__ import annotations

import pytest

from devkit.harness import estimator as estimator_check
from devkit.harness import long_context as long_context_check
from devkit.harness.estimator import Point
from devkit.harness.long_context import LongPoint
from devkit.zoo import NAMES
from lowmem_ft.errors import UserError
from lowmem_ft.train.trace.step import trace

TOLERANCE = 0.001

# A representative spread of the CPU estimator grid (benchmarks/estimator_cpu.md), one point per zoo model, so
# that every adapter kind, optimizer, checkpointing setting and padding case runs on several families.
GRID = [
    ("lora", "adamw_torch", False, 1, 48),
    ("full", "adamw_8bit", True, 2, 32),
    ("qlora", "adamw_torch", True, 2, 32),
    ("lora", "adamw_8bit", False, 2, 40),
    ("qlora", "adamw_8bit", False, 1, 48),
    ("full", "adamw_torch", False, 1, 32),
]
POINTS = {name: GRID[i % len(GRID)] for i, name in enumerate(NAMES)}


def assert_same(measured: dict, traced: dict) -> None:
    for label, (peak, live) in measured.items():
        got_peak, got_live = traced[label]
        assert abs(got_peak - peak) <= TOLERANCE * peak, f"{label}: peak traced {got_peak} vs measured {peak}"
        assert abs(got_live - live) <= TOLERANCE * max(live, 1), f"{label}: live traced {got_live} vs measured {live}"


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_trace_equals_the_exact_cpu_measurement(zoo_models, name):
    from pathlib import Path

    adapter, optimizer, checkpointing, batch, seq = POINTS[name]
    point = Point(name, adapter, optimizer, checkpointing, batch, seq)
    model_dir = Path(zoo_models[name])
    recipe = estimator_check.recipe_for(model_dir, point)
    if name == "gemma3-vision":  # the harness reads config.vocab_size, which a multimodal wrapper's config lacks
        measured = real_step(recipe)
    else:
        measured = estimator_check.measure(model_dir, point)
        measured.pop("peak")
    traced = trace(recipe)
    assert_same(measured, {k: v for k, v in traced.marks.items() if k != "eval"})


@pytest.mark.slow
@pytest.mark.parametrize(
    "point",
    [
        LongPoint("mistral", "lora", True, 256, tiled_mlp=True, tile_tokens=64, host_embeddings=True,
                  loss_chunk_tokens=64, recompute_lora=True, tiled_norms=True),
        LongPoint("qwen2.5", "qlora", False, 192, batch=2, loss_chunk_tokens=48),
    ],
    ids=["mistral-savers", "qwen-qlora-chunked"],
)  # fmt: skip
def test_trace_equals_the_measurement_with_long_context_savers(zoo_models, point):
    from pathlib import Path

    model_dir = Path(zoo_models[point.arch])
    before = _live_tensor_bytes()
    measured = long_context_check.measure(model_dir, point)
    measured.pop("peak")
    traced = trace(long_context_check.recipe_for(model_dir, point))
    # This harness counts every tensor the garbage collector knows when it starts (no `roots`): the tensors earlier
    # tests left alive (none when run alone, ~110 kB after the whole suite) and, with bitsandbytes loaded, its
    # process-wide quantization maps (1,420 B here), alive through the whole run. So every mark is off by the same
    # bytes, at most those, and otherwise equal.
    offsets = {m - t for label, pair in measured.items() for m, t in zip(pair, traced.marks[label], strict=True)}
    assert len(offsets) == 1 and 0 <= offsets.pop() < before + 4096, (offsets, before)


def _live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor the garbage collector knows now."""
    import gc

    import torch

    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            try:
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
            except (RuntimeError, NotImplementedError):  # fake or meta tensors hold no bytes
                continue
    return sum(storages.values())


def real_step(recipe, eval_rows: int = 0) -> dict:
    """The tracer's step run for real on the model `train` builds (weights and all)."""
    import torch

    from lowmem_ft.train.model import build_model
    from lowmem_ft.train.trace.step import install_loss, optimizer_for, run_step

    torch.manual_seed(0)
    model = build_model(recipe)
    install_loss(model, recipe)
    return run_step(model, optimizer_for(model, recipe), recipe, eval_rows=eval_rows)


@pytest.mark.slow
def test_traced_evaluation_equals_the_real_one(zoo_models):
    """The evaluation forward (no gradients, through the fused head as SFTTrainer.prediction_step) traced and run
    for real by the same step."""
    from pathlib import Path

    model_dir = Path(zoo_models["gemma2"])
    recipe = estimator_check.recipe_for(model_dir, Point("gemma2", "lora", "adamw_torch", True, 2, 32))
    real = real_step(recipe, eval_rows=2)
    traced = trace(recipe, eval_rows=2)
    assert "eval" in traced.marks and traced.marks["eval"][0] > traced.marks["optimizer 2"][1]
    assert_same(real, traced.marks)


def test_attention_mask_stays_real_so_transformers_skips_it_as_in_a_real_run():
    """transformers skips an all-ones attention mask (`_ignore_causal_mask_sdpa`) unless the mask is a fake tensor
    (`is_tracing`), when it builds the mask a real run does not: the tracer keeps data real."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers.masking_utils import _ignore_causal_mask_sdpa

    from lowmem_ft.train.trace.step import Shadow

    mask = torch.ones(1, 16, dtype=torch.bool)
    with Shadow():
        assert _ignore_causal_mask_sdpa(mask, 16, 16, 0, 0)
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    assert not _ignore_causal_mask_sdpa(fake.from_tensor(mask), 16, 16, 0, 0)


def test_shadow_writes_into_real_buffers_without_a_copy():
    """An in-place operator of fake data into a real buffer returns the buffer itself (one storage, as in a real
    run), and large results of real data run fake."""
    import torch

    from lowmem_ft.train.trace.step import REAL_LIMIT, Shadow

    shadow = Shadow()
    weight = shadow.fake_tensor((8, 8), torch.float32)
    with shadow:
        buffer = torch.zeros(4, 8)
        out = buffer.addmm_(torch.ones(4, 8), weight)
        big = torch.zeros(REAL_LIMIT // 4 + 1)
    assert out is buffer
    assert type(big).__name__ == "FakeTensor" and type(buffer) is torch.Tensor


def test_remote_code_is_refused_in_one_line(tmp_path):
    import json

    from lowmem_ft.recipe.load import resolve

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "custom", "auto_map": {"AutoModel": "x.Y"}}))
    recipe = resolve(None, {"model": {"name_or_path": str(tmp_path)}})
    with pytest.raises(UserError, match="auto_map"):
        trace(recipe)


@pytest.mark.slow
def test_the_trace_runs_the_full_logits_loss_the_recipe_trains_with(zoo_models, monkeypatch):
    """`memory.full_logits_loss`: the traced step (what `train --verify` compares with the plan) goes through the
    full-logits head `train` installs, not TRL's fused one, and equals the same step run with weights."""
    from pathlib import Path

    from lowmem_ft.train import losses

    recipe = estimator_check.recipe_for(
        Path(zoo_models["llama3"]), Point("llama3", "lora", "adamw_torch", False, 2, 48)
    )
    recipe.memory.full_logits_loss = True
    calls, plain = [], losses.full_token_log_probs
    monkeypatch.setattr(losses, "full_token_log_probs", lambda *a, **k: calls.append(1) or plain(*a, **k))
    traced = trace(recipe)
    assert len(calls) == sum(label.startswith("forward") for label in traced.marks)
    assert_same(real_step(recipe), {k: v for k, v in traced.marks.items() if k != "eval"})
