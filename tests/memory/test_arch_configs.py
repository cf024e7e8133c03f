"""config.json files as checkpoints ship them: keys left to the config class's defaults, null values, nested text
configs of multimodal checkpoints, layer-wise widths. Each is counted against the model transformers builds from
the same dict (what lowmem-ft's loader, AutoModelForCausalLM, would load)."""

from __future__ import annotations

import json

import pytest

from lowmem_ft.errors import UserError
from lowmem_ft.memory.arch import (
    CHECKED_LLAMA_SHAPED,
    NON_LLAMA_BLOCKS,
    NOT_CAUSAL_LM,
    Architecture,
    load_architecture,
    unchecked_family,
)
from lowmem_ft.vision.families import VISION_FAMILIES

SMALL = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip


def _built(config: dict):
    """(transformers config, model on the meta device) built from `config` as AutoModelForCausalLM loads it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**json.loads(json.dumps(config)))
    with torch.device("meta"):
        return cfg, AutoModelForCausalLM.from_config(cfg)


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied weight once


def _full_fine_tune_tensors(arch: Architecture, model) -> None:
    """A full fine-tune's trainable tensors (gradients and optimizer states are sized from them) are the model's
    parameters the text forward uses, tensor by tensor."""
    from lowmem_ft.memory.estimate import Setup, _trainable_tensors

    ours = sorted(n for n, _ in _trainable_tensors(arch, Setup(adapter="full", quantization="none")))
    assert ours == sorted(p.numel() for p in model.parameters())


def _layer0(model):
    return next(m for name, m in model.named_modules() if name.endswith("layers.0"))


def _layer_norms(layer) -> int:
    """Norm modules of a decoder layer outside its attention (q/k norms are counted apart)."""
    return sum(
        "norm" in type(m).__name__.lower() and not name.startswith("self_attn")
        for name, m in layer.named_modules()
        if name
    )


# -- Cohere / Cohere2: one LayerNorm (weight, no bias) per layer, parallel attention and MLP -----------------------
# CohereForAI/c4ai-command-r-v01 (logit_scale and tie left to the class: 0.0625, tied), c4ai-command-r-plus
# (use_qk_norm: per-head q/k LayerNorms, untied), c4ai-command-r7b-12-2024 (cohere2: sliding_window_pattern 4).
COHERE = {
    "command-r": {**SMALL, "model_type": "cohere", "layer_norm_eps": 1e-05},
    "command-r-plus": {**SMALL, "model_type": "cohere", "use_qk_norm": True, "tie_word_embeddings": False,
                       "logit_scale": 0.8333333333333334},
    "command-r7b": {**SMALL, "model_type": "cohere2", "num_hidden_layers": 8, "sliding_window": 4096,
                    "sliding_window_pattern": 4, "logit_scale": 0.25},
    "cohere2-defaults": {**SMALL, "model_type": "cohere2", "num_hidden_layers": 6},
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(COHERE))
def test_cohere_counts_one_layernorm_per_layer(kind):
    """Counted as two RMSNorms per layer, Cohere was h parameters per layer too many, and the activation terms
    (`estimate._norm_bytes`, per `norms_per_layer`) kept a second norm's tensors the parallel block does not have."""
    config = COHERE[kind]
    arch = Architecture.from_config(config)
    cfg, model = _built(config)
    assert arch.total_params == _count(model)
    assert arch.norms_per_layer == _layer_norms(_layer0(model)) == 1
    assert arch.norm == "layer_no_bias" and arch.final_norm_params == config["hidden_size"]
    assert arch.norm_fp32_output  # CohereLayerNorm keeps its normalized input in fp32 for the weight's gradient
    assert arch.logit_scale == cfg.logit_scale  # 0.0625 when config.json does not say
    _full_fine_tune_tensors(arch, model)
    types = getattr(cfg, "layer_types", None) or []
    assert arch.sliding_layers == sum(t == "sliding_attention" for t in types)
    if types:
        assert arch.sliding_window == cfg.sliding_window


# -- Apertus: xIELU's two learnable scalars per layer ---------------------------------------------------------------
@pytest.mark.parametrize("act", [None, "xielu", "relu2"])
def test_apertus_counts_the_xielu_scalars(act):
    """swiss-ai/Apertus-8B ships hidden_act "xielu" (also the class default): alpha_p and alpha_n per MLP."""
    config = {**SMALL, "model_type": "apertus", **({"hidden_act": act} if act else {})}
    arch = Architecture.from_config(config)
    _, model = _built(config)
    assert arch.total_params == _count(model)
    assert arch.block_extra_params == (0 if act == "relu2" else 2)
    _full_fine_tune_tensors(arch, model)


