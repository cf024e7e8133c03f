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
from dataclasses import dataclass, field, fields
from functools import cache
from pathlib import Path
from typing import Any, Literal

from lowmem_ft.console import first_time
from lowmem_ft.errors import UserError
from lowmem_ft.memory.blocks import (
    BUILDERS,
    Linear,
    _experts,
    _llama_block,
    _logit_scale,
    _sliding,
    _with_class_defaults,
)
from lowmem_ft.memory.families import FAMILIES, family, with_flag
from lowmem_ft.memory.vision import VisionTower, qwen2_5_vl_tower, qwen2_vl_tower, qwen3_vl_tower
from lowmem_ft.memory.vision_towers import VIT_TOWERS, ViTTower, gemma3_tower
from lowmem_ft.native import conversion_for

log = logging.getLogger(__name__)
CATALOG = Path(__file__).resolve().parents[1] / "catalog" / "models.json"
# Fused projection → the separate projections it replaces (transformers' modeling_phi3.py).
FUSED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# The family tables the rest of the package reads, derived from the one record per family
# (`lowmem_ft.memory.families`): model_type → why transformers 5.24 refuses `attn_implementation="sdpa"` (those
# models train with eager attention); the model_types whose logits `memory.chunked_loss` reproduces exactly (checked
# against the model's own loss and gradients on the zoo, tests/train/test_losses.py; refused on any other).
NO_SDPA = {t: f.no_sdpa for t, f in FAMILIES.items() if f.no_sdpa}
CHUNKED_LOSS_VERIFIED = with_flag("chunked_loss_verified")
# Suffixes of fine-tuned variants that keep the base model's architecture (Qwen2.5-7B-Instruct = Qwen2.5-7B,
# gemma-3-1b-it = gemma-3-1b-pt).
VARIANT_SUFFIXES = ("-instruct", "-chat", "-it")


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
    # a tower run on images (`lowmem_ft.memory.vision`: the Qwen-VL towers; `lowmem_ft.memory.vision_towers`: one
    # `ViTTower` for Gemma-3, Idefics3 / SmolVLM, LLaVA, LLaVA-OneVision): its per-patch costs
    vision: VisionTower | ViTTower | None = None
    moe: MoE | None = None  # the routed experts of a mixture of experts this memory model counts (see `MoE`)

    @classmethod
    def from_config(cls, config: dict[str, Any], name: str = "") -> Architecture:
        """The architecture of a config.json dict; raises UserError for shapes this model cannot describe."""
        tower: dict[str, Any] = {}
        config = native_config(config, name)
        if ("text_config" in config and "hidden_size" not in config) or config.get("model_type") in NOT_CAUSAL_LM:
            config, tower = _composite(config, name)  # Qwen2-VL's config.json keeps the text fields at its top
        config = _with_class_defaults(config)
        model_type = str(config.get("model_type", ""))
        needed = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"]
        rule = family(model_type)
        if rule.block in ("llama", "moe"):  # the other builders default or derive the MLP width
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
        if rule.block == "moe":
            return _moe_architecture(cls, config, name, model_type)
        shape = BUILDERS[rule.block](config) if rule.block in BUILDERS else _llama_block(config, model_type)
        return cls(
            name=name or str(config.get("_name_or_path", "")),
            model_type=model_type,
            vocab_size=int(config["vocab_size"]),
            hidden_size=int(config["hidden_size"]),
            num_layers=int(config["num_hidden_layers"]),
            qk_norm=rule.qk_norm == "always" or (rule.qk_norm == "use_qk_norm" and bool(config.get("use_qk_norm"))),
            **shape,
            max_position_embeddings=int(config.get("max_position_embeddings") or 0),
            **_sliding(config, model_type),
            attn_logit_softcapping=config.get("attn_logit_softcapping"),
            norm_fp32_output=rule.norm_fp32_output,
            final_logit_softcapping=config.get("final_logit_softcapping"),
            logit_scale=_logit_scale(config),
            remote_code="auto_map" in config and not rule.native,
            experts=_experts(config),
            **tower,
        )

    # -- what the training path may use on this architecture ------------------------------------------------------
    @property
    def chunked_loss_refusal(self) -> str | None:
        """Why `memory.chunked_loss` is refused here (one line), or None when it reproduces the model's own loss."""
        # the towers run on images refuse it (not checked against these models' loss); Gemma-3's is the exception
        # both lines of work kept: its text training is the verified gemma3_text loss, as before its tower was priced
        image_tower = self.vision is not None and getattr(self.vision, "family", "") != "gemma3"
        if self.remote_code or self.model_type not in CHUNKED_LOSS_VERIFIED or image_tower:
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

    def __hash__(self) -> int:
        """Hashed once per object: the model terms cached by architecture (`functools.cache`) hash it in every
        estimate, and the dataclass's own hash walks every field and linear each time (a third of a plan's time)."""
        if (cached := self.__dict__.get("_hash")) is None:
            cached = hash(tuple(getattr(self, f.name) for f in fields(self)))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the cached hash: another process hashes its strings with another seed."""
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    @property
    def linear_names(self) -> list[str]:
        return list(dict.fromkeys(lin.name for lin in self.linears))

    def lora_targets(self, target_modules: list[str] | tuple[str, ...]) -> list[Linear]:
        """Block linears a LoRA `target_modules` list matches (peft matches the last name component). Names of
        projections this architecture fuses stand for the fused one: q/k/v_proj → Phi-3's qkv_proj, gate/up_proj →
        gate_up_proj, so the recipes' Llama-style list adapts the same layers on every family."""
        return list(_lora_targets(self, tuple(target_modules)))

    def adapter_modules(self, target_modules: list[str]) -> list[str]:
        """The module names a LoRA `target_modules` list adapts on this architecture (see `lora_targets`)."""
        return list(dict.fromkeys(lin.name for lin in self.lora_targets(target_modules)))

    def summary(self) -> str:
        gqa = f", GQA {self.num_heads}/{self.num_kv_heads}" if self.num_kv_heads != self.num_heads else ""
        tied = ", tied embeddings" if self.tie_embeddings else ""
        tower = (
            f", {self.tower_params / 1e9:.2f}B of them a vision tower "
            f"({'run frozen on image data' if self.vision else 'loaded, not run'})"
            if self.tower_params
            else ""
        )
        return (
            f"{self.name or self.model_type}: {self.total_params / 1e9:.2f}B params, {self.num_layers} layers, "
            f"hidden {self.hidden_size}, vocab {self.vocab_size}{gqa}{tied}{tower}"
        )


