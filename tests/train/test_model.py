"""Lean QLoRA preparation and activation offloading, through the build path every command uses."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from devkit.zoo import NAMES as ZOO_NAMES
from lowmem_ft.errors import ConfigError
from lowmem_ft.recipe.load import resolve
from lowmem_ft.train.model import build_model, load_model, prepare_for_training


def _recipe(tiny_model, **memory):
    return resolve("8gb", {"model": {"name_or_path": tiny_model}, "adapter": {"dropout": 0.0}, "memory": memory})


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_lean_qlora_keeps_16bit_base_and_fp32_adapters_only(tiny_model):
    model = build_model(_recipe(tiny_model))
    base = model.get_base_model()
    for module in (base.get_input_embeddings(), base.get_output_embeddings()):
        assert module.weight.dtype == torch.bfloat16 and not module.weight.requires_grad
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n and p.dtype == torch.float32 for n, p in trainable.items())
    frozen_float = [p for n, p in model.named_parameters() if "lora_" not in n and p.dtype.is_floating_point]
    assert all(p.dtype == torch.bfloat16 for p in frozen_float)  # norms too: no fp32 upcast anywhere in the base
    assert any(type(p).__name__ == "Params4bit" for p in model.parameters())  # the layers really are NF4
    # checkpointed layers get inputs that require grad (frozen embeddings would give them none)
    ids = torch.randint(0, 500, (1, 8))
    assert base.get_input_embeddings()(ids).requires_grad
    assert base.is_activation_checkpointing


def test_lean_preparation_saves_the_fp32_upcast_peft_would_do(tiny_model):
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    recipe = _recipe(tiny_model)
    ours = _param_bytes(build_model(recipe))
    a = recipe.adapter
    peft_model = get_peft_model(
        prepare_model_for_kbit_training(load_model(recipe), use_gradient_checkpointing=True),
        LoraConfig(r=a.r, lora_alpha=a.alpha, target_modules=list(a.target_modules), task_type="CAUSAL_LM"),
    )
    theirs = _param_bytes(peft_model)
    # peft casts every non-4-bit 16-bit parameter (embeddings, lm_head, norms) to fp32: 2 more bytes each
    sixteen_bit = sum(
        p.numel() for n, p in peft_model.named_parameters() if "lora_" not in n and p.dtype == torch.float32
    )
    assert sixteen_bit > 0
    assert theirs - ours == 2 * sixteen_bit


def test_offloading_needs_checkpointing():
    with pytest.raises(ConfigError, match="activation_offloading"):
        resolve("8gb", {"memory": {"activation_offloading": True, "gradient_checkpointing": False}})


class _Recording(torch.autograd.graph.saved_tensors_hooks):
    """Stands in for torch's save_on_cpu (which pins memory, impossible without an accelerator) and records
    what it is handed: the tensors the offload moves to host memory."""

    packed: list[torch.Tensor] = []

    def __init__(self, pin_memory: bool = False, device_type: str = "cuda"):
        super().__init__(self._pack, lambda saved: saved)

    @classmethod
    def _pack(cls, tensor):
        cls.packed.append(tensor)
        return tensor.detach().clone()


def _step(model, ids):
    model.train()  # from_pretrained returns eval mode, where layers are not checkpointed
    torch.manual_seed(0)
    model(input_ids=ids, labels=ids).loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.requires_grad]


def test_offloading_moves_exactly_the_checkpointed_layer_inputs(tiny_model, monkeypatch):
    import transformers.modeling_utils

    ids = torch.randint(0, 500, (2, 32))
    torch.manual_seed(0)  # the same LoRA initialisation in both builds
    plain = _step(build_model(_recipe(tiny_model)), ids)

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(transformers.modeling_utils, "save_on_cpu", _Recording)
    _Recording.packed = []
    torch.manual_seed(0)
    model = build_model(_recipe(tiny_model, activation_offloading=True))
    offloaded = _step(model, ids)

    config = model.config
    # what the memory model assumes: one (batch, seq, hidden) 16-bit tensor per layer leaves the device
    assert [tuple(t.shape) for t in _Recording.packed] == [(2, 32, config.hidden_size)] * config.num_hidden_layers
    assert all(t.dtype == torch.bfloat16 for t in _Recording.packed)
    for a, b in zip(plain, offloaded, strict=True):
        torch.testing.assert_close(a, b)


def test_offloading_without_an_accelerator_is_skipped_with_a_warning(tiny_model, caplog):
    if torch.accelerator.is_available():
        pytest.skip("an accelerator is present")
    with caplog.at_level(logging.WARNING, logger="lowmem_ft.train.model"):
        model = build_model(_recipe(tiny_model, activation_offloading=True))
    assert "activation_offloading" in caplog.text
    ids = torch.randint(0, 500, (1, 16))
    assert all(g.abs().sum() > 0 for g in _step(model, ids)[1::2])  # lora_B gradients flow


@pytest.mark.requires_cuda
def test_offloading_frees_device_memory_of_layer_inputs(tmp_path):
    from devkit.tiny import build_tiny_model
    from lowmem_ft.train.measure.peak import PeakMemory

    path = str(build_tiny_model(tmp_path / "m", hidden_size=512, intermediate_size=1024, num_hidden_layers=8))
    b, s = 1, 2048
    ids = torch.randint(0, 500, (b, s), device="cuda")
    peaks = {}
    for offload in (False, True):
        model = build_model(_recipe(path, activation_offloading=offload))
        model.train()
        with PeakMemory(device="cuda") as pm:
            start = pm.live_bytes
            model(input_ids=ids, labels=ids).loss.backward()
        peaks[offload] = pm.peak_bytes - start
        del model
    layer_inputs = 8 * b * s * 512 * 2  # bf16 hidden states, one per checkpointed layer
    assert peaks[False] - peaks[True] >= 0.8 * layer_inputs, peaks


# -- attention fallback and load errors ---------------------------------------------------------------------------
def test_family_without_sdpa_falls_back_to_eager_and_says_so(zoo_models, caplog):
    """Gemma-2's softcapped attention has no SDPA path: the recipes' default sdpa loads as eager, with one line."""
    recipe = resolve("8gb", {"model": {"name_or_path": zoo_models["gemma2"], "quantization": "none"}})
    with caplog.at_level(logging.WARNING, logger="lowmem_ft.train.model"):
        model = load_model(recipe)
    assert model.config._attn_implementation == "eager"
    assert any("softcapping" in r.message and "eager" in r.message for r in caplog.records)
    sdpa = load_model(resolve("8gb", {"model": {"name_or_path": zoo_models["gemma3"], "quantization": "none"}}))
    assert sdpa.config._attn_implementation == "sdpa"  # families that support it keep it


def test_multimodal_gemma3_with_flash_attention_loads_with_sdpa_and_says_so(zoo_models, caplog):
    """Gemma3ForConditionalGeneration refuses flash attention (transformers raised "does not support Flash
    Attention 2 yet", a load failure): it loads with SDPA, with one line, and the plan plans SDPA."""
    from lowmem_ft.memory.arch import load_architecture

    path = zoo_models["gemma3-vision"]
    model_section = {"name_or_path": path, "quantization": "none", "attn_implementation": "flash_attention_2"}
    with caplog.at_level(logging.WARNING, logger="lowmem_ft.train.model"):
        model = load_model(resolve("8gb", {"model": model_section}))
    assert model.config._attn_implementation == "sdpa"
    assert any("_supports_flash_attn" in r.message and "using sdpa" in r.message for r in caplog.records)
    assert load_architecture(path).attention_for("flash_attention_2")[0] == "sdpa"
    assert load_architecture(zoo_models["gemma3"]).attention_for("flash_attention_2") == ("flash_attention_2", None)


def _broken(tmp_path, zoo_models, case: str) -> str:
    import json
    import shutil

    path = tmp_path / case
    path.mkdir()
    if case == "empty":
        return str(path)
    source = zoo_models["llama3"]
    config = json.loads((Path(source) / "config.json").read_text())
    if case == "unknown_type":
        config["model_type"] = "notamodel"
    (path / "config.json").write_text(json.dumps(config))
    if case == "corrupt":
        (path / "model.safetensors").write_bytes(b"not safetensors")
    if case == "ok_tokenizer_only":
        shutil.copy(Path(source) / "tokenizer.json", path)
    return str(path)


@pytest.mark.parametrize(
    "case, message",
    [
        ("empty", r"model directory .*/empty has no config.json"),
        ("ok_tokenizer_only", r"has a config.json but no weights \(\*.safetensors or \*.bin\)"),
        ("unknown_type", r"transformers does not know its model_type .*notamodel.*--trust-remote-code"),
        ("corrupt", r"model .*/corrupt did not load \(SafetensorError: .*header"),
    ],
)
def test_load_errors_name_the_real_cause(tmp_path, zoo_models, case, message):
    from lowmem_ft.errors import UserError

    recipe = resolve("8gb", {"model": {"name_or_path": _broken(tmp_path, zoo_models, case), "quantization": "none"}})
    with pytest.raises(UserError, match=message) as info:
        load_model(recipe)
    assert "\n" not in str(info.value) and "hub id" not in str(info.value)  # the path is not blamed for the model


@pytest.mark.parametrize("targets", [None, ["all-linear"]])
@pytest.mark.parametrize("family", ZOO_NAMES)
def test_lora_the_plan_counts_is_the_lora_peft_builds(zoo_models, family, targets):
    """The plan's trainable LoRA parameters are what peft creates on the loaded model, every family, the recipes'
    names and all-linear; on Gemma-3's multimodal checkpoint only the language model is adapted (its SigLIP tower's
    q/k/v_proj, out_proj, fc1/fc2 match those names too)."""
    from lowmem_ft.choosing import setup_from_recipe
    from lowmem_ft.memory.arch import load_architecture
    from lowmem_ft.memory.estimate import _trainable_tensors
    from lowmem_ft.train.model import attach_adapter

    adapter = {"target_modules": targets} if targets else {}
    recipe = resolve("8gb", {"model": {"name_or_path": zoo_models[family], "quantization": "none"}, "adapter": adapter})
    model = attach_adapter(prepare_for_training(load_model(recipe), recipe), recipe)
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    planned = sum(n for n, _ in _trainable_tensors(load_architecture(zoo_models[family]), setup_from_recipe(recipe)))
    assert sum(trainable.values()) == planned
    decoder = next(n for n, m in model.get_base_model().named_modules() if m is model.get_base_model().get_decoder())
    assert trainable and all(f".{decoder}." in n for n in trainable), [n for n in trainable if decoder not in n][:3]
    if family == "gemma3-vision":
        assert decoder == "model.language_model"
        assert model.peft_config["default"].exclude_modules  # saved, so loading and merging skip the tower too


def test_full_fine_tuning_leaves_a_vision_tower_frozen(zoo_models):
    """Text never runs Gemma-3's vision tower: its weights get no gradient, so they are not trainable (the plan's
    full fine-tune counts the language model's weights)."""
    recipe = resolve(
        "8gb",
        {"model": {"name_or_path": zoo_models["gemma3-vision"], "quantization": "none"}, "adapter": {"kind": "full"}},
    )
    model = prepare_for_training(load_model(recipe), recipe)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any(".language_model." in n for n in trainable)
    assert not [n for n in trainable if "vision_tower" in n or "multi_modal_projector" in n]


def test_targets_only_the_vision_tower_has_are_refused_in_one_line(zoo_models):
    from lowmem_ft.errors import UserError
    from lowmem_ft.train.model import attach_adapter

    path = zoo_models["gemma3-vision"]
    recipe = resolve(
        "8gb", {"model": {"name_or_path": path, "quantization": "none"}, "adapter": {"target_modules": ["fc1"]}}
    )
    with pytest.raises(UserError, match=r"\['fc1'\] match no module of its language model \(not model.vision_tower"):
        attach_adapter(prepare_for_training(load_model(recipe), recipe), recipe)
