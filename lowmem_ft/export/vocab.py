"""The tokenizer as GGUF metadata: llama.cpp's two BPE forms, read from the run's `tokenizer.json`.

- Byte-level BPE (GPT-2, Llama-3, Qwen, Granite): `tokenizer.ggml.model = gpt2`, the tokens in id order, the merges,
  and the pre-tokenizer's name (`tokenizer.ggml.pre`). llama.cpp's converter names it from a hash of the tokenizer's
  output on a probe text, which a fine-tune's own tokenizer rarely matches; here it is named from the split regex the
  tokenizer.json itself holds (`PRE_TOKENIZERS`), GPT-2's when it has none.
- SentencePiece-style BPE (`▁` for spaces, bytes as `<0xNN>`: Llama-2, Mistral, Gemma, Phi-3): `model = llama`, the
  tokens, a score per token and the merges. llama.cpp's SentencePiece tokenizer merges the pair whose result scores
  highest; the `gguf` package's `LlamaHfVocab` gives every token -1000, which leaves that order to chance, so the
  score here is minus the token's rank (BPE ids follow merge order), and the merges are written too (transformers'
  GGUF loader uses them when present).

Token types follow llama.cpp: CONTROL for special tokens, USER_DEFINED for added non-special ones (`<think>`),
BYTE for `<0xNN>`, UNKNOWN for the unk token. Special ids, add-BOS/EOS and the chat template come from the
`gguf` package's `SpecialVocab`, as in llama.cpp's converter. Rows of the embedding beyond the tokenizer (Qwen2.5
pads 151665 tokens to 151936) are named `[PAD{id}]` as llama.cpp does.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from lowmem_ft.errors import UserError

# tokenizer.ggml.pre for the split regexes of the tokenizer.json families ship (llama.cpp's names for them)
PRE_TOKENIZERS = {
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "llama-bpe",  # noqa: E501
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+": "qwen2",  # noqa: E501
}
GPT2_PRE = "gpt-2"
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")

# llama.cpp's token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


# llama.cpp gives Phi-3's special tokens their strip attributes when general.name contains "phi3" or "phi-3",
# looking these up by text (llama-vocab.cpp, `_contains_any(model_name, {"phi-3", "phi3"})`): a vocabulary without
# one of them then fails to load ("unordered_map::at"). Found by loading the zoo's Phi-3 export in llama.cpp.
PHI3_NAMED = ("</s>", "<unk>", "<s>", "<|endoftext|>")


def general_name(name: str, tokens: list[str]) -> str:
    """`name` for general.name, unless it would make llama.cpp look up Phi-3 tokens this vocabulary lacks."""
    if re.search(r"phi-?3", name, re.IGNORECASE) and not set(PHI3_NAMED) <= set(tokens):
        return re.sub(r"(?i)phi-?3", "phi_3", name)
    return name


def write_vocab(writer, tokenizer_dir: Path, vocab_size: int) -> list[str]:
    """Add the tokenizer in `tokenizer_dir` to `writer` for an embedding of `vocab_size` rows; returns its tokens."""
    import gguf

    spec = tokenizer_spec(tokenizer_dir)
    model = spec["model"]
    if model.get("type") != "BPE":
        raise UserError(f"{tokenizer_dir}: a {model.get('type')} tokenizer; GGUF export writes BPE tokenizers only")
    sentencepiece = bool(model.get("byte_fallback"))
    tokens, types = _tokens(spec, vocab_size)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    if sentencepiece:
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_add_space_prefix(_adds_space_prefix(spec))
        writer.add_token_list(tokens)
        writer.add_token_scores([-float(i) for i in range(len(tokens))])
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre_tokenizer_name(spec))
        writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(tokenizer_dir, load_merges=False, n_vocab=len(tokens))
    special.add_to_gguf(writer, quiet=True)
    if merges:
        writer.add_token_merges(merges)
    return tokens


def tokenizer_spec(tokenizer_dir: Path) -> dict:
    """The tokenizer as transformers loads it, in tokenizer.json form: its class may replace the file's pipeline
    (transformers 5's Qwen2Tokenizer puts Qwen's digit-splitting regex in front of a plain ByteLevel), and that
    pipeline is the one training used."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if not getattr(tokenizer, "is_fast", False):
        raise UserError(f"{tokenizer_dir}: a slow tokenizer; GGUF export reads the fast tokenizer's pipeline")
    return json.loads(tokenizer.backend_tokenizer.to_str())


def _tokens(spec: dict, vocab_size: int) -> tuple[list[str], list[int]]:
    vocab: dict[str, int] = dict(spec["model"]["vocab"])
    specials, added = set(), set()
    for token in spec.get("added_tokens", []):
        vocab[token["content"]] = token["id"]
        (specials if token.get("special") else added).add(token["id"])
    size = max(vocab_size, max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [UNUSED] * size
    unk = spec["model"].get("unk_token")
    for text, i in vocab.items():
        tokens[i] = text
        if i in specials:
            types[i] = UNKNOWN if text == unk else CONTROL
        elif i in added:
            types[i] = USER_DEFINED
        elif BYTE_TOKEN.fullmatch(text) and spec["model"].get("byte_fallback"):
            types[i] = BYTE
        else:
            types[i] = NORMAL
    return tokens, types


def _walk(node: dict | None):
    if not node:
        return
    yield node
    for child in node.get("pretokenizers", []) or node.get("normalizers", []):
        yield from _walk(child)


def pre_tokenizer_name(spec: dict) -> str:
    """llama.cpp's name for the split regex in `spec` (tokenizer.json); GPT-2's default when it has none."""
    for node in _walk(spec.get("pre_tokenizer")):
        if node.get("type") == "Split":
            pattern = node.get("pattern", {})
            regex = pattern.get("Regex") or pattern.get("String")
            if regex in PRE_TOKENIZERS:
                return PRE_TOKENIZERS[regex]
            raise UserError(
                f"tokenizer.json splits text with a regex llama.cpp has no name for ({regex[:60]!r}…); "
                f"convert with llama.cpp's convert_hf_to_gguf.py, which knows the newer ones"
            )
    return GPT2_PRE


def _adds_space_prefix(spec: dict) -> bool:
    """A SentencePiece-style tokenizer puts `▁` before the first word (Llama-2, Mistral) or not (Gemma)."""
    for node in [*_walk(spec.get("pre_tokenizer")), *_walk(spec.get("normalizer"))]:
        if node.get("type") == "Metaspace":
            return node.get("prepend_scheme", "always") != "never"
        if node.get("type") == "Prepend":
            return True
    return False
