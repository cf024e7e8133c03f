"""What lowmem-ft knows about each model family: one `Family` record per transformers `model_type`, read by the
architecture reader (`lowmem_ft.memory.arch`, `blocks`) and the estimator's terms. Adding a family is one entry here
(plus a block builder in `blocks` when its block is not Llama-shaped, a plain-MLP one or a known other kind).

Every fact is read from transformers 5.24's modeling / configuration code for that family (the file named in each
comment) and checked where a test says so: parameter counts against the model transformers builds from the same
config (tests/memory/test_arch_configs.py, test_moe.py), the chunked loss against the model's own loss
(tests/train/test_losses.py), per-layer activation bytes against PeakMemory (tests/memory/test_estimate.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal


@dataclass(frozen=True)
class Family:
    """One model family (a transformers `model_type`), as the memory model reads it."""

    # the block's shape: "llama" (q/k/v/o + MLP, `blocks._llama_block`), "moe" (`blocks.moe_architecture`),
    # or a non-Llama builder of `blocks.BUILDERS` (gpt_neox, falcon, phi, starcoder2)
    block: str = "llama"
    # its parameter count equals transformers' model (tests/memory/test_arch_configs.py)
    checked: bool = False
    described: bool = False  # planned without the unchecked-family warning though not counted here (checked implies it)
    native: bool = False  # transformers implements it (a config with an `auto_map` is remote code otherwise)
    no_sdpa: str = ""  # why transformers refuses attn_implementation="sdpa" (`_supports_sdpa = False`): eager instead
    # `memory.chunked_loss` reproduces the model's own logits (lm_head, × logit_scale, final softcapping)
    chunked_loss_verified: bool = False
    # apply_rotary_pos_emb joins the rotated halves with torch.cat: q comes out (batch, heads, seq, head_dim)-
    # contiguous, so o_proj's input is a copy of its own (`activations._o_proj_copies`)
    rope_cat: bool = False
    tied_default: bool = False  # the config class's `tie_word_embeddings` default
    class_defaults: Mapping[str, Any] = field(default_factory=dict)  # config-class defaults a config.json may omit
    # q/k norms: "always" (Qwen3, Gemma-3, ...), "use_qk_norm" (Cohere: the config's flag), "" none
    qk_norm: Literal["always", "use_qk_norm", ""] = ""
    # weights of the q/k norms: head_dim each ("head_dim") or heads · head_dim and kv heads · head_dim ("per_head":
    # Cohere per head, OLMo-2/3 over the full width)
    qk_norm_weights: Literal["head_dim", "per_head"] = "head_dim"
    norms_per_layer: int = 2  # Gemma-2/3, GLM-4: 4 (pre/post); Cohere: 1 (parallel block)
    norm: Literal["rms", "layer", "layer_no_bias"] = "rms"
    norm_fp32_output: bool = False  # the norm multiplies by its weight in fp32 (Gemma, Cohere)
    plain_mlp: bool = False  # down_proj(act(up_proj(x))), no gate
    fused_gate_up: bool = False  # one gate_up_proj (Phi-3, GLM, GLM-4)
    fused_qkv: bool = False  # one qkv_proj (Phi-3)
    # biases (modeling_llama.py: `attention_bias` covers q/k/v/o): Qwen2 puts one on q/k/v always and none on o;
    # GLM / GLM-4 default `attention_bias` to true for q/k/v (configuration_glm4.py) and never bias o; Seed-OSS biases
    # o by its own flag, `attention_out_bias`
    qkv_bias_always: bool = False
    attention_bias_default: bool = False
    o_bias_key: str = "attention_bias"  # "": never
    xielu_scalars: int = 0  # parameters of a trainable xIELU activation per block (Apertus: alpha_p, alpha_n)
    # how the config's sliding window applies to layers (`blocks.sliding`): "all" (every layer, Mistral / Phi-3),
    # "use_sliding_window" (Qwen2/3: only with that flag, from max_window_layers on), "alternate" (Gemma-2),
    # "pattern" (all but every `sliding_window_pattern`-th, `sliding_pattern` by default); `layer_types` rules when
    # a config lists them, unless "all_always" (MistralModel slides every layer whatever layer_types says)
    sliding: Literal["all", "all_always", "use_sliding_window", "alternate", "pattern"] = "all"
    sliding_pattern: int = 0
    # mixtures of experts (block "moe"): the router module's name, whether it is an nn.Linear, the target_modules
    # names peft 0.21 rewrites into LoRA on the expert parameters, how the router hands its weights to the experts
    router: str = "gate"
    router_linear: bool = False
    peft_expert_names: frozenset[str] = frozenset()
    routing: str = ""  # "" reads the config's norm_topk_prob ("fp32_renorm_cast" / "cast")
    shared_expert: bool = False  # Qwen2-MoE: a dense shared expert and its 1-wide gate
    scaled_embeddings_kept: bool = False  # Granite-MoE: the unscaled embeddings stay beside the first layer's input
    unused_sliding_mask: bool = False  # Qwen2-MoE: builds a sliding-window mask no layer uses
    moe_wide_qk_norm: bool = False  # OLMoE: q_norm over hidden_size, k_norm over the k/v width (not head_dim)
    lm_head_bias_flag: bool = False  # PhiMoE: the LM head has a bias when the config's `lm_head_bias` says so


_HEAD_DIM_128 = MappingProxyType({"head_dim": 128})
_LLAMA_CHECKED = {"block": "llama", "checked": True}
_GEMMA = {"tied_default": True, "norm_fp32_output": True}
_GLM = {**_LLAMA_CHECKED, "rope_cat": True, "fused_gate_up": True, "class_defaults": _HEAD_DIM_128,
        "attention_bias_default": True, "o_bias_key": ""}  # fmt: skip
_MOE = {"block": "moe", "checked": True}
# Qwen-MoE / OLMoE: transformers maps them to the qwen2_moe weight pattern, which peft rewrites (not Qwen2-MoE itself)
_PEFT_GATE_UP_DOWN = frozenset({"gate_proj", "up_proj", "down_proj", "gate"})

FAMILIES: Mapping[str, Family] = MappingProxyType({
    # -- Llama-shaped, checked (configuration_*.py / modeling_*.py of each) ---------------------------------------
    "llama": Family(**_LLAMA_CHECKED, native=True, chunked_loss_verified=True),
    "mistral": Family(**_LLAMA_CHECKED, native=True, chunked_loss_verified=True, sliding="all_always",
                      class_defaults={"sliding_window": 4096}),
    "qwen2": Family(**_LLAMA_CHECKED, native=True, chunked_loss_verified=True, sliding="use_sliding_window",
                    qkv_bias_always=True, o_bias_key=""),
    # Qwen2.5-VL's decoder (modeling_qwen2_5_vl.py Qwen2_5_VLTextModel): Qwen2's block; its M-RoPE changes no weight.
    # Described, not in the checked set: AutoModelForCausalLM cannot build it alone; its count is checked with the
    # whole model (tests/memory/test_vision.py)
    "qwen2_5_vl_text": Family(block="llama", described=True, native=True, sliding="use_sliding_window",
                              qkv_bias_always=True, o_bias_key=""),
    # Qwen2-VL's decoder (modeling_qwen2_vl.py Qwen2VLTextModel): the same Qwen2 block
    "qwen2_vl_text": Family(block="llama", described=True, native=True, sliding="use_sliding_window",
                            qkv_bias_always=True, o_bias_key=""),
    "qwen3": Family(**_LLAMA_CHECKED, native=True, chunked_loss_verified=True, sliding="use_sliding_window",
                    qk_norm="always", class_defaults=_HEAD_DIM_128),
    # Qwen3-VL's decoder (modeling_qwen3_vl.py Qwen3VLTextModel): Qwen3's block (q/k norms, no biases), interleaved
    # M-RoPE and the deepstack additions change no weight
    "qwen3_vl_text": Family(block="llama", described=True, native=True, qk_norm="always",
                            class_defaults=_HEAD_DIM_128),
    "gemma": Family(**_LLAMA_CHECKED, **_GEMMA, native=True, class_defaults={"head_dim": 256}),
    "gemma2": Family(**_LLAMA_CHECKED, **_GEMMA, native=True, chunked_loss_verified=True, norms_per_layer=4,
                     sliding="alternate",
                     no_sdpa="SDPA cannot apply Gemma-2's attention logit softcapping (modeling_gemma2.py "
                             "_supports_sdpa = False)",
                     class_defaults={"head_dim": 256, "sliding_window": 4096, "final_logit_softcapping": 30.0,
                                     "attn_logit_softcapping": 50.0}),
    # a multimodal Gemma-3 config.json ships a text_config of a few keys: all of Gemma3TextConfig's shape defaults
    "gemma3_text": Family(**_LLAMA_CHECKED, **_GEMMA, native=True, chunked_loss_verified=True, norms_per_layer=4,
                          qk_norm="always", sliding="pattern", sliding_pattern=6,
                          class_defaults={"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
                                          "num_hidden_layers": 26, "num_attention_heads": 8,
                                          "num_key_value_heads": 4, "head_dim": 256,
                                          "hidden_activation": "gelu_pytorch_tanh",
                                          "max_position_embeddings": 131_072, "sliding_window": 4096}),
    "phi3": Family(**_LLAMA_CHECKED, native=True, chunked_loss_verified=True, rope_cat=True, fused_gate_up=True,
                   fused_qkv=True),
    "granite": Family(**_LLAMA_CHECKED, native=True, chunked_loss_verified=True),
    "cohere": Family(**_LLAMA_CHECKED, tied_default=True, norm_fp32_output=True, norms_per_layer=1,
                     norm="layer_no_bias", qk_norm="use_qk_norm", qk_norm_weights="per_head",
                     class_defaults={"logit_scale": 0.0625}),
    "cohere2": Family(**_LLAMA_CHECKED, tied_default=True, norm_fp32_output=True, norms_per_layer=1,
                      norm="layer_no_bias", qk_norm="use_qk_norm", qk_norm_weights="per_head", sliding="pattern",
                      sliding_pattern=4, class_defaults={"sliding_window": 4096, "logit_scale": 0.0625}),
    "helium": Family(**_LLAMA_CHECKED, class_defaults=_HEAD_DIM_128),
    "nemotron": Family(**_LLAMA_CHECKED, rope_cat=True, plain_mlp=True, norm="layer"),
    "arcee": Family(**_LLAMA_CHECKED, plain_mlp=True),
    "apertus": Family(**_LLAMA_CHECKED, plain_mlp=True, qk_norm="always", xielu_scalars=2,
                      class_defaults={"hidden_act": "xielu"}),
    "ernie4_5": Family(**_LLAMA_CHECKED, tied_default=True, class_defaults=_HEAD_DIM_128),
    "smollm3": Family(**_LLAMA_CHECKED, tied_default=True),
    "glm": Family(**_GLM),
    "glm4": Family(**_GLM, norms_per_layer=4),
    "olmo2": Family(**_LLAMA_CHECKED, qk_norm="always", qk_norm_weights="per_head"),
    "olmo3": Family(**_LLAMA_CHECKED, qk_norm="always", qk_norm_weights="per_head"),
    "exaone4": Family(**_LLAMA_CHECKED, qk_norm="always"),
    "seed_oss": Family(**_LLAMA_CHECKED, class_defaults=_HEAD_DIM_128, o_bias_key="attention_out_bias"),
    # -- known, not counted against transformers here ----------------------------------------------------------
    "gemma3": Family(block="llama", described=True, **_GEMMA, norms_per_layer=4, qk_norm="always", sliding="pattern",
                     sliding_pattern=6),  # the multimodal wrapper: planned as its gemma3_text model
    "llama4_text": Family(block="llama", described=True),
    "ministral3": Family(class_defaults=_HEAD_DIM_128),
    "internlm3": Family(class_defaults=_HEAD_DIM_128),
    "vaultgemma": Family(no_sdpa="SDPA cannot apply VaultGemma's attention logit softcapping "
                                          "(_supports_sdpa = False)"),
    "gpt_oss": Family(no_sdpa="SDPA cannot apply GPT-OSS's attention sinks (modeling_gpt_oss.py _supports_sdpa = "
                              "False)"),
    # -- blocks of their own (`blocks.BUILDERS`) -----------------------------------------------------------------
    "gpt_neox": Family(block="gpt_neox", checked=True, rope_cat=True),
    "falcon": Family(block="falcon", checked=True),
    "phi": Family(block="phi", checked=True, rope_cat=True),
    "starcoder2": Family(block="starcoder2", checked=True),
    # -- mixtures of experts (modeling_*.py; routing read from each TopKRouter.forward) ----------------------------
    "mixtral": Family(**_MOE, routing="fp32_renorm", peft_expert_names=frozenset({"w1", "w2", "w3", "gate"})),
    "qwen2_moe": Family(**_MOE, shared_expert=True, unused_sliding_mask=True, sliding="use_sliding_window"),
    "qwen3_moe": Family(**_MOE, qk_norm="always", peft_expert_names=_PEFT_GATE_UP_DOWN,
                        sliding="use_sliding_window"),
    "olmoe": Family(**_MOE, qk_norm="always", peft_expert_names=_PEFT_GATE_UP_DOWN, moe_wide_qk_norm=True),
    "granitemoe": Family(**_MOE, router="router", routing="topk_softmax", scaled_embeddings_kept=True),
    "phimoe": Family(**_MOE, router="router", router_linear=True, norm="layer", lm_head_bias_flag=True),
})  # fmt: skip
UNKNOWN = Family()  # a model_type not above: read as Llama-shaped, with a warning (`arch.unchecked_family`)
_GEMMA_LIKE = Family(**_GEMMA)  # an unknown gemma* model_type ties and multiplies its norms in fp32 as Gemma's do


def family(model_type: str) -> Family:
    """The record of `model_type` (UNKNOWN when lowmem-ft does not know it)."""
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    return _GEMMA_LIKE if model_type.startswith("gemma") else UNKNOWN


def with_flag(flag: str) -> frozenset[str]:
    """The model_types whose record has `flag` set (a truthy field): e.g. with_flag("rope_cat")."""
    return frozenset(t for t, f in FAMILIES.items() if getattr(f, flag))
