"""The memory model of an image step (`lowmem_ft.memory.tower`, `lowmem_ft.memory.vision`) against exact live bytes
on the CPU: the frozen tower's working set per patch, a whole step's phases on the tiny Qwen2.5-VL zoo checkpoint
(devkit/harness/vision.py), and the plan pricing the pixel values and the tower from the data's images."""

from __future__ import annotations

import pytest

from lowmem_ft.memory.arch import load_architecture
from lowmem_ft.memory.estimate import Setup, estimate
from lowmem_ft.memory.tower import PIXELS

# (family, hidden, intermediate, heads): at each family's first shapes the attention (or rotary) moment is the larger,
# at its last the MLP's; Qwen2-VL's intermediate is hidden × mlp_ratio
TOWERS = [
    ("qwen2_5_vl", 64, 128, 2), ("qwen2_5_vl", 80, 128, 2), ("qwen2_5_vl", 128, 256, 4), ("qwen2_5_vl", 128, 1024, 2),
    ("qwen2_vl", 64, 128, 2), ("qwen2_vl", 128, 512, 4), ("qwen2_vl", 64, 1024, 2),
    ("qwen3_vl", 64, 128, 2), ("qwen3_vl", 128, 256, 4), ("qwen3_vl", 64, 1024, 2),
    ("gemma3", 64, 128, 2), ("gemma3", 128, 256, 4), ("gemma3", 64, 1024, 2),
    ("smolvlm", 64, 128, 2), ("smolvlm", 128, 256, 4), ("smolvlm", 64, 1024, 2),
    ("llava", 64, 128, 2), ("llava", 128, 256, 4), ("llava", 64, 1024, 2),
    ("llava-onevision", 64, 128, 2), ("llava-onevision", 128, 256, 4), ("llava-onevision", 64, 1024, 2),
]  # fmt: skip
# the zoo families whose whole model's `get_image_features` is measured (224-pixel tiles of 14-pixel patches)
WHOLE = ("smolvlm", "llava", "llava-onevision")


def _whole(family: str, hidden: int, intermediate: int, heads: int):
    """The zoo family's model at these tower shapes in bf16, and the memory model's description of its tower."""
    import copy

    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText

    from devkit.zoo import FAMILIES
    from lowmem_ft.memory.arch import Architecture

    config = copy.deepcopy(dict(FAMILIES[family].config))
    config["vision_config"].update(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
                                   image_size=224)  # fmt: skip
    if family == "llava-onevision":  # one 224-pixel crop and the base, or two and the base
        config["image_grid_pinpoints"] = [[224, 224], [224, 448]]
    built = AutoConfig.for_model(**config)
    built.vision_config._attn_implementation = "sdpa"
    model = AutoModelForImageTextToText.from_config(built, dtype=torch.bfloat16)
    return (model,), Architecture.from_config(built.to_dict(), name=family).vision


def _image_inputs(model, tiles: int) -> dict:
    """`get_image_features`' inputs for `tiles` 224-pixel tiles (OneVision: the crops of one image, with its base)."""
    import torch

    c = model.config
    if c.model_type == "idefics3":
        return {"pixel_values": torch.randn(1, tiles, 3, 224, 224),
                "pixel_attention_mask": torch.ones(1, tiles, 224, 224, dtype=torch.long)}  # fmt: skip
    select = {"vision_feature_layer": c.vision_feature_layer,
              "vision_feature_select_strategy": c.vision_feature_select_strategy}  # fmt: skip
    if c.model_type == "llava":
        return {"pixel_values": torch.randn(tiles, 3, 224, 224), **select}
    return {"pixel_values": torch.randn(1, tiles + 1, 3, 224, 224), "image_sizes": torch.tensor([[224, 224 * tiles]]),
            "batch_num_images": torch.tensor([1]), "vision_aspect_ratio": c.vision_aspect_ratio, **select}  # fmt: skip


