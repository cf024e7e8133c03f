"""Qwen (v1) checkpoints — Qwen-1.8B / 7B / 14B / 72B, base and -Chat, `model_type: qwen` — as transformers' Qwen2.

Qwen v1 ships `modeling_qwen.py`, `tokenization_qwen.py` (tiktoken over `qwen.tiktoken`) and needs
`--trust-remote-code`, tiktoken, einops and transformers_stream_generator — and its code no longer imports under
transformers 5 (transformers_stream_generator imports the removed `DisjunctiveConstraint`). Its block is exactly
Qwen2's (read in the repository's modeling_qwen.py, `QWenBlock` / `QWenAttention` / `QWenMLP` / `RMSNorm`):
- `attn.c_attn` (fused q, k, v, with bias) → `self_attn.q_proj` / `k_proj` / `v_proj` (Qwen2 biases q/k/v always);
  `attn.c_proj` (`bias=not no_bias`; no bias in every published config) → `self_attn.o_proj` (Qwen2: no bias);
- `QWenMLP.forward` is `c_proj(w1(x) * silu(w2(x)))` with w1 and w2 each `intermediate_size // 2` wide: `w2` → gate,
  `w1` → up, `mlp.c_proj` → down;
- `ln_1` / `ln_2` / `ln_f`: RMSNorm in fp32, ε `layer_norm_epsilon` → `input_layernorm` / `post_attention_layernorm`
  / `model.norm`; `wte` → `embed_tokens`; `lm_head` untied;
- rotary over `kv_channels · rotary_pct` dimensions, base `rotary_emb_base`, halves joined by `torch.cat` (the same
  `rotate_half` as Qwen2); every published config has `rotary_pct` 1.0;
- attention scaled by 1/√head_dim, causal; `use_logn_attn` and `use_dynamic_ntk` act only when not training and past
  `seq_length` tokens (`logn_list` is 1 up to `seq_length`; the NTK base changes only beyond it), so within
  `seq_length` — which becomes `max_position_embeddings` — the native model computes the same function.
What is not carried over: generation beyond `seq_length` without Qwen v1's dynamic NTK / log-n scaling (transformers'
`dynamic` RoPE scales by another formula), and the KV-cache quantization option of its code.

The tokenizer (`tokenization_qwen.py` `QWenTokenizer`) is tiktoken's byte-level BPE over `qwen.tiktoken` — one
`base64(token) rank` per line — pre-tokenized by `PAT_STR`, the same pattern as Qwen2's tokenizer, and followed by
its special tokens: `<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, then `<|extra_0|>` … `<|extra_204|>`, numbered from
`SPECIAL_START_ID` = 151,643, which is the number of regular tokens in the published file (the specials follow them;
a file with another count, as a tiny test checkpoint has, numbers them after its own last rank). It is rebuilt here as
a `tokenizers` BPE the way transformers' `TikTokenConverter` does, without importing tiktoken: every merge that makes a
token from two tokens, ranked by the merged token (`ignore_merges`: a piece that is itself a token is taken whole, as
tiktoken does). The test suite checks the ids against tiktoken's own encoder.

Qwen v1 ships no chat template; -Chat was trained on ChatML with the system prompt "You are a helpful assistant."
when none is given (`qwen_generation_utils.make_context`, and `finetune.py` of the Qwen repository), which is
`CHAT_TEMPLATE`. A -Chat checkpoint (`generation_config.json` `chat_format: chatml`) stops at `<|im_end|>`.
"""

from __future__ import annotations

import base64
import re
from typing import Any

from lowmem_ft.errors import UserError

# tokenization_qwen.py
PAT_STR = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIALS = (ENDOFTEXT, IM_START, IM_END, *(f"<|extra_{i}|>" for i in range(205)))
SPECIAL_START_ID = 151643
VOCAB_FILE = "qwen.tiktoken"

