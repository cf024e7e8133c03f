"""The architecture description: the shapes the memory model needs, read from a model's `config.json`.

One idea: a decoder-only transformer is fully described, for memory purposes, by a handful of integers and the
list of linear layers in one block. `Architecture.from_config` reads those from a config dict (no transformers, no
torch); `load_architecture` finds the dict in a local directory, in the offline catalog shipped in
`lowmem_ft/catalog/models.json`, or on the Hub (config.json only, never weights).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal

from lowmem_ft.console import first_time
from lowmem_ft.errors import UserError

log = logging.getLogger(__name__)
CATALOG = Path(__file__).resolve().parents[1] / "catalog" / "models.json"
# model_type → why transformers 5.24 refuses `attn_implementation="sdpa"` for it (`_supports_sdpa = False` on the
# model class; loading raises "does not support an attention implementation through
# torch.nn.functional.scaled_dot_product_attention"). Those models train with eager attention.
NO_SDPA = {
    "gemma2": "SDPA cannot apply Gemma-2's attention logit softcapping (modeling_gemma2.py _supports_sdpa = False)",
    "vaultgemma": "SDPA cannot apply VaultGemma's attention logit softcapping (_supports_sdpa = False)",
    "gpt_oss": "SDPA cannot apply GPT-OSS's attention sinks (modeling_gpt_oss.py _supports_sdpa = False)",
}
# Fused projection → the separate projections it replaces (transformers' modeling_phi3.py).
FUSED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# model_type → how its forward turns the LM head's output into logits, read from transformers 5.24's modeling code
# and checked against the model's own loss and gradients on the zoo (tests/train/test_losses.py): `lm_head(h)`, then
# × logit_scale (Granite: ÷ logits_scaling), then final-logit softcapping (Gemma-2: cap · tanh(logits / cap)).
# `memory.chunked_loss` reproduces exactly these; on any other model_type it is refused (its forward is unknown).
# Gemma-3's multimodal checkpoints (`gemma3`) plan as their gemma3_text model, checked the same way on the
# zoo's gemma3-vision (Gemma3ForConditionalGeneration: its forward applies lm_head to the language model's output).
CHUNKED_LOSS_VERIFIED = {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "granite"}
# Suffixes of fine-tuned variants that keep the base model's architecture (Qwen2.5-7B-Instruct = Qwen2.5-7B,
# gemma-3-1b-it = gemma-3-1b-pt).
VARIANT_SUFFIXES = ("-instruct", "-chat", "-it")


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


@dataclass(frozen=True)
class Architecture:
    """Shapes of a decoder-only causal LM, enough to count parameters and estimate training memory."""

    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    mlp: Literal["gated", "plain"] = "gated"  # gated: act(gate(x)) * up(x) (SwiGLU / GeGLU)
    hidden_act: str = "silu"
    tie_embeddings: bool = False
    norm: Literal["rms", "layer", "layer_no_bias"] = "rms"  # layer_no_bias: Cohere's LayerNorm (a weight only)
    norms_per_layer: int = 2  # Gemma 2 has 4 (pre/post attention and feed-forward); Cohere 1 (parallel block)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k
    qk_norm_per_head: bool = (
        False  # Cohere (per head) and OLMo-2 (full width): heads · head_dim weights on q, kv ones on k
    )
    block_extra_params: int = 0  # per block, parameters outside its linears and norms (Apertus's xIELU: 2 scalars)
    linears: tuple[Linear, ...] = field(default_factory=tuple)  # of one block
    max_position_embeddings: int = 0
    sliding_window: int | None = None  # tokens a sliding-window layer attends to
    sliding_layers: int = 0  # layers that use it (Gemma: alternate / five in six; Mistral, Phi-3: all)
    attn_logit_softcapping: float | None = None  # Gemma-2: tanh over the attention scores (eager only)
    norm_fp32_output: bool = False  # Gemma's RMSNorm multiplies in fp32 (output * (1 + weight.float()))
    final_logit_softcapping: float | None = None
    logit_scale: float = 1.0  # multiplies the LM head's output (Granite: 1 / logits_scaling)
    remote_code: bool = False
    experts: int = 0  # routed experts of a mixture-of-experts MLP (see `_experts`); 0: a dense MLP
    lm_head_bias: bool = False  # Phi-1/2: the LM head adds a bias of vocab_size
    # Weights loaded beside the decoder but not run by text training (Gemma-3's SigLIP vision tower and projector):
    # all of their parameters, and their nn.Linear layers, which bitsandbytes quantizes like the block's.
    tower_params: int = 0
    tower_linears: tuple[Linear, ...] = field(default_factory=tuple)
    moe: MoE | None = None  # the routed experts of a mixture of experts this memory model counts (see `MoE`)

    @classmethod
    def from_config(cls, config: dict[str, Any], name: str = "") -> Architecture:
        """The architecture of a config.json dict; raises UserError for shapes this model cannot describe."""
        tower: dict[str, Any] = {}
        if ("text_config" in config and "hidden_size" not in config) or config.get("model_type") in NOT_CAUSAL_LM:
            config, tower = _composite(config, name)  # Qwen2-VL's config.json keeps the text fields at its top
        config = _with_class_defaults(config)
        model_type = str(config.get("model_type", ""))
        needed = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"]
        if model_type not in NON_LLAMA_BLOCKS and model_type != "qwen":
            needed.append("intermediate_size")
        missing = [k for k in needed if k not in config]
        if missing:
            raise UserError(
                f"model '{name}': config.json lacks {', '.join(missing)}; lowmem-ft plans decoder-only causal LMs"
            )
        per_layer = [k for k in (*needed, "num_key_value_heads", "head_dim") if isinstance(config.get(k), list)]
        if per_layer:  # OpenELM-style layer-wise widths
            raise UserError(
                f"model '{name}': config.json gives {', '.join(per_layer)} per layer (a list); lowmem-ft plans "
                "models whose layers all have one shape"
            )
        if model_type == "qwen":
            return _qwen_v1(config, name)
        if model_type in MOE_FAMILIES:
            return _moe_architecture(cls, config, name, model_type)
        if model_type in NON_LLAMA_BLOCKS:
            shape = NON_LLAMA_BLOCKS[model_type](config)
        else:
            shape = _llama_block(config, model_type)
        return cls(
            name=name or str(config.get("_name_or_path", "")),
            model_type=model_type,
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            num_layers=int(config["num_hidden_layers"]),
            qk_norm=model_type in ("qwen3", "gemma3_text", "gemma3", "apertus", *FULL_WIDTH_QK_NORM, "exaone4")
            or (model_type in COHERE and bool(config.get("use_qk_norm"))),
            **shape,
            max_position_embeddings=int(config.get("max_position_embeddings") or 0),
            **_sliding(config, model_type),
            attn_logit_softcapping=config.get("attn_logit_softcapping"),
            # CohereLayerNorm also multiplies in fp32 (self.weight.to(float32) * hidden_states)
            norm_fp32_output=model_type.startswith("gemma") or model_type in COHERE,
            final_logit_softcapping=config.get("final_logit_softcapping"),
            logit_scale=_logit_scale(config),
            remote_code="auto_map" in config and model_type not in _NATIVE,
            experts=_experts(config),
            **tower,
        )

    # -- what the training path may use on this architecture ------------------------------------------------------
    @property
    def chunked_loss_refusal(self) -> str | None:
        """Why `memory.chunked_loss` is refused here (one line), or None when it reproduces the model's own loss."""
        if self.remote_code or self.model_type not in CHUNKED_LOSS_VERIFIED:
            return (
                f"memory.chunked_loss is not verified for model_type {self.model_type!r} (its forward may transform "
                "the logits in ways the chunked loss does not reproduce); train with memory.chunked_loss=false"
            )
        return None

    @property
    def chunked_loss_exact(self) -> bool:
        """`memory.chunked_loss` computes this model's own loss (softcapping, logit scaling, bias, tied weights)."""
        return self.chunked_loss_refusal is None

    def attention_for(self, requested: str) -> tuple[str, str | None]:
        """(implementation transformers will run, why it differs from `requested` or None)."""
        if requested == "sdpa" and self.model_type in NO_SDPA:
            return "eager", f"{NO_SDPA[self.model_type]}; using eager attention (its s² scores are planned for)"
        if requested.startswith("flash_attention") and self.tower_params:
            # the same memory profile: SDPA keeps no s² scores either (`_attention_bytes`)
            why = "Gemma3ForConditionalGeneration refuses flash attention (modeling_gemma3.py _supports_flash_attn"
            return "sdpa", f"{why} = False: it would drop the bidirectional mask over image tokens); using sdpa"
        return requested, None

    # -- parameter counts ---------------------------------------------------------------------------------------
    @property
    def norm_params(self) -> int:
        """Per block: the norms' weights (LayerNorm adds a bias; qk-norm adds two head_dim weights)."""
        per_norm = self.hidden_size * (2 if self.norm == "layer" else 1)
        qk = (self.num_heads + self.num_kv_heads if self.qk_norm_per_head else 2) * self.head_dim
        return self.norms_per_layer * per_norm + (qk if self.qk_norm else 0)

    @property
    def block_linear_params(self) -> int:
        return sum(lin.params for lin in self.linears)

    @property
    def block_params(self) -> int:
        return self.block_linear_params + self.norm_params + self.block_extra_params

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """0 when tied: the head reuses the embedding matrix (counted once); plus its bias when it has one."""
        return (0 if self.tie_embeddings else self.vocab_size * self.hidden_size) + (
            self.vocab_size if self.lm_head_bias else 0
        )

    @property
    def final_norm_params(self) -> int:
        return self.hidden_size * (2 if self.norm == "layer" else 1)

    @property
    def linear_params(self) -> int:
        """Parameters of all block linears: what 4-/8-bit quantization replaces (bnb skips lm_head)."""
        return self.num_layers * self.block_linear_params

    @property
    def total_params(self) -> int:
        return (
            self.num_layers * self.block_params
            + self.embedding_params
            + self.lm_head_params
            + self.final_norm_params
            + self.tower_params
            + self.num_layers * (self.moe.layer_params(self.hidden_size) if self.moe else 0)
        )

    @property
    def linear_names(self) -> list[str]:
        return list(dict.fromkeys(lin.name for lin in self.linears))

    def lora_targets(self, target_modules: list[str]) -> list[Linear]:
        """Block linears a LoRA `target_modules` list matches (peft matches the last name component). Names of
        projections this architecture fuses stand for the fused one: q/k/v_proj → Phi-3's qkv_proj, gate/up_proj →
        gate_up_proj, so the recipes' Llama-style list adapts the same layers on every family."""
        if target_modules == ["all-linear"]:
            return list(self.linears)
        wanted = set(target_modules)
        present = set(self.linear_names)
        for fused, parts in FUSED_PROJECTIONS.items():
            if fused in present and wanted & set(parts):
                wanted.add(fused)
        return [lin for lin in self.linears if lin.name in wanted]

    def adapter_modules(self, target_modules: list[str]) -> list[str]:
        """The module names a LoRA `target_modules` list adapts on this architecture (see `lora_targets`)."""
        return list(dict.fromkeys(lin.name for lin in self.lora_targets(target_modules)))

    def summary(self) -> str:
        gqa = f", GQA {self.num_heads}/{self.num_kv_heads}" if self.num_kv_heads != self.num_heads else ""
        tied = ", tied embeddings" if self.tie_embeddings else ""
        tower = (
            f", {self.tower_params / 1e9:.2f}B of them a vision tower (loaded, not run)" if self.tower_params else ""
        )
        return (
            f"{self.name or self.model_type}: {self.total_params / 1e9:.2f}B params, {self.num_layers} layers, "
            f"hidden {self.hidden_size}, vocab {self.vocab_size}{gqa}{tied}{tower}"
        )


