"""Parameter counts from the architecture description against real transformers models and published totals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from devkit.zoo import ESTIMATOR_SHAPES, estimator_config
from devkit.zoo import NAMES as ZOO_NAMES
from lowmem_ft.errors import UserError
from lowmem_ft.memory.arch import Architecture, catalog, load_architecture, native_config


def _transformers_count(config: dict) -> int:
    """Parameters of the transformers model built from `config` on the meta device (no memory, exact shapes)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from lowmem_ft.vision.families import VISION_FAMILIES

    cfg = AutoConfig.for_model(**config)
    auto = AutoModelForImageTextToText if config["model_type"] in VISION_FAMILIES else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(cfg)
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied weight once


SMALL = {
    "qwen2": {
        "model_type": "qwen2",
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
    },
    "qwen2-tied": {
        "model_type": "qwen2",
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "num_key_value_heads": 1,
        "tie_word_embeddings": True,
    },
    "llama": {
        "model_type": "llama",
        "vocab_size": 777,
        "hidden_size": 96,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 6,
        "num_key_value_heads": 3,
        "attention_bias": True,
    },
    "gemma2": {
        "model_type": "gemma2",
        "vocab_size": 500,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
    },
    "phi3": {
        "model_type": "phi3",
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "pad_token_id": 0,
    },
    "mistral": {
        "model_type": "mistral",
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
    },
}


@pytest.mark.parametrize("kind", sorted(SMALL))
def test_small_configs_match_transformers(kind):
    config = SMALL[kind]
    assert Architecture.from_config(config).total_params == _transformers_count(config)


@pytest.mark.parametrize("name", sorted(catalog()))
def test_catalog_matches_transformers_exactly(name):
    """Full-size catalog configs built on the meta device: same count as our arithmetic (Qwen v1 as the native
    Qwen2 it loads as: `lowmem_ft.native`)."""
    config = native_config(catalog()[name]["config"], name)
    assert load_architecture(name).total_params == _transformers_count(config)


@pytest.mark.parametrize("name", sorted(n for n in catalog() if "published_params" in catalog()[n]))
def test_catalog_matches_published_totals(name):
    published = catalog()[name]["published_params"]
    assert load_architecture(name).total_params == pytest.approx(published, rel=1e-4)


def test_qwen_v1_plans_as_the_native_qwen2():
    arch = load_architecture("Qwen/Qwen-7B-Chat")  # the chat variant maps to the base entry
    assert not arch.remote_code and arch.model_type == "qwen2"
    assert arch.linear_names == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert arch.intermediate_size == 11008  # w1 and w2 are each half of the config's 22016


def test_local_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMALL["llama"]))
    arch = load_architecture(str(tmp_path))
    assert arch.num_kv_heads == 3 and arch.head_dim == 16


def test_unknown_model_offline_is_a_user_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="offline catalog"):
        load_architecture("nobody/no-such-model")


def test_directory_without_config(tmp_path):
    with pytest.raises(UserError, match="no config.json"):
        load_architecture(str(tmp_path))


# -- the zoo: every family's quirks, as saved by transformers ------------------------------------------------------
@pytest.mark.parametrize("family", ZOO_NAMES)
def test_zoo_models_match_transformers(zoo_models, family):
    """Tied/untied, qkv bias, q/k norms, fused projections, head_dim ≠ hidden/heads, 4 norms per layer, padded
    vocabularies: the arithmetic counts what transformers builds from each saved config.json."""
    config = native_config(json.loads((Path(zoo_models[family]) / "config.json").read_text()))  # qwen-v1: Qwen2
    assert load_architecture(zoo_models[family]).total_params == _transformers_count(config)


@pytest.mark.parametrize("family", sorted(ESTIMATOR_SHAPES))
def test_zoo_estimator_shapes_match_transformers(family):
    config = estimator_config(family)
    assert Architecture.from_config(config).total_params == _transformers_count(config)