# ChatML with Qwen-Chat's default system prompt, and generation markers around what the assistant writes (its
# content and the `<|im_end|>` that ends its turn) so that only those tokens are trained.
CHAT_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# v1 tensor names → Qwen2's, applied in this order (transformers' loader and `native_tensors` alike); c_attn's rows
# are q, k, v in this order (QWenAttention.forward: `mixed_x_layer.split(self.split_size, dim=2)`)
RENAMES = (
    (r"^transformer\.wte\.", "model.embed_tokens."),
    (r"^transformer\.ln_f\.", "model.norm."),
    (r"^transformer\.h\.", "model.layers."),
    (r"\.ln_1\.", ".input_layernorm."),
    (r"\.ln_2\.", ".post_attention_layernorm."),
    (r"\.attn\.c_proj\.", ".self_attn.o_proj."),
    (r"\.mlp\.w1\.", ".mlp.up_proj."),
    (r"\.mlp\.w2\.", ".mlp.gate_proj."),
    (r"\.mlp\.c_proj\.", ".mlp.down_proj."),
)
FUSED_QKV = ("q_proj", "k_proj", "v_proj")


class QwenV1:
    """The `Conversion` of Qwen v1 checkpoints (see the module docstring)."""

    model_type = "qwen"
    native_model_type = "qwen2"
    family = "Qwen (v1)"

    def native_config(self, config: dict[str, Any], name: str = "") -> dict[str, Any]:
        where = f"model '{name}'" if name else "Qwen (v1) model"
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        kv_channels = int(config.get("kv_channels") or hidden // heads)
        if float(config.get("rotary_pct", 1.0)) != 1.0:
            raise UserError(
                f"{where}: rotary_pct {config['rotary_pct']} rotates part of each head, which transformers' Qwen2 does "
                "not; lowmem-ft loads Qwen (v1) checkpoints with rotary_pct 1.0 (every published one)"
            )
        if kv_channels * heads != hidden:
            raise UserError(
                f"{where}: kv_channels × heads ({kv_channels} × {heads}) differs from hidden_size {hidden}; "
                "lowmem-ft loads Qwen (v1) checkpoints whose heads span the width (every published one)"
            )
        if not config.get("no_bias", True):
            raise UserError(
                f"{where}: no_bias is false (biases on c_proj, w1 and w2), which transformers' Qwen2 has no place for; "
                "lowmem-ft loads Qwen (v1) checkpoints with no_bias true (every published one)"
            )
        native = {
            "model_type": self.native_model_type,
            "architectures": ["Qwen2ForCausalLM"],
            "vocab_size": int(config["vocab_size"]),
            "hidden_size": hidden,
            "intermediate_size": int(config["intermediate_size"]) // 2,  # w1 and w2 are each half of it
            "num_hidden_layers": int(config["num_hidden_layers"]),
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "hidden_act": "silu",
            "rms_norm_eps": float(config.get("layer_norm_epsilon", 1e-6)),
            "rope_theta": float(config.get("rotary_emb_base", 10000)),
            # log-n attention and dynamic NTK start past seq_length: within it the models agree
            "max_position_embeddings": int(config.get("seq_length") or config.get("max_position_embeddings") or 2048),
            "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
            "attention_dropout": float(config.get("attn_dropout_prob", 0.0)),
            "initializer_range": float(config.get("initializer_range", 0.02)),
            "use_sliding_window": False,
            "use_cache": bool(config.get("use_cache", True)),
        }
        if name or config.get("_name_or_path"):
            native["_name_or_path"] = name or config["_name_or_path"]
        return native

    def weight_transforms(self) -> list[Any]:
        """Renames applied in order to every key (transformers applies all renames, then at most one converter);
        the converter splits the fused q/k/v weight and bias into three equal row blocks."""
        from transformers.core_model_loading import Chunk, WeightConverter, WeightRenaming

        return [
            *(WeightRenaming(pattern, replacement) for pattern, replacement in RENAMES),
            WeightConverter(
                source_patterns="attn.c_attn",
                target_patterns=[f"self_attn.{p}" for p in FUSED_QKV],
                operations=[Chunk(dim=0)],
            ),
        ]

    def native_tensors(self, key: str, shape: tuple[int, ...]) -> list[tuple[str, int, tuple[int, ...]]]:
        """(native name, first row in the stored tensor, shape) of each native tensor that stored tensor `key`
        holds — the same mapping as `weight_transforms`, for readers of the shards themselves (GGUF export)."""
        for pattern, replacement in RENAMES:
            key = re.sub(pattern, replacement, key)
        if ".attn.c_attn." not in key:
            return [(key, 0, shape)]
        rows = shape[0] // len(FUSED_QKV)
        return [
            (key.replace(".attn.c_attn.", f".self_attn.{p}."), i * rows, (rows, *shape[1:]))
            for i, p in enumerate(FUSED_QKV)
        ]

    def loaded(self, model: Any, files) -> None:
        """A -Chat checkpoint's generation stops where its code stopped: `qwen_generation_utils.get_stop_words_ids`
        for `chat_format: chatml` adds `<|im_end|>` and `<|im_start|>` to `<|endoftext|>` (the specials' order puts
        them 2 and 1 after it)."""
        generation = files.json("generation_config.json")
        eod = generation.get("eos_token_id")
        if generation.get("chat_format") == "chatml" and isinstance(eod, int):
            model.generation_config.eos_token_id = [eod, eod + 2, eod + 1]

    def tokenizer(self, files) -> Any:
        vocab_file = files.path(VOCAB_FILE)
        if vocab_file is None:
            raise UserError(
                f"model '{files.name_or_path}' is a Qwen (v1) checkpoint without {VOCAB_FILE}; copy or download the "
                "checkpoint's files again"
            )
        own = files.json("tokenizer_config.json").get("chat_template")
        return tokenizer_from_ranks(
            load_ranks(vocab_file.read_bytes(), str(vocab_file)),
            chat=files.json("generation_config.json").get("chat_format") == "chatml",
            max_length=int(files.json("config.json").get("seq_length") or 8192),
            chat_template=own if isinstance(own, str) and own else CHAT_TEMPLATE,
        )


def tokenizer_from_ranks(
    ranks: dict[bytes, int], chat: bool, max_length: int = 8192, chat_template: str = CHAT_TEMPLATE
):
    """The fast tokenizer of `ranks` with Qwen's specials: EOS `<|im_end|>` for a -Chat checkpoint (its turns end
    there), `<|endoftext|>` for a base one; PAD `<|endoftext|>` (the checkpoint's `pad_token_id`)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=build_backend(ranks),
        eos_token=IM_END if chat else ENDOFTEXT,
        pad_token=ENDOFTEXT,
        model_max_length=max_length,
    )
    extra = [s for s in SPECIALS if s not in (tokenizer.eos_token, tokenizer.pad_token)]
    tokenizer.add_special_tokens({"additional_special_tokens": extra}, replace_extra_special_tokens=False)
    tokenizer.chat_template = chat_template
    return tokenizer


def load_ranks(data: bytes, where: str = VOCAB_FILE) -> dict[bytes, int]:
    """`qwen.tiktoken`'s token bytes → rank (tiktoken's `load_tiktoken_bpe` format: `base64 rank` per line)."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise UserError(
                f"{where}: line {number} is not 'base64-token rank'; copy or download the checkpoint again"
            ) from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise UserError(f"{where}: the ranks are not 0 … {len(ranks) - 1} each once; copy or download it again")
    return ranks


def build_backend(ranks: dict[bytes, int]):
    """The `tokenizers` Tokenizer equal to tiktoken's encoder over `ranks` with Qwen's pattern and specials.

    As transformers' `TikTokenConverter` (convert_slow_tokenizer.py) builds it — byte-level alphabet, every split of
    a token into two tokens a merge ranked by the merged token, then by its parts' ranks — without tiktoken."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_encoder = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(byte_encoder[b] for b in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    backend = Tokenizer(
        models.BPE(vocab, [(text(m[3]), text(m[4])) for m in merges], fuse_unk=False, byte_fallback=False,
                   ignore_merges=True)
    )  # fmt: skip
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PAT_STR), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)  # offsets per token: the masks use them
    # the specials follow the regular tokens (151,643 in the published file: SPECIAL_START_ID)
    backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return backend


CONVERSION = QwenV1()
