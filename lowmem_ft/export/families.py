"""What each model family's GGUF looks like: one record per family, the registry `FAMILIES` keyed by the
transformers `model_type`s it covers.

A record holds what llama.cpp's `convert_hf_to_gguf.py` does differently for that family — the GGUF architecture
name, a row permutation of the q/k projections (llama.cpp's `LlamaModel.permute`: its rotary code pairs dimension i
with i + d/2 interleaved, transformers' with i + d/2 in halves), an offset added to RMSNorm weights (Gemma stores
`w` and computes `x·(1 + w)`; llama.cpp expects `1 + w` stored, `Gemma2Model.modify_tensors`) — and the architecture
keys it writes beyond the common ones. Tensor names come from the `gguf` package's own map
(`gguf.get_tensor_name_map`), the one llama.cpp's converter and transformers' GGUF loader both use, so no name
table is kept here.

A `model_type` without a record is refused in one line naming it (`family_of`). A vision-language checkpoint
whose text decoder is one of these families (Gemma-3 4B and up) is exported as that decoder (`text_decoder`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lowmem_ft.errors import UserError


@dataclass(frozen=True)
class GgufFamily:
    """How one model family is written to GGUF (module docstring)."""

    name: str
    model_types: tuple[str, ...]  # transformers config.model_type values this record covers
    arch: str  # GGUF general.architecture (a gguf.MODEL_ARCH_NAMES value)
    permute_qk: bool = False  # llama.cpp's LlamaModel.permute on q_proj / k_proj rows
    norm_offset: float = 0.0  # added to every *norm.weight (Gemma: llama.cpp stores 1 + w)
    extra_keys: Callable[[Any, Any], None] = field(default=lambda writer, config: None)  # family-specific metadata
    note: str = ""

    def transform(self, name: str, config) -> Callable | None:
        """A function of the full fp32 tensor `name` needs before writing (a row permutation), or None."""
        if not self.permute_qk or not name.endswith(("q_proj.weight", "k_proj.weight")):
            return None
        heads = config.num_attention_heads
        if name.endswith("k_proj.weight"):
            heads = getattr(config, "num_key_value_heads", None) or heads
        return lambda w: permute_rotary(w, heads)

    def offset(self, name: str) -> float:
        return self.norm_offset if name.endswith("norm.weight") else 0.0


def permute_rotary(weight, heads: int):
    """llama.cpp's `LlamaModel.permute`: per head, rows (0, d/2, 1, d/2+1, ...) become (0, 1, 2, ...)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_theta(config, layer_type: str = "full_attention") -> float | None:
    """The RoPE base of `layer_type`'s layers: `rope_theta`, or transformers 5's `rope_parameters`, flat or — for
    models whose sliding-window layers rotate at another base (Gemma-3: 1e6 global, 1e4 local) — per layer type."""
    theta = getattr(config, "rope_theta", None)
    if theta:
        return float(theta)
    parameters = getattr(config, "rope_parameters", None) or {}
    if layer_type in parameters:
        parameters = parameters[layer_type] or {}
    elif "full_attention" in parameters:  # per layer type, but not this one
        return None
    return parameters.get("rope_theta")


def _rope_scaling(config) -> dict:
    scaling = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    return dict(scaling)


def _llama(writer, config) -> None:
    """Llama-3.x RoPE scaling is a tensor in llama.cpp (`rope_freqs.weight`, written by `gguf_file`), not keys."""
    writer.add_rope_dimension_count(head_dim(config))


def _qwen3(writer, config) -> None:
    writer.add_key_length(head_dim(config))
    writer.add_value_length(head_dim(config))


def _gemma2(writer, config) -> None:
    # llama.cpp Gemma2Model.set_gguf_parameters
    writer.add_key_length(head_dim(config))
    writer.add_value_length(head_dim(config))
    writer.add_attn_logit_softcapping(config.attn_logit_softcapping or 0.0)
    writer.add_final_logit_softcapping(config.final_logit_softcapping or 0.0)
    writer.add_sliding_window(config.sliding_window)


def _gemma3(writer, config) -> None:
    # llama.cpp Gemma3Model.set_gguf_parameters: the sliding-window layers as a per-layer pattern
    writer.add_key_length(head_dim(config))
    writer.add_value_length(head_dim(config))
    writer.add_sliding_window(config.sliding_window)
    types = getattr(config, "layer_types", None)
    if types:
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in types])
    local = rope_theta(config, "sliding_attention") or getattr(config, "rope_local_base_freq", None)
    if local:  # llama.cpp's Gemma3 defaults the sliding layers' base to 1e4, the global ones' to rope.freq_base
        writer.add_rope_freq_base_swa(local)
    if getattr(config, "final_logit_softcapping", None):
        writer.add_final_logit_softcapping(config.final_logit_softcapping)


def _phi3(writer, config) -> None:
    # llama.cpp Phi3MiniModel.set_gguf_parameters
    writer.add_rope_dimension_count(head_dim(config))
    original = getattr(config, "original_max_position_embeddings", None)
    if original:
        writer.add_rope_scaling_orig_ctx_len(original)
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)


def _granite(writer, config) -> None:
    """llama.cpp's GraniteModel.set_gguf_parameters: a Llama with its four multipliers as GGUF scales."""
    writer.add_rope_dimension_count(head_dim(config))
    for key, add in (("attention_multiplier", writer.add_attention_scale),
                     ("embedding_multiplier", writer.add_embedding_scale),
                     ("residual_multiplier", writer.add_residual_scale),
                     ("logits_scaling", writer.add_logit_scale)):  # fmt: skip
        if getattr(config, key, None):
            add(float(getattr(config, key)))


FAMILIES_LIST = [
    GgufFamily("llama", ("llama",), "llama", permute_qk=True, extra_keys=_llama),
    # llama.cpp converts Mistral (v0.1-v0.3 shapes) as a Llama; transformers' loader reads it back as mistral when
    # general.name says "mistral" (modeling_gguf_pytorch_utils.load_gguf_checkpoint)
    GgufFamily("mistral", ("mistral",), "llama", permute_qk=True, extra_keys=_llama),
    GgufFamily("qwen2", ("qwen2",), "qwen2"),
    GgufFamily("qwen3", ("qwen3",), "qwen3", extra_keys=_qwen3),
    GgufFamily("gemma2", ("gemma2",), "gemma2", norm_offset=1.0, extra_keys=_gemma2),
    GgufFamily("gemma3", ("gemma3_text",), "gemma3", norm_offset=1.0, extra_keys=_gemma3),
    GgufFamily("phi3", ("phi3",), "phi3", extra_keys=_phi3),
    # IBM Granite 3.x: llama.cpp's GraniteModel is its LlamaModel (q/k permuted) plus the multipliers
    GgufFamily("granite", ("granite",), "granite", permute_qk=True, extra_keys=_granite),
]
FAMILIES: dict[str, GgufFamily] = {t: f for f in FAMILIES_LIST for t in f.model_types}


def family_of(config) -> GgufFamily:
    """The record for `config.model_type`, or one line naming it and the families that export."""
    model_type = config.model_type
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    known = ", ".join(sorted(FAMILIES))
    raise UserError(
        f"GGUF export has no tensor mapping for model_type {model_type!r}; it maps {known}. "
        f"Merge it with `lowmem-ft merge` and convert with llama.cpp's convert_hf_to_gguf.py"
    )