def _sliding(config: dict[str, Any], model_type: str) -> dict[str, Any]:
    """`sliding_window` and how many layers use it, as transformers 5.24's configs decide: `layer_types` when the
    config lists them; Qwen2/3 only with `use_sliding_window` (layers from `max_window_layers` on); Gemma-2 every
    other layer (the first sliding); Gemma-3 all but every `sliding_window_pattern`-th; Mistral / Phi-3 all."""
    window = config.get("sliding_window")
    layers = int(config["num_hidden_layers"])
    if model_type in ("qwen2", "qwen3") and not config.get("use_sliding_window"):
        window = None
    if not window:
        return {"sliding_window": None, "sliding_layers": 0}
    types = config.get("layer_types")
    if types and model_type != "mistral":  # MistralModel slides every layer whatever layer_types says (it warns)
        count = sum(t == "sliding_attention" for t in types)
    elif model_type in ("qwen2", "qwen3"):
        count = max(0, layers - int(config.get("max_window_layers", layers)))
    elif model_type == "gemma2":
        count = (layers + 1) // 2
    elif model_type.startswith("gemma3") or model_type == "cohere2":  # configuration_cohere2.py: pattern 4
        pattern = int(config.get("sliding_window_pattern") or (4 if model_type == "cohere2" else 6))
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