# model_type → its block's builder, for native families whose blocks are not Llama-shaped; Llama-shaped model types
# whose block `blocks._llama_block` describes exactly (each one's parameter count equals the model transformers 5.24
# builds from its config class: tests/memory/test_arch_configs.py). Any other model_type is read as Llama-shaped
# too, with a warning (`unchecked_family`): a new family's norms, biases or layer kinds are not counted.
NON_LLAMA_BLOCKS = {t: BUILDERS[f.block] for t, f in FAMILIES.items() if f.block in BUILDERS}
CHECKED_LLAMA_SHAPED = frozenset(t for t, f in FAMILIES.items() if f.checked and f.block == "llama")
CLASS_DEFAULTS = {t: dict(f.class_defaults) for t, f in FAMILIES.items() if f.class_defaults}


def unchecked_family(arch) -> str | None:
    """Why the plan of `arch` may be off (one line), when its model_type is none that lowmem-ft describes exactly."""
    rule = FAMILIES.get(arch.model_type)
    if (rule and (rule.checked or rule.described)) or arch.experts:
        return None
    kind = f"model_type {arch.model_type!r}" if arch.model_type else "a config.json without model_type"
    return (
        f"{kind} is not a family lowmem-ft has checked; its block is read as Llama's "
        f"({', '.join(lin.name for lin in arch.linears)}, RMSNorms), so norms, biases or layer kinds of its own are "
        "not counted and the plan may be off"
    )


# -- configs that nest the text model -------------------------------------------------------------------------------
# Multimodal model_types whose text model sits in `text_config` and that AutoModelForCausalLM (what lowmem-ft's
# loader calls) cannot build in transformers 5.24: "Unrecognized configuration class ... for AutoModelForCausalLM"
# (checked with `AutoConfig.for_model(t)` → `AutoModelForCausalLM.from_config`).
NOT_CAUSAL_LM = {"mistral3", "llava", "llava_next", "llava_onevision", "qwen2_vl", "qwen2_5_vl", "qwen3_vl",
                 "paligemma", "idefics3", "smolvlm", "aya_vision", "internvl", "glm4v", "cohere2_vision"}  # fmt: skip