def test_family_quirks_the_training_path_reads():
    gemma2 = Architecture.from_config(estimator_config("gemma2"))
    assert gemma2.attention_for("sdpa")[0] == "eager" and "softcapping" in gemma2.attention_for("sdpa")[1]
    assert gemma2.attention_for("flash_attention_2") == ("flash_attention_2", None)
    assert gemma2.final_logit_softcapping == 30.0 and gemma2.chunked_loss_exact
    granite = Architecture.from_config(estimator_config("granite"))
    assert granite.logit_scale == 1 / 16 and granite.attention_for("sdpa") == ("sdpa", None)
    phi3 = Architecture.from_config(estimator_config("phi3"))
    assert phi3.linear_names == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    llama_style = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert phi3.adapter_modules(llama_style) == phi3.linear_names  # the recipes' list adapts the fused projections
    assert phi3.adapter_modules(["q_proj", "down_proj"]) == ["qkv_proj", "down_proj"]
    olmo = Architecture.from_config({**SMALL["llama"], "model_type": "olmo2"})
    assert not olmo.chunked_loss_exact and "olmo2" in olmo.chunked_loss_refusal


def test_mixture_of_experts_is_read_from_each_familys_key():
    """`Architecture.experts`: the planner does not tile an MoE MLP (memory.tiled_mlp refuses it)."""
    from lowmem_ft.memory.arch import Architecture

    dense = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "intermediate_size": 128}  # fmt: skip
    assert Architecture.from_config(dense).experts == 0
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):  # Mixtral, Qwen2-MoE, DeepSeek
        assert Architecture.from_config({**dense, key: 8}).experts == 8
    assert Architecture.from_config({**dense, "num_experts": None, "num_local_experts": True}).experts == 0


# Families outside the zoo whose decoder blocks are not Llama-shaped, as their config.json files ship (only the keys
# the published files set: the family's own defaults — biases, tied embeddings, ffn width — must be read as
# transformers reads them). EleutherAI/pythia-*, tiiuae/falcon-7b (multi-query, parallel attention), falcon-40b
# (new decoder architecture), microsoft/phi-2, bigcode/starcoder2-3b, THUDM/glm-4-9b, arcee-ai/AFM-4.5B,
# nvidia/Minitron-8B (nemotron).
OUTSIDERS = {
    "gpt_neox": {"model_type": "gpt_neox", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 256,
                 "num_hidden_layers": 2, "num_attention_heads": 4},
    "falcon-7b": {"model_type": "falcon", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "multi_query": True, "parallel_attn": True},
    "falcon-rw": {"model_type": "falcon", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "multi_query": False, "parallel_attn": False, "bias": True},
    "falcon-40b": {"model_type": "falcon", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_kv_heads": 2, "new_decoder_architecture": True},
    "glm-4": {"model_type": "glm4", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 256,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "pad_token_id": 0},
    "glm": {"model_type": "glm", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 256,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "pad_token_id": 0},
    "arcee": {"model_type": "arcee", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 256,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
    "nemotron": {"model_type": "nemotron", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 256,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
    "phi-2": {"model_type": "phi", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 256,
              "num_hidden_layers": 2, "num_attention_heads": 4},
    "starcoder2": {"model_type": "starcoder2", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 256,
                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2},
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(OUTSIDERS))
def test_non_llama_blocks_match_transformers(kind):
    """Count and linear layers (names, shapes, biases) as the transformers model has them: LoRA targets and the
    memory model read these, so a Llama-shaped guess silently plans adapters on modules that do not exist."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = OUTSIDERS[kind]
    arch = Architecture.from_config(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    assert arch.total_params == sum(p.numel() for p in model.parameters())
    block = next(m for name, m in model.named_modules() if name.endswith(("layers.0", "h.0")))
    real = {
        name.rsplit(".", 1)[-1]: (m.in_features, m.out_features, m.bias is not None)
        for name, m in block.named_modules()
        if isinstance(m, torch.nn.Linear)
    }
    assert {lin.name: (lin.in_features, lin.out_features, lin.bias) for lin in arch.linears} == real


@pytest.mark.parametrize("model_type", ["smollm3", "ernie4_5", "llama", "qwen2"])
def test_tied_embeddings_default_to_the_familys_config_class(model_type):
    """A config.json without `tie_word_embeddings` ties as its config class does (SmolLM3, ERNIE 4.5, Cohere: true;
    Llama, Qwen2: false): counting an untied head for SmolLM3-3B was 25 % too many parameters here."""
    config = {"model_type": model_type, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 192,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "pad_token_id": 0}  # fmt: skip
    assert Architecture.from_config(config).total_params == _transformers_count(config)