# model_type values transformers implements natively (remote-code configs carry an auto_map and another type).
_NATIVE = {"qwen2", "qwen3", "llama", "mistral", "gemma", "gemma2", "gemma3_text", "phi3", "granite"}


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
    xielu = model_type == "apertus" and str(config.get("hidden_act")) == "xielu"
    return {
        "num_heads": heads,
        "num_kv_heads": kv,
        "head_dim": head_dim,
        "intermediate_size": inter,
        "hidden_act": str(config.get("hidden_activation") or config.get("hidden_act") or "silu"),
        "tie_embeddings": bool(config.get("tie_word_embeddings", _tied_by_default(model_type))),
        "norms_per_layer": 4
        if model_type in ("gemma2", "gemma3_text", "gemma3", "glm4")
        else (1 if model_type in COHERE else 2),
        "linears": _block_linears(config, model_type, h, heads * head_dim, kv * head_dim, inter),
        "mlp": "plain" if model_type in UP_DOWN_MLP else "gated",
        "norm": "layer" if model_type == "nemotron" else ("layer_no_bias" if model_type in COHERE else "rms"),
        "qk_norm_per_head": model_type in COHERE or model_type in FULL_WIDTH_QK_NORM,
        "block_extra_params": 2 if xielu else 0,
    }


