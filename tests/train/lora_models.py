"""Small LoRA models of several families, built in code, for gradient-equality tests of the memory savers."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model

SMALL = dict(vocab_size=128, hidden_size=32, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4)


def configs():
    from transformers import Gemma2Config, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config

    return {
        "llama": LlamaConfig(**SMALL, num_key_value_heads=2),
        "qwen2": Qwen2Config(**SMALL, num_key_value_heads=2, tie_word_embeddings=False),
        "gemma2": Gemma2Config(**SMALL, num_key_value_heads=2, head_dim=8),  # GeGLU, 4 norms, softcapping, tied
        "phi3": Phi3Config(**SMALL, num_key_value_heads=4, pad_token_id=0),  # fused gate_up_proj
        "mistral": MistralConfig(**SMALL, num_key_value_heads=4),
    }


FAMILIES = ["llama", "qwen2", "gemma2", "phi3", "mistral"]
MLP_TARGETS = {"phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}
DEFAULT_TARGETS = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]


def model_of(family: str, dropout: float = 0.0, checkpointing: bool = False):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(configs()[family], dtype=torch.float32, attn_implementation="eager")
    for p in model.parameters():
        p.requires_grad_(False)
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    config = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=dropout, init_lora_weights=False,  # B ≠ 0: every path carries gradient
        target_modules=MLP_TARGETS.get(family, DEFAULT_TARGETS),
    )  # fmt: skip
    model = get_peft_model(model, config)
    model.train()
    return model


def grads_of(model, ids, mask):
    torch.manual_seed(1)  # the same dropout draws for every model built the same way
    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def batch(batch: int = 2, seq: int = 37):
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 128, (batch, seq), generator=gen)
    mask = torch.ones_like(ids)
    mask[-1, :5] = 0  # a left-padded row: tiles of the flattened batch cross samples and padding
    return ids, mask


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)
        assert a[name].abs().sum() > 0, name  # the comparison is not between zeros