# -- head_dim: missing is the config class's default, null is hidden / heads ---------------------------------------
HEAD_DIM = {
    # mistralai/Mistral-Nemo-Base-2407: hidden 5120, 32 heads, head_dim 128 (not 160)
    "mistral-nemo": ({**SMALL, "model_type": "mistral", "hidden_size": 160, "head_dim": 32}, 32),
    "qwen3-missing": ({**SMALL, "model_type": "qwen3"}, 128),  # configuration_qwen3.py head_dim = 128
    "gemma-missing": ({**SMALL, "model_type": "gemma"}, 256),  # every Gemma: 256
    "gemma2-missing": ({**SMALL, "model_type": "gemma2"}, 256),
    "glm4-missing": ({**SMALL, "model_type": "glm4", "pad_token_id": 0}, 128),
    "ernie4_5-missing": ({**SMALL, "model_type": "ernie4_5"}, 128),
    "llama-missing": ({**SMALL, "model_type": "llama"}, 16),
    "llama-null": ({**SMALL, "model_type": "llama", "head_dim": None}, 16),
    "mistral-null": ({**SMALL, "model_type": "mistral", "head_dim": None}, 16),
    "ernie4_5-null": ({**SMALL, "model_type": "ernie4_5", "head_dim": None}, 16),
    "cohere2-set": ({**SMALL, "model_type": "cohere2", "head_dim": 32}, 32),
}


@pytest.mark.parametrize("kind", sorted(HEAD_DIM))
def test_head_dim_as_transformers_reads_it(kind):
    config, head_dim = HEAD_DIM[kind]
    arch = Architecture.from_config(config)
    _, model = _built(config)
    q_proj = _layer0(model).self_attn.q_proj
    assert arch.head_dim == q_proj.out_features // config["num_attention_heads"] == head_dim
    assert arch.total_params == _count(model)


# -- multimodal checkpoints -----------------------------------------------------------------------------------------
# google/gemma-3-4b-it's config.json at a tiny size: a text_config of a few keys (the rest are Gemma3TextConfig's
# defaults), a SigLIP vision_config, tie_word_embeddings only at the top (default true).
TEXT = {"hidden_size": 64, "intermediate_size": 128, "model_type": "gemma3_text", "num_hidden_layers": 7,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 300, "sliding_window": 16}  # fmt: skip
VISION = {"hidden_size": 32, "image_size": 28, "intermediate_size": 64, "model_type": "siglip_vision_model",
          "num_attention_heads": 2, "num_hidden_layers": 2, "patch_size": 14, "vision_use_head": False}  # fmt: skip
GEMMA3 = {
    "as-shipped": {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
                   "mm_tokens_per_image": 4, "text_config": TEXT, "vision_config": VISION},
    "vision-head": {"model_type": "gemma3", "mm_tokens_per_image": 4, "text_config": TEXT,
                    "vision_config": {**VISION, "vision_use_head": True}},
    "untied-at-top": {"model_type": "gemma3", "mm_tokens_per_image": 4, "tie_word_embeddings": False,
                      "text_config": {**TEXT, "tie_word_embeddings": True}, "vision_config": VISION},
    "text-defaults": {"model_type": "gemma3", "mm_tokens_per_image": 4,
                      "text_config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2},
                      "vision_config": VISION},
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(GEMMA3))
def test_gemma3_multimodal_counts_what_is_loaded(kind):
    """AutoModelForCausalLM on a gemma3 config builds Gemma3ForConditionalGeneration: the text model, the SigLIP
    tower and the projector are all loaded. Before, a config.json whose text_config left vocab_size and the heads
    to the class was refused, and the tower's weights (420 M of gemma-3-4b's 4.30 B) were never counted."""
    config = GEMMA3[kind]
    arch = Architecture.from_config(config)
    cfg, model = _built(config)
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    assert arch.total_params == _count(model)
    tower = sum(p.numel() for n, p in model.named_parameters() if "vision_tower" in n or "multi_modal" in n)
    assert arch.tower_params == tower
    text = cfg.get_text_config()
    assert arch.sliding_layers == sum(t == "sliding_attention" for t in text.layer_types)
    assert arch.sliding_window == text.sliding_window and arch.head_dim == text.head_dim
    import torch

    tower_linears = [m for n, m in model.named_modules() if "vision_tower" in n and isinstance(m, torch.nn.Linear)]
    assert sorted((m.in_features, m.out_features) for m in tower_linears) == sorted(
        (lin.in_features, lin.out_features) for lin in arch.tower_linears
    )