# OLMo-2 / OLMo-3 norm q and k over their full width (modeling_olmo2.py: RMSNorm(heads · head_dim) on q_proj's
# output, RMSNorm(kv heads · head_dim) on k_proj's): as many weights as Cohere's per-head q/k norms.
FULL_WIDTH_QK_NORM = ("olmo2", "olmo3")
# Llama-shaped families whose MLP is plain: down_proj(act(up_proj(x))), no gate (modeling_arcee.py, _nemotron.py,
# _apertus.py: ReLU² / xIELU); Nemotron's norms are LayerNorms (weight, bias).
UP_DOWN_MLP = {"arcee", "nemotron", "apertus"}
# Cohere / Cohere2 (modeling_cohere*.py): attention and MLP run in parallel on one `input_layernorm`, a LayerNorm with
# a weight and no bias (CohereLayerNorm ignores its `bias` argument); `use_qk_norm` norms q and k per head.
COHERE = {"cohere", "cohere2"}
# Llama-shaped families whose config class ties the embeddings when config.json does not say (transformers 5.24's
# `tie_word_embeddings: bool = True` in configuration_cohere.py, _cohere2, _ernie4_5, _smollm3; every gemma*).
TIED_BY_DEFAULT = {"cohere", "cohere2", "ernie4_5", "smollm3"}


def _tied_by_default(model_type: str) -> bool:
    return model_type.startswith("gemma") or model_type in TIED_BY_DEFAULT


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


# model_type → its block's shape, for native families whose blocks are not Llama-shaped (fused or differently named
# projections, plain MLPs, LayerNorms, other defaults). Any other model_type is read as Llama-shaped.
NON_LLAMA_BLOCKS = {
    "gpt_neox": _gpt_neox_block,
    "falcon": _falcon_block,
    "phi": _phi_block,
    "starcoder2": _starcoder2_block,
}

# Llama-shaped model types whose block `_llama_block` describes exactly: each one's parameter count equals the
# model transformers 5.24 builds from its config class (tests/memory/test_arch_configs.py, on small configs). Any
# other model_type is read as Llama-shaped too, with a warning (`unchecked_family`): a new family's norms, biases or
# layer kinds (OLMo's parameter-free LayerNorm, StableLM's partial rotary, LFM2's convolutions) are not counted.
CHECKED_LLAMA_SHAPED = frozenset({
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "granite", "cohere", "cohere2",
    "helium", "nemotron", "arcee", "apertus", "ernie4_5", "smollm3", "glm", "glm4", "olmo2", "olmo3", "exaone4",
    "seed_oss",
})  # fmt: skip


def unchecked_family(arch) -> str | None:
    """Why the plan of `arch` may be off (one line), when its model_type is none that lowmem-ft describes exactly."""
    known = CHECKED_LLAMA_SHAPED | set(NON_LLAMA_BLOCKS) | {"qwen", "gemma3", "llama4_text"}
    if arch.model_type in known or arch.experts:
        return None
    return (
        f"model_type {arch.model_type!r} is not a family lowmem-ft has checked; its block is read as Llama's "
        f"({', '.join(lin.name for lin in arch.linears)}, RMSNorms), so norms, biases or layer kinds of its own are "
        "not counted and the plan may be off"
    )


def _block_linears(config: dict[str, Any], model_type: str, h: int, q_out: int, kv_out: int, inter: int):
    """The linear layers of one decoder block, as transformers names them."""
    # Qwen2 puts a bias on q/k/v only; Llama-family `attention_bias` covers q/k/v/o (modeling_llama.py).
    # GLM / GLM-4 too, with `attention_bias` true by default (configuration_glm4.py).
    glm = model_type in ("glm", "glm4")
    qkv_bias = model_type == "qwen2" or bool(config.get("attention_bias", glm))
    o_bias = bool(config.get("attention_bias", False)) and model_type != "qwen2" and not glm
    if model_type == "seed_oss":  # modeling_seed_oss.py: o_proj's bias is its own flag, `attention_out_bias`
        o_bias = bool(config.get("attention_out_bias", False))
    mlp_bias = bool(config.get("mlp_bias", False))
    if model_type == "phi3":  # fused projections (modeling_phi3.py: qkv_proj, gate_up_proj)
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
    if glm:  # modeling_glm4.py: a fused gate_up_proj, no biases in the MLP
        return (*attention, Linear("gate_up_proj", h, 2 * inter), Linear("down_proj", inter, h))
    if model_type in UP_DOWN_MLP:
        return (*attention, Linear("up_proj", h, inter, mlp_bias), Linear("down_proj", inter, h, mlp_bias))
    return (
        *attention,
        Linear("gate_proj", h, inter, mlp_bias),
        Linear("up_proj", h, inter, mlp_bias),
        Linear("down_proj", inter, h, mlp_bias),
    )


def _qwen_v1(config: dict[str, Any], name: str) -> Architecture:
    """Qwen (v1) remote-code blocks (modeling_qwen.py): c_attn = fused qkv with bias, w1/w2 = gate/up of
    intermediate_size // 2 each, mlp c_proj = down; RMSNorm; lm_head untied."""
    h = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("kv_channels") or h // heads)
    ff = int(config["intermediate_size"]) // 2
    proj = heads * head_dim
    return Architecture(
        name=name,
        model_type="qwen",
        vocab_size=int(config["vocab_size"]),
        hidden_size=h,
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=head_dim,
        intermediate_size=ff,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        linears=(
            Linear("c_attn", h, 3 * proj, True),
            Linear("c_proj", proj, h, not config.get("no_bias", True)),
            Linear("w1", h, ff, not config.get("no_bias", True)),
            Linear("w2", h, ff, not config.get("no_bias", True)),
            Linear("c_proj", ff, h, not config.get("no_bias", True)),
        ),
        max_position_embeddings=int(config.get("max_position_embeddings") or config.get("seq_length") or 0),
        remote_code=True,
    )


