"""Reading a decoder block's shape from a config dict: the linear layers, heads, widths, norms and sliding layers of
each kind of block (Llama-shaped, GPT-NeoX, Falcon, Phi, StarCoder2), as transformers 5.24 builds them; what a
family adds to its block is its `lowmem_ft.memory.families` record. No transformers, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lowmem_ft.memory.families import family


@dataclass(frozen=True)
class Linear:
    """One linear layer of a transformer block (names as in the transformers/remote-code module tree)."""

    name: str
    in_features: int
    out_features: int
    bias: bool = False

    @property
    def params(self) -> int:
        return self.in_features * self.out_features + (self.out_features if self.bias else 0)


def _sliding(config: dict[str, Any], model_type: str) -> dict[str, Any]:
    """`sliding_window` and how many layers use it, as transformers 5.24's configs decide: `layer_types` when the
    config lists them; Qwen2/3 only with `use_sliding_window` (layers from `max_window_layers` on); Gemma-2 every
    other layer (the first sliding); Gemma-3 all but every `sliding_window_pattern`-th; Mistral / Phi-3 all."""
    window = config.get("sliding_window")
    layers = int(config["num_hidden_layers"])
    rule = family(model_type)
    if rule.sliding == "use_sliding_window" and not config.get("use_sliding_window"):
        window = None
    if not window:
        return {"sliding_window": None, "sliding_layers": 0}
    types = config.get("layer_types")
    if types and rule.sliding != "all_always":  # MistralModel slides every layer whatever layer_types says (it warns)
        count = sum(t == "sliding_attention" for t in types)
    elif rule.sliding == "use_sliding_window":
        count = max(0, layers - int(config.get("max_window_layers", layers)))
    elif rule.sliding == "alternate":
        count = (layers + 1) // 2
    elif rule.sliding == "pattern":  # configuration_gemma3.py: 6, configuration_cohere2.py: 4
        pattern = int(config.get("sliding_window_pattern") or rule.sliding_pattern)
        count = sum((i + 1) % pattern != 0 for i in range(layers))
    else:
        count = layers
    return {"sliding_window": int(window), "sliding_layers": count}


def _experts(config: dict[str, Any]) -> int:
    """Routed experts per MoE layer, from the config key each family uses (Mixtral / GPT-OSS `num_local_experts`,
    Qwen2-MoE / Qwen3-MoE / OLMoE `num_experts`, DeepSeek `n_routed_experts`); 0 for a dense MLP. The planner does not
    tile such an MLP (`memory.tiled_mlp` refuses it: its router sees the whole sequence)."""
    counts = [config.get(key) for key in ("num_local_experts", "num_experts", "n_routed_experts")]
    return max([n for n in counts if isinstance(n, int) and not isinstance(n, bool)], default=0)


def _logit_scale(config: dict[str, Any]) -> float:
    """The factor the forward multiplies the LM head's output by, read as TRL 1.16's `add_fused_lm_head` reads it:
    `logit_scale` (Cohere), `output_multiplier`, `lm_head_multiplier` (Falcon-H1), else 1 / `logits_scaling`
    (Granite, MiniCPM3 divide by it; HyperCLOVA X multiplies)."""
    for key in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        if config.get(key) is not None:
            return float(config[key])
    scaling = config.get("logits_scaling")
    if scaling is None:
        return 1.0
    return float(scaling) if config.get("model_type") == "hyperclovax" else 1.0 / float(scaling)


def _llama_block(config: dict[str, Any], model_type: str) -> dict[str, Any]:
    """Heads, widths, norms and linears of a Llama-shaped block (Llama, Qwen, Mistral, Gemma, Phi-3, Granite, ...):
    q/k/v/o projections, a gated MLP, RMSNorm."""
    h = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    # A missing head_dim was filled with the config class's default (`_with_class_defaults`); a null one is
    # hidden / heads, as the classes that accept null make it.
    head_dim = int(config.get("head_dim") or h // heads)
    inter = int(config["intermediate_size"])
    # Apertus's xIELU activation (activations.py XIELU) holds two learnable scalars, alpha_p and alpha_n, per MLP.
    rule = family(model_type)
    xielu = rule.xielu_scalars and str(config.get("hidden_act")) == "xielu"
    return {
        "num_heads": heads,
        "num_kv_heads": kv,
        "head_dim": head_dim,
        "intermediate_size": inter,
        "hidden_act": str(config.get("hidden_activation") or config.get("hidden_act") or "silu"),
        "tie_embeddings": bool(config.get("tie_word_embeddings", rule.tied_default)),
        "norms_per_layer": rule.norms_per_layer,
        "linears": _block_linears(config, model_type, h, heads * head_dim, kv * head_dim, inter),
        "mlp": "plain" if rule.plain_mlp else "gated",
        "norm": rule.norm,
        "qk_norm_per_head": rule.qk_norm_weights == "per_head",
        "block_extra_params": rule.xielu_scalars if xielu else 0,
    }


def _gpt_neox_block(config: dict[str, Any]) -> dict[str, Any]:
    """GPT-NeoX / Pythia (modeling_gpt_neox.py): fused query_key_value and dense with `attention_bias` (default
    true), a plain MLP dense_h_to_4h → GELU → dense_4h_to_h with biases, two LayerNorms, untied by default."""
    h, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    heads = int(config["num_attention_heads"])
    bias = bool(config.get("attention_bias", True))
    linears = (
        Linear("query_key_value", h, 3 * h, bias),
        Linear("dense", h, h, bias),
        Linear("dense_h_to_4h", h, inter, True),
        Linear("dense_4h_to_h", inter, h, True),
    )
    return _plain_block(config, heads, heads, h // heads, inter, linears, tied=False, norms=2)


def _falcon_block(config: dict[str, Any]) -> dict[str, Any]:
    """Falcon (modeling_falcon.py): fused query_key_value whose width follows the attention kind (new decoder
    architecture: num_kv_heads groups; multi-query: one k/v head; else 3 × hidden), dense, a plain MLP of
    `ffn_hidden_size` (default 4 × hidden), biases only with `bias` (default false), LayerNorms: one per layer with
    parallel attention (two with the new architecture or `num_ln_in_parallel_attn` 2), two without; tied default."""
    h = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = h // heads
    new_arch = bool(config.get("new_decoder_architecture", False))
    multi_query = bool(config.get("multi_query", True))
    kv = int(config.get("num_kv_heads") or heads) if new_arch else (1 if multi_query else heads)
    inter = int(config.get("ffn_hidden_size") or 4 * h)
    bias = bool(config.get("bias", False))
    linears = (
        Linear("query_key_value", h, (heads + 2 * kv) * head_dim, bias),
        Linear("dense", h, h, bias),
        Linear("dense_h_to_4h", h, inter, bias),
        Linear("dense_4h_to_h", inter, h, bias),
    )
    if not config.get("parallel_attn", True):
        norms = 2
    else:
        norms = int(config.get("num_ln_in_parallel_attn") or (2 if new_arch else 1))
    return _plain_block(config, heads, kv, head_dim, inter, linears, tied=True, norms=norms)


def _starcoder2_block(config: dict[str, Any]) -> dict[str, Any]:
    """StarCoder2 (modeling_starcoder2.py): q/k/v/o and a plain MLP c_fc → GELU → c_proj, all with `use_bias`
    (default true), two LayerNorms, tied by default."""
    h, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = h // heads
    bias = bool(config.get("use_bias", True))
    linears = (
        Linear("q_proj", h, heads * head_dim, bias),
        Linear("k_proj", h, kv * head_dim, bias),
        Linear("v_proj", h, kv * head_dim, bias),
        Linear("o_proj", heads * head_dim, h, bias),
        Linear("c_fc", h, inter, bias),
        Linear("c_proj", inter, h, bias),
    )
    return _plain_block(config, heads, kv, head_dim, inter, linears, tied=True, norms=2)


def _phi_block(config: dict[str, Any]) -> dict[str, Any]:
    """Phi-1 / 1.5 / 2 (modeling_phi.py): q/k/v_proj and dense with biases, a plain MLP fc1 → GELU → fc2 with
    biases, one LayerNorm per layer (attention and MLP in parallel), an LM head with a bias, untied by default."""
    h, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = h // heads
    linears = (
        Linear("q_proj", h, heads * head_dim, True),
        Linear("k_proj", h, kv * head_dim, True),
        Linear("v_proj", h, kv * head_dim, True),
        Linear("dense", heads * head_dim, h, True),
        Linear("fc1", h, inter, True),
        Linear("fc2", inter, h, True),
    )
    return {**_plain_block(config, heads, kv, head_dim, inter, linears, tied=False, norms=1), "lm_head_bias": True}


def _plain_block(config, heads, kv, head_dim, inter, linears, tied: bool, norms: int) -> dict[str, Any]:
    """The shape fields of a block with a plain (non-gated) MLP and LayerNorms (weight and bias)."""
    return {
        "num_heads": heads,
        "num_kv_heads": kv,
        "head_dim": head_dim,
        "intermediate_size": inter,
        "mlp": "plain",
        "hidden_act": str(config.get("hidden_act") or config.get("activation") or "gelu"),
        "tie_embeddings": bool(config.get("tie_word_embeddings", tied)),
        "norm": "layer",
        "norms_per_layer": norms,
        "linears": linears,
    }


# the block builders of families whose blocks are not Llama-shaped (`Family.block`)
BUILDERS = {"gpt_neox": _gpt_neox_block, "falcon": _falcon_block, "phi": _phi_block, "starcoder2": _starcoder2_block}


def _block_linears(config: dict[str, Any], model_type: str, h: int, q_out: int, kv_out: int, inter: int):
    """The linear layers of one decoder block, as transformers names them."""
    rule = family(model_type)  # its biases and fused projections (`Family.o_bias_key`, `fused_qkv`)
    qkv_bias = rule.qkv_bias_always or bool(config.get("attention_bias", rule.attention_bias_default))
    o_bias = bool(config.get(rule.o_bias_key, False)) if rule.o_bias_key else False
    mlp_bias = bool(config.get("mlp_bias", False))
    if rule.fused_qkv:  # fused projections (modeling_phi3.py: qkv_proj, gate_up_proj)
        return (
            Linear("qkv_proj", h, q_out + 2 * kv_out),
            Linear("o_proj", q_out, h),
            Linear("gate_up_proj", h, 2 * inter),
            Linear("down_proj", inter, h),
        )
    attention = (
        Linear("q_proj", h, q_out, qkv_bias),
        Linear("k_proj", h, kv_out, qkv_bias),
        Linear("v_proj", h, kv_out, qkv_bias),
        Linear("o_proj", q_out, h, o_bias),
    )
    if rule.fused_gate_up:  # modeling_glm4.py: a fused gate_up_proj, no biases in the MLP
        return (*attention, Linear("gate_up_proj", h, 2 * inter), Linear("down_proj", inter, h))
    if rule.plain_mlp:
        return (*attention, Linear("up_proj", h, inter, mlp_bias), Linear("down_proj", inter, h, mlp_bias))
    return (
        *attention,
        Linear("gate_proj", h, inter, mlp_bias),
        Linear("up_proj", h, inter, mlp_bias),
        Linear("down_proj", inter, h, mlp_bias),
    )


def _with_class_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with its config class's defaults for the keys it omits (`CLASS_DEFAULTS`); a key present with
    null stays null (head_dim null is hidden / heads, as in the classes that accept it)."""
    defaults = family(str(config.get("model_type", ""))).class_defaults
    return {**defaults, **config}