def test_gemma3_multimodal_directory_and_nf4_weights(tmp_path):
    """A saved Gemma3ForConditionalGeneration: planned from its directory, no layout warning (the vision tower's
    layers are not the decoder's), and its NF4 weights as bitsandbytes stores them: every nn.Linear but the LM head
    is 4-bit, the vision tower's included, so the 16-bit rest is exactly the other parameters."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    from lowmem_ft.memory.estimate import DTYPE_BYTES, Setup, weight_bytes
    from lowmem_ft.memory.layout import layout_mismatch

    config = GEMMA3["as-shipped"]
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    model.save_pretrained(tmp_path)
    arch = load_architecture(str(tmp_path))
    assert arch.total_params == _count(model) and layout_mismatch(arch, tmp_path) is None

    quantized = AutoModelForCausalLM.from_pretrained(
        tmp_path,
        dtype=torch.bfloat16,
        quantization_config=BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
        ),
    )
    four_bit = {id(p) for m in quantized.modules() if type(m).__name__ == "Linear4bit" for p in [m.weight]}
    rest = sum(p.numel() for p in quantized.parameters() if id(p) not in four_bit)
    setup = Setup(quantization="nf4", compute_dtype="bfloat16")
    _, w_rest, _ = weight_bytes(arch, setup)
    assert w_rest == rest * DTYPE_BYTES["bfloat16"]


def test_llama4_plans_the_text_model_it_loads():
    """AutoModelForCausalLM on a llama4 config builds Llama4ForCausalLM (the text model alone): its mixture of
    experts is read from text_config, which the planner refuses with --vram (`choosing._check_plannable`)."""
    config = {"model_type": "llama4", "text_config": {**SMALL, "model_type": "llama4_text", "num_local_experts": 4}}
    _, model = _built(config)
    assert type(model).__name__ == "Llama4ForCausalLM"
    assert Architecture.from_config(config).experts == 4


@pytest.mark.parametrize("model_type", sorted(t for t in NOT_CAUSAL_LM if t not in VISION_FAMILIES))
def test_vision_language_checkpoints_the_loader_cannot_load_are_refused(model_type):
    """Mistral-Small-3.1 (mistral3), Qwen2.5-VL, Qwen3-VL, LLaVA, ...: AutoModelForCausalLM has no class for them in
    transformers 5.24, so a plan would be for a model `train` cannot load. One line naming why."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with pytest.raises(ValueError, match="Unrecognized configuration class"):
        AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type))
    config = {"model_type": model_type, "text_config": {**SMALL, "model_type": "mistral"}}
    with pytest.raises(UserError, match=f"'{model_type}' is a vision-language checkpoint.*text-only checkpoint"):
        Architecture.from_config(config)


def test_vision_language_config_with_top_level_text_fields_counts_its_tower():
    """Qwen2.5-VL-7B-Instruct's config.json keeps hidden_size & co. at its top: it was read as a Llama-shaped
    qwen2_5_vl, its vision tower uncounted; now the decoder is read from the top and the tower from vision_config
    (trained on images by lowmem_ft.vision; every count checked in tests/memory/test_vision.py)."""
    config = {**SMALL, "model_type": "qwen2_5_vl", "vision_config": {"depth": 2, "hidden_size": 64,
              "intermediate_size": 128, "num_heads": 2, "out_hidden_size": SMALL["hidden_size"]}}  # fmt: skip
    arch = Architecture.from_config(config)
    assert arch.model_type == "qwen2_5_vl_text" and arch.vision is not None
    assert arch.tower_params == arch.vision.params > 0


@pytest.mark.parametrize("wrapper", ["mllama", "gemma3n", "some_new_vlm"])
def test_other_multimodal_wrappers_are_refused(wrapper):
    """Llama-3.2-Vision's text model interleaves cross-attention layers; it was read as a plain Llama."""
    config = {"model_type": wrapper, "text_config": {**SMALL, "model_type": "llama"}}
    with pytest.raises(UserError, match=f"'{wrapper}' is a multimodal checkpoint lowmem-ft cannot plan"):
        Architecture.from_config(config)


# -- other config.json quirks ----------------------------------------------------------------------------------------
def test_layer_wise_widths_are_refused_in_one_line():
    config = {**SMALL, "model_type": "llama", "intermediate_size": [128, 256]}  # OpenELM-style
    with pytest.raises(UserError, match="intermediate_size per layer"):
        Architecture.from_config(config)


def test_transformers_5_config_keys():
    """A config.json written by transformers 5 (`dtype`, `rope_parameters`, no num_key_value_heads), counted as a
    transformers 4 one."""
    config = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 192,
              "num_hidden_layers": 2, "num_attention_heads": 4, "dtype": "bfloat16",
              "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 8192}}  # fmt: skip
    arch = Architecture.from_config(config)
    _, model = _built(config)
    assert arch.num_kv_heads == 4 and arch.total_params == _count(model)