# -- what a config.json leaves unsaid, and configs that nest the text model ------------------------------------
# model_type → the defaults its transformers 5.24 config class fills in for keys a config.json may omit, where they
# differ from what `_llama_block` and `_sliding` assume (head_dim = hidden / heads, no sliding window, no softcapping).
# Read from each configuration_*.py: `head_dim: int = 128` (Qwen3, GLM, GLM-4, ERNIE 4.5, Seed-OSS, Ministral3,
# Helium, InternLM3) or 256 (every Gemma); `sliding_window: int | None = 4096` (Mistral: every layer; Gemma-2/3,
# Cohere2: by their layer patterns); Gemma-2's softcapping; Cohere's `logit_scale = 0.0625`; Apertus's
# `hidden_act = "xielu"`. Gemma-3's text config lists all of Gemma3TextConfig's shape defaults: a multimodal Gemma-3
# config.json ships a text_config of a few keys.
_HEAD_DIM_128 = ("qwen3", "glm", "glm4", "ernie4_5", "seed_oss", "ministral3", "helium", "internlm3")
CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    **{model_type: {"head_dim": 128} for model_type in _HEAD_DIM_128},
    "gemma": {"head_dim": 256},
    "gemma2": {"head_dim": 256, "sliding_window": 4096, "final_logit_softcapping": 30.0,
               "attn_logit_softcapping": 50.0},
    "gemma3_text": {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072,
                    "sliding_window": 4096},
    "mistral": {"sliding_window": 4096},
    "cohere": {"logit_scale": 0.0625},
    "cohere2": {"sliding_window": 4096, "logit_scale": 0.0625},
    "apertus": {"hidden_act": "xielu"},
}  # fmt: skip
# transformers' SiglipVisionConfig defaults (configuration_siglip.py): Gemma-3's vision_config names only some keys.
SIGLIP_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_channels": 3,
                   "image_size": 224, "patch_size": 16, "vision_use_head": True}  # fmt: skip
# Multimodal model_types whose text model sits in `text_config` and that AutoModelForCausalLM (what lowmem-ft's
# loader calls) cannot build in transformers 5.24: "Unrecognized configuration class ... for AutoModelForCausalLM"
# (checked with `AutoConfig.for_model(t)` → `AutoModelForCausalLM.from_config`).
NOT_CAUSAL_LM = {"mistral3", "llava", "llava_next", "llava_onevision", "qwen2_vl", "qwen2_5_vl", "qwen3_vl",
                 "paligemma", "idefics3", "smolvlm", "aya_vision", "internvl", "glm4v", "cohere2_vision"}  # fmt: skip


def _with_class_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with its config class's defaults for the keys it omits (`CLASS_DEFAULTS`); a key present with
    null stays null (head_dim null is hidden / heads, as in the classes that accept it)."""
    defaults = CLASS_DEFAULTS.get(str(config.get("model_type", "")), {})
    return {**defaults, **config}


def _composite(config: dict[str, Any], name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the text model's config, the tower fields) of a config.json that nests its text model in `text_config`.

    What AutoModelForCausalLM loads decides: Gemma-3 (`gemma3`) → Gemma3ForConditionalGeneration, the text model
    plus the SigLIP vision tower and projector, whose weights are counted (`_gemma3_tower`); the embeddings tie as
    the top-level config says (modeling_utils.py reads `self.config.tie_word_embeddings`; Gemma3Config default
    true). Llama-4 (`llama4`) → Llama4ForCausalLM, the text model alone (a mixture of experts: `_experts`). Anything
    else is refused: the memory model cannot describe what would be loaded.
    """
    wrapper = str(config.get("model_type", ""))
    text = dict(config.get("text_config") or {})
    model = f"model '{name or config.get('_name_or_path', '')}'"
    if wrapper == "gemma3":
        text = {"model_type": "gemma3_text", **text, "tie_word_embeddings": config.get("tie_word_embeddings", True)}
        hidden = int(_with_class_defaults(text)["hidden_size"])
        return text, _gemma3_tower({**SIGLIP_DEFAULTS, **(config.get("vision_config") or {})}, hidden)
    if wrapper == "llama4":
        return {**text, "model_type": text.get("model_type", "llama4_text")}, {}
    if wrapper in NOT_CAUSAL_LM:
        raise UserError(
            f"{model}: model_type {wrapper!r} is a vision-language checkpoint that transformers' "
            "AutoModelForCausalLM (lowmem-ft's loader) cannot load; fine-tune a text-only checkpoint of the model"
        )
    why = {
        "mllama": "its text model interleaves cross-attention layers (cross_attention_layers)",
        "gemma3n": "its text model adds AltUp and per-layer embeddings besides the audio and vision towers",
    }.get(wrapper, "its text model sits in text_config beside weights the memory model does not count")
    raise UserError(
        f"{model}: model_type {wrapper!r} is a multimodal checkpoint lowmem-ft cannot plan ({why}); "
        "fine-tune a text-only checkpoint of the model"
    )