def _tower(family: str, hidden: int, intermediate: int, heads: int):
    """(the transformers tower in bf16, the memory model's description of it)."""
    import torch
    from transformers import Gemma3Config, Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig

    from lowmem_ft.memory.vision import qwen2_5_vl_tower, qwen2_vl_tower, qwen3_vl_tower
    from lowmem_ft.memory.vision_towers import gemma3_tower

    if family in WHOLE:
        return _whole(family, hidden, intermediate, heads)
    if family == "gemma3":  # 224×224 crops of 14×14 patches, pooled 256 → 64 tokens by the projector
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector
        from transformers.models.siglip.modeling_siglip import SiglipVisionModel

        vision = dict(
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=2,
            num_attention_heads=heads,
            image_size=224,
            patch_size=14,
            vision_use_head=False,
        )
        text = dict(hidden_size=64, vocab_size=256, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=32, intermediate_size=128)  # fmt: skip
        config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=64)
        config.vision_config._attn_implementation = "sdpa"
        tower = SiglipVisionModel._from_config(config.vision_config, dtype=torch.bfloat16)
        projector = Gemma3MultiModalProjector(config).to(torch.bfloat16)
        return (tower, projector), gemma3_tower(vision, 64, 64)["vision"]
    if family == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel as T

        vision = dict(depth=2, hidden_size=hidden, intermediate_size=intermediate, num_heads=heads,
                      out_hidden_size=64, window_size=56, fullatt_block_indexes=[1])  # fmt: skip
        config, described = Qwen2_5_VLConfig(vision_config=vision).vision_config, qwen2_5_vl_tower(vision, 64)
    elif family == "qwen2_vl":
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel as T

        vision = dict(depth=2, embed_dim=hidden, hidden_size=64, mlp_ratio=intermediate // hidden, num_heads=heads,
                      hidden_act="quick_gelu")  # fmt: skip
        config, described = Qwen2VLConfig(vision_config=vision).vision_config, qwen2_vl_tower(vision, 64)
    else:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel as T

        vision = dict(depth=2, hidden_size=hidden, intermediate_size=intermediate, num_heads=heads, out_hidden_size=64,
                      num_position_embeddings=16, deepstack_visual_indexes=[0, 1], patch_size=16)  # fmt: skip
        config, described = Qwen3VLConfig(vision_config=vision).vision_config, qwen3_vl_tower(vision, 64)
    config._attn_implementation = "sdpa"
    return (T._from_config(config, dtype=torch.bfloat16),), described["vision"]


