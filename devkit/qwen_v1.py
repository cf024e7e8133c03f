"""A tiny Qwen (v1) checkpoint laid out as the Hub ships `Qwen/Qwen-7B-Chat`: for the zoo's `qwen-v1` family.

What a user downloads, at zoo size: config.json with `model_type: qwen` and its `auto_map` to the repository's
code, the v1 tensor names (`transformer.h.N.attn.c_attn` fused q/k/v with bias, `mlp.w1` / `w2` / `c_proj`, `ln_1`,
`ln_2`, `ln_f`, `wte`, untied `lm_head`), `qwen.tiktoken` (base64 token bytes and rank per line, the specials not in
it), tokenizer_config.json naming `QWenTokenizer` through `auto_map` and no chat template, and generation_config.json
with `chat_format: chatml`. The repository's Python files are present, as in a download, but each raises on
import: lowmem-ft must never import them, and a test that did would fail.

The tokenizer is a byte-level BPE trained on the zoo corpus with Qwen's own pre-tokenization pattern, written as
tiktoken ranks (the 256 bytes, then each merge's token by merge order) — the format of the published file, at a
size a test can train on. The model is a native Qwen2 of the zoo's width whose tensors are written under v1 names;
loading it back through `lowmem_ft.native` must give the same model, and `tests/native/test_qwen_v1.py` checks the
loaded model against an independent implementation of the v1 block over the v1 tensors.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from devkit.tiny import corpus
from lowmem_ft.native import qwen_v1

POISON = 'raise ImportError("lowmem-ft must not import the repository\'s own code ({})")\n'
CODE_FILES = ("configuration_qwen.py", "modeling_qwen.py", "tokenization_qwen.py", "qwen_generation_utils.py")


def train_ranks(vocab_size: int = 640, extra: list[str] | None = None) -> dict[bytes, int]:
    """Token bytes → rank of a byte-level BPE trained on the zoo corpus (and `extra` texts) with Qwen (v1)'s
    pattern."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(qwen_v1.PAT_STR), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([*corpus(), *(extra or [])], trainer=trainer)
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    ranks = {bytes([b]): b for b in range(256)}
    for merge in json.loads(tok.to_str())["model"]["merges"]:
        left, right = merge if isinstance(merge, list) else merge.split(" ")
        token = bytes(byte_of[c] for c in left + right)
        ranks.setdefault(token, len(ranks))
    return ranks


def tiktoken_file(ranks: dict[bytes, int]) -> str:
    return "".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in sorted(ranks.items(), key=lambda kv: kv[1]))


def v1_config(native: Any) -> dict[str, Any]:
    """Qwen-7B-Chat's config.json keys at the native config's sizes."""
    return {
        "architectures": ["QWenLMHeadModel"],
        "auto_map": {
            "AutoConfig": "configuration_qwen.QWenConfig",
            "AutoModelForCausalLM": "modeling_qwen.QWenLMHeadModel",
        },
        "attn_dropout_prob": 0.0,
        "bf16": False,
        "emb_dropout_prob": 0.0,
        "fp16": False,
        "fp32": False,
        "hidden_size": native.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": 2 * native.intermediate_size,
        "kv_channels": native.hidden_size // native.num_attention_heads,
        "layer_norm_epsilon": native.rms_norm_eps,
        "max_position_embeddings": 32768,
        "model_type": "qwen",
        "no_bias": True,
        "num_attention_heads": native.num_attention_heads,
        "num_hidden_layers": native.num_hidden_layers,
        "onnx_safe": None,
        "rotary_emb_base": native.rope_parameters["rope_theta"],
        "rotary_pct": 1.0,
        "scale_attn_weights": True,
        "seq_length": native.max_position_embeddings,
        "softmax_in_fp32": False,
        "tie_word_embeddings": False,
        "tokenizer_class": "QWenTokenizer",
        "transformers_version": "4.32.0",
        "use_cache": True,
        "use_cache_kernel": False,
        "use_cache_quantization": False,
        "use_dynamic_ntk": True,
        "use_flash_attn": "auto",
        "use_logn_attn": True,
        "vocab_size": native.vocab_size,
    }


def v1_state_dict(native_state: dict[str, Any]) -> dict[str, Any]:
    """The native Qwen2 tensors under Qwen (v1)'s names (q, k, v fused back into c_attn)."""
    import torch

    out: dict[str, Any] = {}
    renames = [
        ("model.embed_tokens.", "transformer.wte."),
        ("model.norm.", "transformer.ln_f."),
        ("model.layers.", "transformer.h."),
        (".input_layernorm.", ".ln_1."),
        (".post_attention_layernorm.", ".ln_2."),
        (".self_attn.o_proj.", ".attn.c_proj."),
        (".mlp.up_proj.", ".mlp.w1."),
        (".mlp.gate_proj.", ".mlp.w2."),
        (".mlp.down_proj.", ".mlp.c_proj."),
    ]
    for key, tensor in native_state.items():
        if ".self_attn.k_proj." in key or ".self_attn.v_proj." in key:
            continue
        if ".self_attn.q_proj." in key:
            parts = [native_state[key.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            out[key.replace("model.layers.", "transformer.h.").replace("self_attn.q_proj", "attn.c_attn")] = torch.cat(
                parts
            ).contiguous()
            continue
        for old, new in renames:
            key = key.replace(old, new)
        out[key] = tensor.contiguous()
    return out


def write_checkpoint(out: Path, model: Any, ranks: dict[bytes, int]) -> None:
    """Write `model` (a native Qwen2) and `ranks` to `out` as a Qwen (v1) -Chat checkpoint from the Hub."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(v1_state_dict(model.state_dict()), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(v1_config(model.config), indent=2) + "\n")
    (out / qwen_v1.VOCAB_FILE).write_text(tiktoken_file(ranks))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "model_max_length": 8192,
                "tokenizer_class": "QWenTokenizer",
                "auto_map": {"AutoTokenizer": ["tokenization_qwen.QWenTokenizer", None]},
            },
            indent=2,
        )
        + "\n"
    )
    special = len(ranks)  # the specials follow the regular tokens (151,643 of them in the published file)
    (out / "generation_config.json").write_text(
        json.dumps(
            {
                "chat_format": "chatml",
                "eos_token_id": special,
                "pad_token_id": special,
                "max_window_size": 6144,
                "max_new_tokens": 512,
                "do_sample": True,
                "top_k": 0,
                "top_p": 0.8,
                "repetition_penalty": 1.1,
                "transformers_version": "4.31.0",
            },
            indent=2,
        )
        + "\n"
    )
    for name in CODE_FILES:
        (out / name).write_text(POISON.format(name))