# model_type → its vision tower's count (`lowmem_ft.memory.vision`); the decoder is `<model_type>_text`
QWEN_VL_TOWERS = {"qwen2_vl": qwen2_vl_tower, "qwen2_5_vl": qwen2_5_vl_tower, "qwen3_vl": qwen3_vl_tower}


def _composite(config: dict[str, Any], name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the text model's config, the tower fields) of a config.json that nests its text model in `text_config`.

    What AutoModelForCausalLM loads decides: Gemma-3 (`gemma3`) → Gemma3ForConditionalGeneration, the text model
    plus the SigLIP vision tower and projector, whose weights are counted (`memory.vision_towers.gemma3_tower`); the
    embeddings tie as the top-level config says (modeling_utils.py reads `self.config.tie_word_embeddings`;
    Gemma3Config default true). Llama-4 (`llama4`) → Llama4ForCausalLM, the text model alone (a mixture of experts: `_experts`). Anything
    else is refused: the memory model cannot describe what would be loaded.
    """
    wrapper = str(config.get("model_type", ""))
    text = dict(config.get("text_config") or {})
    model = f"model '{name or config.get('_name_or_path', '')}'"
    if wrapper == "gemma3":
        text = {"model_type": "gemma3_text", **text, "tie_word_embeddings": config.get("tie_word_embeddings", True)}
        hidden = int(_with_class_defaults(text)["hidden_size"])
        tokens = int(config.get("mm_tokens_per_image") or 256)  # Gemma3Config's default
        return text, gemma3_tower(dict(config.get("vision_config") or {}), hidden, tokens)
    if wrapper in QWEN_VL_TOWERS:  # Qwen2/2.5-VL's Hub config.json keeps the text fields at its top; Qwen3-VL nests
        text = {**{k: v for k, v in config.items() if k not in ("vision_config", "text_config")}, **text}
        text = {
            **text,
            "model_type": f"{wrapper}_text",
            "tie_word_embeddings": config.get("tie_word_embeddings", False),
        }
        hidden = int(_with_class_defaults(text)["hidden_size"])
        return text, QWEN_VL_TOWERS[wrapper](dict(config.get("vision_config") or {}), hidden)
    if wrapper in VIT_TOWERS:  # Idefics3 / SmolVLM, LLaVA(-OneVision): a Llama / Qwen2 decoder in text_config
        reader, text_type = VIT_TOWERS[wrapper]
        text = {"model_type": text_type, **text, "tie_word_embeddings": config.get("tie_word_embeddings", False)}
        hidden = int(_with_class_defaults(text)["hidden_size"])
        return text, reader(config, hidden)
    if wrapper == "llama4":
        return {**text, "model_type": text.get("model_type", "llama4_text")}, {}
    if wrapper in NOT_CAUSAL_LM:
        raise UserError(
            f"{model}: model_type {wrapper!r} is a vision-language checkpoint that transformers' "
            "AutoModelForCausalLM (lowmem-ft's loader) cannot load; fine-tune a text-only checkpoint of the model"
        )
    why = {
        "mllama": "Llama-3.2-Vision: its text model interleaves cross-attention layers (cross_attention_layers) that "
        "read the image features beside the sequence, not image tokens in it, which the image-token plan cannot "
        "describe",
        "gemma3n": "its text model adds AltUp and per-layer embeddings besides the audio and vision towers",
    }.get(wrapper, "its text model sits in text_config beside weights the memory model does not count")
    raise UserError(
        f"{model}: model_type {wrapper!r} is a multimodal checkpoint lowmem-ft cannot plan ({why}); "
        "fine-tune a text-only checkpoint of the model"
    )


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
MOE_FAMILIES = tuple(t for t, f in FAMILIES.items() if f.block == "moe")
# Families whose MoE blocks the memory model's activation terms were measured on (devkit/harness/moe.py,
# benchmarks/estimator_moe.md): all of MOE_FAMILIES; PhiMoE's (sparsemixer router, LayerNorms) is over-predicted by
# up to 4.3 % of the layers' windows, the others within 1.1 % but for the expert-wide no-checkpointing envelope.
MOE_PLANNED = MOE_FAMILIES


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
    # so the planner refuses such a config (lowmem_ft.choosing); training and generation read it as is
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
    rule = family(model_type)
    qkv_bias = bool(config.get("qkv_bias", True)) if rule.shared_expert else bool(config.get("attention_bias"))
    o_bias = not rule.shared_expert and bool(config.get("attention_bias"))
    linears = [
        Linear("q_proj", h, heads * head_dim, qkv_bias),
        Linear("k_proj", h, kv * head_dim, qkv_bias),
        Linear("v_proj", h, kv * head_dim, qkv_bias),
        Linear("o_proj", heads * head_dim, h, o_bias),
    ]
    shared = 0
    if rule.shared_expert:  # modeling_qwen2_moe.py Qwen2MoeSparseMoeBlock: shared_expert + shared_expert_gate
        shared = int(config.get("shared_expert_intermediate_size") or 0)
        linears += [Linear("gate_proj", h, shared), Linear("up_proj", h, shared), Linear("down_proj", shared, h)]
        linears.append(Linear("shared_expert_gate", h, 1))
    moe = MoE(
        experts=experts,
        top_k=per_token,
        intermediate_size=inter,
        router=rule.router,
        router_linear=rule.router_linear,
        shared_intermediate=shared,
        # modeling_olmoe.py: q_norm over hidden_size, k_norm over the k/v width (not head_dim as Qwen3's)
        extra_norm_params=(h + kv * head_dim - 2 * head_dim) if rule.moe_wide_qk_norm else 0,
        peft_names=rule.peft_expert_names,
        routing=rule.routing or ("fp32_renorm_cast" if config.get("norm_topk_prob") else "cast"),
        router_logits_kept=bool(config.get("output_router_logits")),
        dense_layers=tuple(dense_layers),
    )
    shape.update(
        linears=tuple(linears),
        intermediate_size=shared or inter,
        norm=rule.norm,  # PhiMoE: nn.LayerNorm (weight and bias)
    )
    return cls(
        name=name or str(config.get("_name_or_path", "")),
        model_type=model_type,
        vocab_size=int(config["vocab_size"]),
        hidden_size=h,
        num_layers=layers,
        qk_norm=rule.qk_norm == "always",
        **shape,
        max_position_embeddings=int(config.get("max_position_embeddings") or 0),
        **_sliding(config, model_type),
        logit_scale=_logit_scale(config),
        remote_code=False,
        experts=experts,
        lm_head_bias=rule.lm_head_bias_flag and bool(config.get("lm_head_bias")),
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


def native_config(config: dict[str, Any], name: str = "") -> dict[str, Any]:
    """The config of the native architecture a checkpoint loads as: itself, or for a checkpoint that ships its own
    code but maps onto a native model (Qwen v1, `lowmem_ft.native`), the native model's config."""
    conversion = conversion_for(config)
    return conversion.native_config(config, name) if conversion else config


def load_config_dict(name_or_path: str) -> tuple[dict[str, Any], str]:
    """(config dict, where it came from): a local directory, else the catalog, else the Hub — as the native
    architecture it loads as (`native_config`)."""
    config, source = _raw_config_dict(name_or_path)
    conversion = conversion_for(config)
    if conversion is None:
        return config, source
    native = conversion.native_model_type
    if first_time("native checkpoint", name_or_path):
        log.info("%s: a %s checkpoint, planned and loaded as transformers' %s (none of its own code is run)",
                 name_or_path, conversion.family, native)  # fmt: skip
    return conversion.native_config(config, name_or_path), f"{source}, {conversion.family} loaded as {native}"


def _raw_config_dict(name_or_path: str) -> tuple[dict[str, Any], str]:
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


@cache
def _lora_targets(arch: Architecture, target_modules: tuple[str, ...]) -> tuple[Linear, ...]:
    """`Architecture.lora_targets`, once per architecture and list (the planner asks for it in every estimate)."""
    if target_modules == ("all-linear",):
        return arch.linears
    wanted = set(target_modules)
    present = set(arch.linear_names)
    for fused, parts in FUSED_PROJECTIONS.items():
        if fused in present and wanted & set(parts):
            wanted.add(fused)
    return tuple(lin for lin in arch.linears if lin.name in wanted)
