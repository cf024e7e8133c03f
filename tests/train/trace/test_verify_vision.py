"""`--verify` of a vision-language plan: the traced step carries the plan's images through the family's processor
and `train`'s collator, counts them as a real run does, extrapolates from two decoder depths to the byte (the
tower traced whole), and `plan --verify --data` prints traced against predicted per phase."""

from __future__ import annotations

import re

import pytest

from lowmem_ft.cli import main
from lowmem_ft.recipe.load import resolve


@pytest.fixture(scope="module")
def image_chat(tmp_path_factory):
    """One image chat with two photos of 448×336 and 336×448 pixels (`devkit.harness.vision.write_data`)."""
    from devkit.harness.vision import write_data

    return write_data(tmp_path_factory.mktemp("vlm"), 2)


def image_recipe(model_dir: str, data, *, batch: int = 2, seq: int = 512, checkpointing: bool = True):
    return resolve(None, {
        "model": {"name_or_path": model_dir, "quantization": "none"},
        "adapter": {"kind": "lora", "r": 8},
        "optimizer": {"name": "adamw_torch"},
        "memory": {"gradient_checkpointing": checkpointing, "micro_batch_size": batch, "max_seq_len": seq,
                   "gradient_accumulation": 1},
        "data": {"path": str(data)},
    })  # fmt: skip


def deepened(config, depth: int):
    """The config with `depth` decoder layers (its layer pattern repeated): deep enough to extrapolate."""
    import copy

    config = copy.deepcopy(config)
    text = config.get_text_config()
    pattern = getattr(text, "layer_types", None)
    text.num_hidden_layers = depth
    if pattern:
        text.layer_types = [pattern[i % len(pattern)] for i in range(depth)]
    return config


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2.5-vl"])
def test_extrapolated_image_trace_equals_the_whole_trace(vl_checkpoint, image_chat, name):
    """The decoder traced at two depths and extrapolated equals it traced whole, to the byte, with the images'
    tower run whole in every micro batch (the tiny Qwen2.5-VL's tower has as many blocks as a truncated decoder:
    the decoder stack is found beside it, not in it). Gemma-3's image step is left out (30 s of one worker): its
    decoder is gemma3's text model, whose paired layer pattern test_layers.py proves at 13 layers, and its image
    mask is built once per forward, not per layer; its full-size trace is in benchmarks/real_size_vlm.md."""
    from lowmem_ft.train.trace.step import model_config, trace

    r = image_recipe(vl_checkpoint(name), image_chat, seq=512 if name == "qwen2.5-vl" else 128)  # the sample fits whole
    depth = 13 if name == "gemma3-vision" else 9  # a two-layer pattern: traced at 3 and 5; one layer: 2 and 3
    config = deepened(model_config(r), depth)
    extrapolated = trace(r, config)
    whole = trace(r, config, whole=True)
    assert extrapolated.depth is not None and whole.depth is None
    assert extrapolated.images is not None and extrapolated.images.patches > 0
    assert extrapolated.marks == whole.marks


@pytest.mark.slow
def test_traced_image_step_equals_the_real_one(vl_checkpoint, image_chat):
    """The tracer's step run for real (weights, real pixel values through the tower) and traced (fake weights, the
    batch's data real, large pixel values as `Shadow` decides): the same bytes at every mark."""
    import torch

    from lowmem_ft.train.model import build_model
    from lowmem_ft.train.trace.images import image_sample
    from lowmem_ft.train.trace.step import install_loss, optimizer_for, run_step, trace

    r = image_recipe(vl_checkpoint("qwen2.5-vl"), image_chat, checkpointing=False)
    torch.manual_seed(0)
    model = build_model(r)
    install_loss(model, r)
    real = run_step(model, optimizer_for(model, r), r, images=image_sample(r))
    traced = trace(r, whole=True)
    assert real == traced.marks


@pytest.mark.slow
def test_plan_verify_with_image_data_prints_traced_against_predicted(vl_checkpoint, image_chat, capsys):
    """The plan names the image tokens per sample and its cap; --verify traces that plan with those images and
    agrees within 2 % on every phase (a vision-language run evaluates nothing: no eval phase)."""
    assert (
        main(["plan", "--model", vl_checkpoint("qwen2.5-vl"), "--vram", "8", "--data", str(image_chat), "--verify"])
        == 0
    )
    out = capsys.readouterr().out
    gaps = re.findall(r"^  (static|forward|backward|optimizer step)\s+traced .*\(([+-][\d.]+)%\)$", out, re.M)
    assert {phase for phase, _ in gaps} == {"static", "forward", "backward", "optimizer step"}
    assert all(abs(float(gap)) <= 2.0 for _, gap in gaps), gaps
    assert not re.search(r"^  eval\s+traced", out, re.M)
    assert re.search(r"images: the sample of .*vlm\.jsonl with the most image patches, \d+ patches a sample", out)
    assert "image tokens per sample p50" in out and "vision.max_pixels" in out


def test_without_data_one_image_as_large_as_the_cap_is_traced():
    """Without --data the trace feeds one synthetic image that makes the most tokens the cap allows, as the plan
    prices it (`plan_patches`: the tower's patches at the cap)."""
    from lowmem_ft.train.trace.images import largest_image
    from lowmem_ft.vision.qwen_vl import QwenVLImages

    images = QwenVLImages()
    for tokens in (1280, 1024, 768, 64):
        height, width = largest_image(images, tokens * 28 * 28)
        assert images.tokens(height, width, tokens * 28 * 28) == tokens
        assert max(height, width) / min(height, width) <= 2