def _measured(modules, described, grids: list[tuple[int, int]]) -> tuple[int, int, int]:
    """(patches, peak bytes above what existed, bytes still alive after) of a frozen bf16 tower's forward under
    PeakMemory, run as the family's `get_image_features` runs it (the Qwen towers on the pixel values cast to their
    dtype; SigLIP on fp32 crops, then Gemma-3's projector). `grids`: (h, w) patches per image, or per crop."""
    import torch

    from lowmem_ft.train.measure.peak import PeakMemory

    for m in modules:
        m.eval().requires_grad_(False)
    if hasattr(modules[0], "get_image_features"):  # the whole model: its own get_image_features
        inputs = _image_inputs(modules[0], len(grids))
        tensors = [t for t in inputs.values() if isinstance(t, torch.Tensor)]
        with PeakMemory(device="cpu", roots=[modules[0], *tensors]) as pm:
            before = pm.live_bytes
            out = modules[0].model.get_image_features(**inputs)
            after = pm.live_bytes
        crops = inputs["pixel_values"].shape[-4] if "image_sizes" in inputs else len(grids)
        del out
        return crops * described.tile_patches, pm.peak_bytes - before, after - before
    if len(modules) == 2:  # SigLIP + projector: square crops of the configured size
        side = modules[0].config.image_size
        pixels, inputs = torch.randn(len(grids), 3, side, side), ()
        patches = len(grids) * (side // described.patch) ** 2
    else:
        grid = torch.tensor([[1, h, w] for h, w in grids])
        pixels, inputs = torch.randn(int(grid.prod(-1).sum()), described.patch_values), (grid,)
        patches = pixels.shape[0]
    with PeakMemory(device="cpu", roots=[*modules, pixels, *inputs]) as pm:
        before = pm.live_bytes
        if len(modules) == 2:
            out = [modules[0](pixel_values=pixels)]
            out.append(modules[1](out[0].last_hidden_state))  # the features, kept as the model keeps them
        else:
            out = [modules[0](pixels.type(torch.bfloat16), grid_thw=inputs[0])]
        after = pm.live_bytes
    del out
    return patches, pm.peak_bytes - before, after - before


@pytest.mark.parametrize("shape", TOWERS, ids=lambda t: "-".join(map(str, t)))
def test_the_frozen_towers_working_set_is_its_code(shape):
    """Every family's frozen tower, at one image (or crop) and at two of other sizes: the working set equals
    `frozen_working_set` and what the forward leaves equals the tower's part of `outputs_kept` (its last hidden
    states, the merged or projected features, Qwen3-VL's deepstack features)."""
    modules, tower = _tower(*shape)
    for grids in ([(8, 8)], [(16, 12), (8, 8)]):  # one image; two, of other sizes (Gemma-3: one crop; two)
        patches, peak, left = _measured(modules, tower, grids)
        assert patches > 0 and tower.frozen_working_set(patches, c=2) > 0
        # beside them only the int32 attention bookkeeping (cu_seqlens per window: 132 B at two images)
        assert abs(peak - tower.frozen_working_set(patches, c=2)) <= 256, (shape, grids, peak)
        if hasattr(tower, "left"):  # a ViT: the last (and recorded) hidden states, the features
            kept = tower.left(patches, 2)
            if shape[0] == "llava-onevision" and len(grids) == 2:  # a 1 × 2 grid: 16 newlines, priced as 32
                kept -= 16 * 2 * tower.out_hidden
        else:
            deepstack = getattr(tower, "deepstack", 0)
            kept = 2 * tower.hidden * patches + (1 + deepstack) * tower.merged_bytes(patches, 2)
        assert left == kept, (shape, grids, left, kept)


def test_a_frozen_tower_gets_no_input_grad_hook(qwen_vl):
    """Under checkpointing the build path hooks the embeddings' output to require grad; the tower's patch embedding
    keeps no such hook (its graph would keep every block's activations through the backward), the decoder's does."""
    from lowmem_ft.recipe.load import resolve
    from lowmem_ft.train.model import build_model

    recipe = resolve(None, {"model": {"name_or_path": qwen_vl, "quantization": "none"},
                            "memory": {"gradient_checkpointing": True}})  # fmt: skip
    base = build_model(recipe).get_base_model()

    def hooked(module) -> bool:
        return any("enable_input_require_grads" in h.__qualname__ for h in module._forward_hooks.values())

    assert hooked(base.model.language_model.embed_tokens)
    assert not hooked(base.model.visual.patch_embed)
    assert not any(p.requires_grad for p in base.model.visual.parameters())


# (zoo family, vision.train, checkpointing, patches of the two images): the tower trained three ways on Qwen2.5-VL,
# frozen on each other family (Qwen3-VL's 16-pixel patches; Gemma-3's two 28×28 crops of 4 patches, tiny; SmolVLM's
# 7 × 6 tiles of 56 px and a global image per image, 16 patches each; LLaVA's one 56-pixel crop per image, OneVision's
# base crop of 4 patches per image of a multi-image sample: the last two tiny beside the decoder)
STEPS = [("qwen2.5-vl", "frozen", True, 1536), ("qwen2.5-vl", "lora", False, 1536), ("qwen2.5-vl", "full", True, 1536),
         ("qwen2-vl", "frozen", True, 1536), ("qwen3-vl", "frozen", False, 1120), ("gemma3-vision", "frozen", True, 8),
         ("smolvlm", "frozen", True, 1568), ("llava", "frozen", False, 32), ("llava-onevision", "frozen", True, 8)]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("family", "train", "checkpointing", "patches"), STEPS)
def test_an_image_step_is_predicted_per_phase(vl_checkpoint, family, train, checkpointing, patches):
    """Two images (448×336 and 336×448 at ≤ 256 tokens each) in one row, LoRA on the decoder, the tower frozen,
    with LoRA, or trained in full: static (both held batches' pixel values, the tower's adapter or its trainable
    copy, gradients and states), forward, backward and optimizer step within 1 % (measured: ≤ 0.6 %, Gemma-3's
    optimizer step; ≤ 0.3 % on the Qwen towers)."""
    from devkit.harness.estimator import phase_measurements
    from devkit.harness.vision import VisionPoint, run_point

    p = run_point(vl_checkpoint(family), VisionPoint(train, checkpointing, images=2, max_pixels=256 * 28 * 28))
    assert p.patches == patches  # 448×336 → 32×24 patches each at 14 px (Qwen3-VL: 28×20 at 16 px)
    measured = phase_measurements(p)
    for phase, m in measured.items():
        assert abs(p.predicted_phases[phase] / m - 1) <= 0.01, (phase, m, p.predicted_phases[phase])