def _gemma3_tower(vision: dict[str, Any], text_hidden: int) -> dict[str, Any]:
    """Gemma-3's vision weights, loaded with the text model and never run by text training: a SigLIP vision model
    (modeling_siglip.py: a patch Conv2d with bias, position embeddings, layers of LayerNorm → q/k/v/out_proj →
    LayerNorm → fc1/fc2, all with biases, a post LayerNorm, and the attention-pooling head when `vision_use_head`)
    and Gemma3MultiModalProjector (a vision × text `mm_input_projection_weight` and an RMSNorm of vision width)."""
    h, inter, layers = int(vision["hidden_size"]), int(vision["intermediate_size"]), int(vision["num_hidden_layers"])
    patch, channels = int(vision["patch_size"]), int(vision["num_channels"])
    patches = (int(vision["image_size"]) // patch) ** 2
    attention = [Linear(n, h, h, True) for n in ("q_proj", "k_proj", "v_proj", "out_proj")]
    mlp = [Linear("fc1", h, inter, True), Linear("fc2", inter, h, True)]
    linears = (attention + mlp) * layers
    norms = (2 * layers + 1) * 2 * h  # layer_norm1/2 per layer, post_layernorm: LayerNorm weight and bias
    params = channels * patch * patch * h + h + patches * h + sum(lin.params for lin in linears) + norms
    if vision.get("vision_use_head", True):  # SiglipMultiheadAttentionPoolingHead: probe, nn.MultiheadAttention
        head_mlp = [Linear("fc1", h, inter, True), Linear("fc2", inter, h, True)]  # (its out_proj a Linear too)
        linears += (Linear("out_proj", h, h, True), *head_mlp)
        params += h + 3 * h * h + 3 * h + sum(lin.params for lin in linears[-3:]) + 2 * h
    params += h * text_hidden + h  # the projector
    return {"tower_params": params, "tower_linears": tuple(linears)}


# -- mixtures of experts ------------------------------------------------------------------------------------------
# transformers 5.24 builds the routed experts of these families as one module holding two 3-D nn.Parameters
# (modeling_mixtral.py MixtralExperts and its copies: gate_up_proj [E, 2·I, h], down_proj [E, h, I]) and the router
# as a module with an [E, h] weight (MixtralTopKRouter; PhiMoE's PhimoeTopKRouter subclasses nn.Linear). Neither is an
# nn.Linear: bitsandbytes' `replace_with_bnb_linear` (integrations/bitsandbytes.py, `type(module) is nn.Linear`)
# leaves them in the compute dtype under 4- and 8-bit loading, so QLoRA quantizes the attention (and Qwen2-MoE's
# shared expert) only. peft matches `target_modules` against modules, so the recipes' Llama names reach the
# experts only where peft 0.21 rewrites them into `target_parameters` (utils/transformers_weight_conversion.py
# `_MOE_TARGET_MODULE_MAPPING`: Mixtral's w1/w2/w3/gate; gate_proj/up_proj/down_proj/gate on the families transformers
# maps to the qwen2_moe pattern: Qwen3-MoE, OLMoE — not Qwen2-MoE itself); "all-linear" reaches them there and every
# nn.Linear router (PhiMoE's). All checked on tiny models (tests/memory/test_moe.py).
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "phimoe")
# Families whose MoE blocks the memory model's activation terms were measured on (devkit/moe_check.py,
# benchmarks/estimator_moe.md): all of MOE_FAMILIES; PhiMoE's (sparsemixer router, LayerNorms) is over-predicted by
# up to 4.3 % of the layers' windows, the others within 1.1 % but for the expert-wide no-checkpointing envelope.
MOE_PLANNED = MOE_FAMILIES
# model_type → the target_modules names peft turns into LoRA on the experts / router parameters (see above).
_PEFT_EXPERT_NAMES = {
    "mixtral": frozenset({"w1", "w2", "w3", "gate"}),
    "qwen3_moe": frozenset({"gate_proj", "up_proj", "down_proj", "gate"}),
    "olmoe": frozenset({"gate_proj", "up_proj", "down_proj", "gate"}),
}

# model_type → `MoE.routing`, read from each family's TopKRouter.forward (modeling_*.py); the Qwen-MoE / OLMoE
# routers depend on the config's `norm_topk_prob`.
_ROUTING = {"mixtral": "fp32_renorm", "granitemoe": "topk_softmax"}


