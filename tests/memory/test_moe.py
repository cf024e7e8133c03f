"""Mixtures of experts: parameter counts, what bitsandbytes quantizes and what peft adapts, against the installed
transformers 5 / peft / bitsandbytes, and the memory model's MoE terms against exact CPU measurements."""

from __future__ import annotations

import pytest

from lowmem_ft.errors import UserError
from lowmem_ft.memory.arch import Architecture

_BASE = {"vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 96}  # fmt: skip
# Each family with the config keys that change its shape (biases, tying, head_dim, shared expert, norms).
MOE = {
    "mixtral": {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
    "mixtral-tied-hd": {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 24,
                        "tie_word_embeddings": True},
    "qwen2_moe": {"model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                  "shared_expert_intermediate_size": 80},
    "qwen2_moe-nobias": {"model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2,
                         "moe_intermediate_size": 48, "shared_expert_intermediate_size": 80, "qkv_bias": False},
    "qwen3_moe": {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                  "head_dim": 24, "norm_topk_prob": True},
    "qwen3_moe-bias-tied": {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
                            "moe_intermediate_size": 48, "attention_bias": True, "tie_word_embeddings": True},
    "olmoe": {"model_type": "olmoe", "num_experts": 4, "num_experts_per_tok": 2},
    "olmoe-bias": {"model_type": "olmoe", "num_experts": 4, "num_experts_per_tok": 2, "attention_bias": True},
    "granitemoe": {"model_type": "granitemoe", "num_local_experts": 4, "num_experts_per_tok": 2},
    "granitemoe-tied-bias": {"model_type": "granitemoe", "num_local_experts": 4, "num_experts_per_tok": 2,
                             "tie_word_embeddings": True, "attention_bias": True},
    "phimoe": {"model_type": "phimoe", "num_local_experts": 4, "num_experts_per_tok": 2},
    "phimoe-bias": {"model_type": "phimoe", "num_local_experts": 4, "num_experts_per_tok": 2, "attention_bias": True,
                    "lm_head_bias": True},
}  # fmt: skip


def _config(kind: str) -> dict:
    return {**_BASE, **MOE[kind]}


def _model(config: dict, meta: bool = True):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if meta:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.bfloat16)


@pytest.mark.parametrize("kind", sorted(MOE))
def test_moe_counts_and_linears_match_transformers(kind):
    """Parameter count exact, and `linears` = the block's modules whose type is nn.Linear (what bitsandbytes
    replaces and the recipes' names adapt); the 3-D expert stacks and the router are counted apart (`MoE`)."""
    import torch

    config = _config(kind)
    arch = Architecture.from_config(config)
    model = _model(config)
    assert arch.moe is not None and arch.experts == 4
    assert arch.total_params == sum(p.numel() for p in model.parameters())
    block = model.model.layers[0]
    real = {
        name.rsplit(".", 1)[-1]: (m.in_features, m.out_features, m.bias is not None)
        for name, m in block.named_modules()
        if type(m) is torch.nn.Linear
    }
    assert {lin.name: (lin.in_features, lin.out_features, lin.bias) for lin in arch.linears} == real
    experts = next(m for name, m in block.named_modules() if name.endswith("experts"))
    assert sum(p.numel() for p in experts.parameters()) == arch.moe.expert_params(arch.hidden_size)


def test_published_mixtral_is_46_7b_of_which_45_1b_experts():
    """The count that was 7.2B when an MoE was read as one dense MLP per layer (commit 8babbf1)."""
    from lowmem_ft.memory.arch import load_architecture

    arch = load_architecture("mistralai/Mixtral-8x7B-v0.1")
    assert arch.total_params == 46_702_792_704
    assert arch.num_layers * arch.moe.expert_params(arch.hidden_size) == 45_097_156_608


def test_mixtures_with_dense_layers_are_refused_by_the_planner(tmp_path):
    """decoder_sparse_step / mlp_only_layers put dense MLPs among the MoE layers, which the block description (one
    block for every layer) cannot hold: the planner refuses such a config rather than counting it as all-sparse;
    reading it (train without --vram, generate) still works."""
    import json

    from lowmem_ft.choosing import choose_recipe

    assert Architecture.from_config({**_config("qwen3_moe"), "mlp_only_layers": [0]}).moe.dense_layers == (0,)
    assert Architecture.from_config({**_config("qwen2_moe"), "decoder_sparse_step": 2}).moe.dense_layers == (0,)
    (tmp_path / "config.json").write_text(json.dumps({**_config("qwen3_moe"), "mlp_only_layers": [1]}))
    with pytest.raises(UserError, match=r"layers \[1\] have a dense MLP among the sparse ones"):
        choose_recipe(vram_gb=24, recipe=None, overrides={"model": {"name_or_path": str(tmp_path)}})


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe", "granitemoe", "phimoe"])
def test_nf4_leaves_the_experts_and_router_in_16_bit(tmp_path, kind):
    """transformers' bitsandbytes loading replaces `type(module) is nn.Linear` only: the 3-D expert stacks and the
    router stay bf16 — what the estimate's "experts + routers (16-bit)" counts — and the block's linears are NF4."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = _config(kind)
    arch = Architecture.from_config(config)
    _model(config, meta=False).save_pretrained(tmp_path)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quant, dtype=torch.bfloat16)
    block = model.model.layers[0]
    quantized = {n.rsplit(".", 1)[-1] for n, m in block.named_modules() if type(m).__name__ == "Linear4bit"}
    assert quantized == set(arch.linear_names)
    sixteen = {
        n: p for n, p in block.named_parameters() if ".experts." in n or n.endswith(f".{arch.moe.router}.weight")
    }
    assert sixteen and all(p.dtype == torch.bfloat16 and type(p) is torch.nn.Parameter for p in sixteen.values())
    assert sum(p.numel() for p in sixteen.values()) == arch.moe.layer_params(arch.hidden_size)


RECIPE_NAMES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "phimoe"])
@pytest.mark.parametrize("targets", [RECIPE_NAMES, ["all-linear"], ["w1", "w2", "w3"]], ids=["llama", "all", "w123"])
def test_what_peft_adapts_beyond_the_linears(kind, targets):
    """`MoE.adapted_parameters`: the expert stacks / routers peft 0.21 adapts for these target_modules (its
    transformers-v5 conversion rewrites Mixtral's w1/w2/w3 and Qwen3-MoE's / OLMoE's gate/up/down_proj into
    target_parameters; "all-linear" also reaches an nn.Linear router), checked on the real peft model."""
    import torch
    from peft import LoraConfig, get_peft_model

    config = _config(kind)
    arch = Architecture.from_config(config)
    names = "all-linear" if targets == ["all-linear"] else targets
    try:
        model = get_peft_model(_model(config, meta=False), LoraConfig(r=2, target_modules=names, lora_dropout=0.0))
    except ValueError as exc:  # nothing matched (w1/w2/w3 on a family that has none)
        assert "Target modules" in str(exc) and not arch.moe.adapted_parameters(targets)
        return
    block = model.base_model.model.model.layers[0]
    beyond = set()
    for name, module in block.named_modules():
        if hasattr(module, "lora_A") and type(module.get_base_layer()) is not torch.nn.Linear:
            beyond.add("experts" if "experts" in name else name.rsplit(".", 1)[-1].split(".")[0])
    beyond = {b if b == "experts" else arch.moe.router for b in beyond}
    assert beyond == set(arch.moe.adapted_parameters(targets))


@pytest.mark.parametrize("kind", sorted(MOE))
def test_full_fine_tuning_counts_every_parameter_as_trainable(kind):
    """The monitor's prediction for a full fine-tune (train without --vram; the planner refuses it) trains the expert
    stacks and routers too: its trainable tensors add up to the model's parameters."""
    from lowmem_ft.memory.estimate import Setup, _trainable_tensors

    arch = Architecture.from_config(_config(kind))
    tensors = _trainable_tensors(arch, Setup(adapter="full", quantization="none"))
    assert sum(n for n, _ in tensors) == arch.total_params