@pytest.mark.parametrize("train", ["frozen", "lora", "full"])
def test_the_tower_trains_as_vision_train_says(qwen_vl, train):
    """LoRA: adapters on every tower linear (qkv, proj, gate/up/down, the merger's two), only they train there;
    full: peft's trainable copy of the tower (modules_to_save) beside the frozen original; frozen: nothing."""
    import torch

    from lowmem_ft.recipe.load import resolve
    from lowmem_ft.train.model import build_model

    recipe = resolve(None, {"model": {"name_or_path": qwen_vl, "quantization": "none"}, "vision": {"train": train}})
    model = build_model(recipe)
    tower = [(n, q) for n, q in model.named_parameters() if ".visual." in n]
    trained = {n for n, q in tower if q.requires_grad}
    linears = [n for n, m in model.named_modules() if ".visual." in n and isinstance(m, torch.nn.Linear)
               and "lora_" not in n and "modules_to_save" not in n and "original_module" not in n]  # fmt: skip
    if train == "frozen":
        assert not trained
    elif train == "lora":
        assert trained and all("lora_" in n for n in trained)
        adapted = [n for n in linears if n.endswith(".base_layer")]
        assert len(adapted) == len(load_architecture(qwen_vl).vision.linears) == 12
        assert len(trained) == 2 * len(adapted)
    else:
        assert trained and all("modules_to_save" in n for n in trained)
        copy = sum(q.numel() for n, q in tower if "modules_to_save" in n)
        assert copy == load_architecture(qwen_vl).vision.params


def test_the_plan_prices_the_pixel_values_and_the_tower():
    """Qwen2.5-VL-7B at the checkpoint's own cap (16,384 tokens = 65,536 patches per image): the batch's pixel
    values are the accumulation window's fp32 rows; the frozen tower's forward (46,530 B per patch: its rotary
    moment) is a moment of its own beside the input embeddings, and its outputs live on through the decoder. For this
    7B the decoder's moments stay the larger (1.76 GB over the text step's forward, 1.23 GB of it pixel values)."""
    from lowmem_ft.memory.tower import tower_moments

    arch = load_architecture("Qwen/Qwen2.5-VL-7B-Instruct")
    v = arch.vision
    assert v.frozen_working_set(1, 2) == 2 * 1176 + 8 * 80 + 16 + 2 + (10 + 24) * 1280
    text = Setup(quantization="nf4", max_seq_len=16640, gradient_accumulation=4)
    image = Setup(quantization="nf4", max_seq_len=16640, gradient_accumulation=4, image_patches=65536)
    with_images, without = estimate(arch, image), estimate(arch, text)
    pixels = with_images.by_name()[PIXELS]
    assert pixels == 4 * 65536 * 1176 * 4
    static = with_images.phases["static"]
    assert static - without.phases["static"] == pixels
    m = tower_moments(arch, image)
    assert m.working_set == 2 * arch.hidden_size * 16640 + v.frozen_working_set(65536, 2)
    assert with_images.phases["forward"] >= static + m.working_set
    grew = with_images.phases["forward"] - without.phases["forward"] - pixels - m.kept
    assert min(m.at_head, m.in_layers) <= grew <= max(m.at_head, m.in_layers)