@dataclass(frozen=True)
class MoE:
    """The routed experts of every decoder layer (each layer of the published models of these families is sparse;
    configs that mix dense layers in, `decoder_sparse_step` > 1 or `mlp_only_layers`, list them in `dense_layers`)."""

    experts: int  # E routed experts per layer
    top_k: int  # experts each token goes through (`num_experts_per_tok`)
    intermediate_size: int  # of one expert (Mixtral: `intermediate_size`; Qwen-MoE / OLMoE: `moe_intermediate_size`)
    router: str = "gate"  # the router module's name in the layer's MoE block (Granite-MoE, PhiMoE: "router")
    router_linear: bool = False  # PhiMoE: the router subclasses nn.Linear, so peft's "all-linear" adapts it
    shared_intermediate: int = 0  # Qwen2-MoE: a dense shared expert (nn.Linear gate/up/down_proj) + a 1-wide gate
    extra_norm_params: int = 0  # per layer beyond `Architecture.norm_params` (OLMoE: q/k norms over all heads)
    peft_names: frozenset[str] = frozenset()  # target_modules names peft turns into LoRA on the experts / router
    # how the router hands its top-k weights to the experts: "fp32_renorm" (Mixtral: softmax(logits.float()), the
    # top-k divided by their sum, fp32), "fp32_renorm_cast" (Qwen-MoE / OLMoE with `norm_topk_prob`, then cast to the
    # compute dtype), "cast" (the same without renormalizing), "topk_softmax" (Granite-MoE: softmax of the top-k
    # logits only, cast)
    routing: str = "cast"
    router_logits_kept: bool = False  # `output_router_logits`: every layer's [tokens, E] logits kept for the aux loss
    # layers with a dense MLP instead (Qwen-MoE `decoder_sparse_step` / `mlp_only_layers`): counted as sparse here,
    # so the planner refuses such a config (lowmem_ft.planning); training and generation read it as is
    dense_layers: tuple[int, ...] = ()

    def expert_params(self, hidden: int) -> int:
        """One layer's expert weights: gate_up_proj E × 2I × h and down_proj E × h × I."""
        return 3 * self.experts * self.intermediate_size * hidden

    def layer_params(self, hidden: int) -> int:
        """What a layer holds beyond `Architecture.block_params`: the experts, the router (E × h), extra norms."""
        return self.expert_params(hidden) + self.experts * hidden + self.extra_norm_params

    def adapted_parameters(self, target_modules: list[str]) -> list[str]:
        """The expert / router parameters peft adapts for these `target_modules` (peft `target_parameters`); []
        when LoRA stays on nn.Linear modules."""
        if target_modules == ["all-linear"]:
            names = ["experts", self.router] if self.peft_names else ([self.router] if self.router_linear else [])
            return names
        hit = set(target_modules) & self.peft_names
        experts = ["experts"] if hit - {"gate"} else []
        return experts + ([self.router] if "gate" in hit else [])


def _moe_architecture(cls, config: dict[str, Any], name: str, model_type: str) -> Architecture:
    """A mixture of experts of one of MOE_FAMILIES, as transformers 5.24 builds it: the Llama-shaped attention and
    norms (`_llama_block`; Qwen2-MoE's q/k/v bias is `qkv_bias`, default true; PhiMoE's norms are LayerNorms),
    `MoE` for the routed experts, Qwen2-MoE's shared expert among the block's linears. Parameter counts equal
    transformers' model from the same config (tests/memory/test_arch.py)."""
    layers = int(config["num_hidden_layers"])
    sparse_step = int(config.get("decoder_sparse_step") or 1)
    dense_layers = [i for i in range(layers) if i in (config.get("mlp_only_layers") or []) or (i + 1) % sparse_step]
    h = int(config["hidden_size"])
    experts = int(config.get("num_local_experts") or config.get("num_experts") or 0)
    per_token = int(config.get("num_experts_per_tok") or 0)
    inter = int(config.get("moe_intermediate_size") or config["intermediate_size"])
    shape = _llama_block({**config, "intermediate_size": inter}, model_type)
    heads, kv, head_dim = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
    qkv_bias = bool(config.get("qkv_bias", True)) if model_type == "qwen2_moe" else bool(config.get("attention_bias"))
    o_bias = model_type != "qwen2_moe" and bool(config.get("attention_bias"))
    linears = [
        Linear("q_proj", h, heads * head_dim, qkv_bias),
        Linear("k_proj", h, kv * head_dim, qkv_bias),
        Linear("v_proj", h, kv * head_dim, qkv_bias),
        Linear("o_proj", heads * head_dim, h, o_bias),
    ]
    shared = 0
    if model_type == "qwen2_moe":  # modeling_qwen2_moe.py Qwen2MoeSparseMoeBlock: shared_expert + shared_expert_gate
        shared = int(config.get("shared_expert_intermediate_size") or 0)
        linears += [Linear("gate_proj", h, shared), Linear("up_proj", h, shared), Linear("down_proj", shared, h)]
        linears.append(Linear("shared_expert_gate", h, 1))
    moe = MoE(
        experts=experts,
        top_k=per_token,
        intermediate_size=inter,
        router="router" if model_type in ("granitemoe", "phimoe") else "gate",
        router_linear=model_type == "phimoe",
        shared_intermediate=shared,
        # modeling_olmoe.py: q_norm over hidden_size, k_norm over the k/v width (not head_dim as Qwen3's)
        extra_norm_params=(h + kv * head_dim - 2 * head_dim) if model_type == "olmoe" else 0,
        peft_names=_PEFT_EXPERT_NAMES.get(model_type, frozenset()),
        routing=_ROUTING.get(model_type) or ("fp32_renorm_cast" if config.get("norm_topk_prob") else "cast"),
        router_logits_kept=bool(config.get("output_router_logits")),
        dense_layers=tuple(dense_layers),
    )
    shape.update(
        linears=tuple(linears),
        intermediate_size=shared or inter,
        norm="layer" if model_type == "phimoe" else "rms",  # modeling_phimoe.py: nn.LayerNorm (weight and bias)
    )
    return cls(
        name=name or str(config.get("_name_or_path", "")),
        model_type=model_type,
        vocab_size=int(config["vocab_size"]),
        hidden_size=h,
        num_layers=layers,
        qk_norm=model_type in ("qwen3_moe", "olmoe"),
        **shape,
        max_position_embeddings=int(config.get("max_position_embeddings") or 0),
        **_sliding(config, "qwen2" if model_type.startswith("qwen") else model_type),
        logit_scale=_logit_scale(config),
        remote_code=False,
        experts=experts,
        lm_head_bias=model_type == "phimoe" and bool(config.get("lm_head_bias")),
        moe=moe,
    )