SLIDING = {
    "mistral-missing": {**SMALL, "model_type": "mistral"},  # configuration_mistral.py: sliding_window = 4096
    "mistral-null": {**SMALL, "model_type": "mistral", "sliding_window": None},  # Mistral-7B-v0.3
    # Ministral-8B-Instruct-2410 as a mistral config with layer_types: MistralModel slides every layer regardless
    "mistral-layer-types": {**SMALL, "model_type": "mistral", "sliding_window": 32,
                            "layer_types": ["full_attention", "sliding_attention"]},
    "qwen3-layer-types": {**SMALL, "model_type": "qwen3", "num_hidden_layers": 4, "use_sliding_window": True,
                          "sliding_window": 64, "layer_types": ["full_attention", "sliding_attention"] * 2},
    "qwen3-off": {**SMALL, "model_type": "qwen3", "use_sliding_window": False, "sliding_window": 64,
                  "layer_types": ["sliding_attention"] * 2},
    "gemma2-missing": {**SMALL, "model_type": "gemma2", "num_hidden_layers": 5},
    "gemma3-layer-types": {**SMALL, "model_type": "gemma3_text", "num_hidden_layers": 4, "sliding_window": 32,
                           "layer_types": ["sliding_attention", "full_attention"] * 2},
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(SLIDING))
def test_sliding_layers_as_transformers_reads_them(kind):
    config = SLIDING[kind]
    arch = Architecture.from_config(config)
    cfg, model = _built(config)
    window = cfg.sliding_window
    types = getattr(cfg, "layer_types", None) if config["model_type"] != "mistral" else None  # modeling_mistral.py
    layers = (
        sum(t == "sliding_attention" for t in types) if types and window else (cfg.num_hidden_layers if window else 0)
    )
    assert (arch.sliding_window, arch.sliding_layers) == (window, layers)
    assert arch.total_params == _count(model)
    if config["model_type"] == "gemma2":
        assert (arch.attn_logit_softcapping, arch.final_logit_softcapping) == (50.0, 30.0)


# ---- every family the block reader describes exactly, from its own config class ----------------------------------


@pytest.mark.parametrize("model_type", sorted(CHECKED_LLAMA_SHAPED | set(NON_LLAMA_BLOCKS)))
def test_every_checked_family_counts_what_transformers_builds(model_type):
    """Each model_type that plans without the unchecked-family warning, built from its config class's defaults at a
    small size (its own biases, norms, q/k norms, fused projections, tie default), has exactly transformers' count,
    and full fine-tuning trains as many parameters."""
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(model_type).to_dict()
    config = {k: v for k, v in SMALL.items() if k in defaults}
    config.update(model_type=model_type, pad_token_id=0)
    if defaults.get("layer_types"):  # per-layer kinds: as many as layers
        config["layer_types"] = list(defaults["layer_types"][: SMALL["num_hidden_layers"]])
    if defaults.get("head_dim"):  # a head_dim ≠ hidden / heads, as the families that default to one ship it
        config["head_dim"] = 32
    if model_type == "helium":  # its o_proj is hidden → hidden whatever head_dim is: real ones keep heads · head_dim
        config["head_dim"] = SMALL["hidden_size"] // SMALL["num_attention_heads"]  # = hidden (Helium-2B: 20 × 128)
    if model_type == "falcon":  # Falcon names its MLP width ffn_hidden_size
        config["ffn_hidden_size"] = SMALL["intermediate_size"]
    cfg, model = _built(config)
    arch = Architecture.from_config(cfg.to_dict())
    assert arch.total_params == _count(model)
    assert unchecked_family(arch) is None
    from lowmem_ft.memory.estimate import Setup, _trainable_tensors

    full = Setup(adapter="full", quantization="none")  # LayerNorm weight + bias may be one entry there: sums compared
    assert sum(n for n, _ in _trainable_tensors(arch, full)) == _count(model)


def test_an_unchecked_family_plans_with_a_warning_naming_it(tmp_path, caplog):
    """OLMo (parameter-free LayerNorms) and LFM2 (convolution layers) are not Llama's block: read as one, they plan
    with a warning that says so, once; a checked family plans without it."""
    for model_type in ("olmo", "lfm2", "olmo2"):
        directory = tmp_path / model_type
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps({**SMALL, "model_type": model_type}))
        caplog.clear()
        with caplog.at_level("WARNING"):
            load_architecture(str(directory))
        said = [r.getMessage() for r in caplog.records if "not a family lowmem-ft has checked" in r.getMessage()]
        assert len(said) == (0 if model_type == "olmo2" else 1), said
        if said:
            assert f"model_type '{model_type}'" in said[0] and "q_proj" in said[0]


def test_a_config_without_model_type_is_named_so_in_the_warning(tmp_path, caplog):
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in SMALL.items() if k != "model_type"}))
    with caplog.at_level("WARNING"):
        load_architecture(str(tmp_path))
    said = [r.getMessage() for r in caplog.records if "not a family lowmem-ft has checked" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("a config.json without model_type is not a family"), said