def test_the_plan_reads_the_images_of_the_data(qwen_vl, vlm_data, capsys):
    """`plan --json` with image chats: the setup's patches are the data's most per sample (red + green: 12 tokens ×
    4), and the components name the pixel values."""
    import json

    from lowmem_ft.cli import main

    assert main(["plan", "--vram", "8", "--model", qwen_vl, "--data", str(vlm_data), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    estimate_ = plan.get("estimate", plan)
    assert estimate_["setup"]["image_patches"] == 48
    assert any(c["name"] == PIXELS for c in estimate_["components"])
    assert ", with " in plan["vision"]["why"] and ", micro batch " in plan["vision"]["why"]  # what the cap costs


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen3-vl", "gemma3-vision", "smolvlm", "llava", "llava-onevision"])
def test_every_family_plans_the_patches_of_its_data(vl_checkpoint, vlm_data, family, capsys):
    """`plan --json` with image chats on each other family: the setup's patches per sample are the data's most image
    tokens times the family's patches per token (Qwen merge² = 4; the tiny Gemma-3's 4 patches per crop pooled to 4
    tokens: 1), and the plan prices their pixel values and the tower. Gemma-3 without image data plans as text, and
    refuses a trained tower."""
    import json

    from lowmem_ft.cli import main
    from lowmem_ft.recipe.load import resolve
    from lowmem_ft.vision.setup import vision_of

    model = vl_checkpoint(family)
    assert main(["plan", "--vram", "8", "--model", model, "--data", str(vlm_data), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    est = plan.get("estimate", plan)
    tokens = plan["vision"]["data"]["image_tokens_per_sample"]["max"]
    images = vision_of(resolve(None, {"model": {"name_or_path": model}, "data": {"path": str(vlm_data)}})).images
    if family == "llava-onevision":  # every crop runs: an image alone is its grid and the base
        from PIL import Image

        sizes = [Image.open(vlm_data.parent / "img" / name).size for name in ("red.png", "green.jpg")]
        (wr, hr), (wg, hg) = sizes
        crops = max(images.crops(hr, wr), images.crops(hr, wr, 2) + images.crops(hg, wg, 2), images.crops(hg, wg))
        assert est["setup"]["image_patches"] == crops * images.side**2 > tokens
    else:
        assert est["setup"]["image_patches"] == tokens * images.patches_per_token > 0
    names = {c["name"] for c in est["components"]}
    assert PIXELS in names and "vision tower forward (frozen)" in names
    if family == "gemma3-vision":
        assert main(["plan", "--vram", "8", "--model", model, "--json"]) == 0
        text = json.loads(capsys.readouterr().out)
        assert text.get("estimate", text)["setup"]["image_patches"] == 0
        # a trained SigLIP tower is not priced: one line, exit 2
        argv = ["plan", "--vram", "8", "--model", model, "--data", str(vlm_data), "--set", "vision.train=lora"]
        assert main(argv) == 2
        assert "vision.train: lora is not priced for a SigLIP / CLIP tower" in capsys.readouterr().err


@pytest.mark.parametrize("train", ["lora", "full"])
def test_the_plan_prices_a_trained_tower(train, capsys):
    """`plan` for Qwen2.5-VL-7B with `vision.train`: LoRA adds the tower's adapters (r 16 on its 32 × 5 + 2
    linears) and their states; full trains 16-bit weights (the planner may not quantize the tower it trains) and
    counts peft's trainable copy of the tower."""
    import json

    from lowmem_ft.cli import main

    argv = ["plan", "--vram", "40", "--model", "Qwen/Qwen2.5-VL-7B-Instruct", "--json"]
    assert main([*argv, "--set", f"vision.train={train}"]) == 0
    plan = json.loads(capsys.readouterr().out)
    est = plan.get("estimate", plan)
    assert est["setup"]["vision_train"] == train
    names = {c["name"]: c["gb"] for c in est["components"]}
    assert main(argv) == 0
    other = json.loads(capsys.readouterr().out)
    frozen = {c["name"]: c["gb"] for c in other.get("estimate", other)["components"]}
    tower = load_architecture("Qwen/Qwen2.5-VL-7B-Instruct").vision
    if train == "full":
        assert est["setup"]["quantization"] == "none"
        assert names["vision tower, trainable copy"] == round(2 * tower.params / 1e9, 4)
    else:
        lora = sum(n for n, _ in tower.trainable("lora", est["setup"]["lora_r"], 2))
        assert lora == est["setup"]["lora_r"] * sum(lin.in_features + lin.out_features for lin in tower.linears)
        grown = names["LoRA parameters (fp32)"] - frozen["LoRA parameters (fp32)"]
        assert grown == pytest.approx(4 * lora / 1e9, abs=2e-4)
        assert "vision tower, trainable copy" not in names