# -- finding the config -----------------------------------------------------------------------------------------
@cache
def catalog() -> dict[str, dict[str, Any]]:
    """The offline catalog: hub id → {"config": ..., "published_params": ...}."""
    return json.loads(CATALOG.read_text(encoding="utf-8"))["models"]


def catalog_entry(name: str) -> tuple[str, dict[str, Any]] | None:
    """The catalog entry of a hub id, case-insensitively, with instruct/chat variants mapped to their base."""
    by_lower = {key.lower(): key for key in catalog()}
    key = name.strip().lower()
    bases = [key[: -len(s)] for s in VARIANT_SUFFIXES if key.endswith(s)]
    candidates = [key, *bases, *(b + "-pt" for b in bases)]  # Gemma names its base checkpoints -pt
    for candidate in candidates:
        if candidate in by_lower:
            real = by_lower[candidate]
            return real, catalog()[real]
    return None


def _hub_config(name: str) -> dict[str, Any]:
    """config.json from the Hub (only that file); a UserError when offline or unreachable."""
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    known = ", ".join(sorted(catalog()))
    if offline:
        raise UserError(
            f"model '{name}' is not a local directory nor in the offline catalog, and HF_HUB_OFFLINE is set; "
            f"pass a local directory with config.json or one of: {known}"
        )
    try:
        from huggingface_hub import hf_hub_download

        path = hf_hub_download(name, "config.json")
    except Exception as exc:  # network, auth, missing repo: all mean "no config"
        raise UserError(
            f"model '{name}': could not fetch its config.json from the Hub ({type(exc).__name__}); "
            f"pass a local directory with config.json or one of: {known}"
        ) from None
    return json.loads(Path(path).read_text(encoding="utf-8"))


def load_config_dict(name_or_path: str) -> tuple[dict[str, Any], str]:
    """(config dict, where it came from): a local directory, else the catalog, else the Hub."""
    if not name_or_path:
        raise UserError("no model given; pass --model HUB_ID_OR_PATH")
    path = Path(name_or_path)
    if path.is_dir():
        config_file = path / "config.json"
        if not config_file.is_file():
            raise UserError(f"model directory {path} has no config.json")
        try:
            return json.loads(config_file.read_text(encoding="utf-8")), f"{config_file}"
        except json.JSONDecodeError as exc:
            raise UserError(f"{config_file}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    entry = catalog_entry(name_or_path)
    if entry is not None:
        return entry[1]["config"], f"offline catalog ({entry[0]})"
    return _hub_config(name_or_path), "Hub config.json"


def load_architecture(name_or_path: str, trust_remote_code: bool = False) -> Architecture:
    """The architecture of a model by local directory, catalog id or Hub id.

    Remote-code architectures (e.g. Qwen/Qwen-7B) are described from their config alone, which runs no code, so
    `trust_remote_code` is not needed to plan; it is accepted so callers can pass the recipe's value through.
    """
    del trust_remote_code  # reading config.json runs no repository code
    config, _ = load_config_dict(name_or_path)
    arch = Architecture.from_config(config, name=name_or_path)
    why = unchecked_family(arch)
    if why and first_time("unchecked family", arch.model_type):
        log.warning(why)
    if Path(name_or_path).is_dir() and not arch.remote_code and not arch.experts:
        from lowmem_ft.memory.layout import warn_if_mismatched

        warn_if_mismatched(arch, Path(name_or_path))
    return arch
