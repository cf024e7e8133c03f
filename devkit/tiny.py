"""The embedded default: a tiny random-initialized Qwen2 model with a tokenizer trained locally.

It lets every command run on a fresh machine with no Hub and no GPU. Built deterministically (fixed seed, fixed
corpus) by `python -m devkit.tiny [--out models/tiny-qwen2]`; tests build their own copy. The other model families
live in `devkit/zoo.py`, which shares this corpus.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lowmem_ft.data.templates import CHATML as CHATML_TEMPLATE

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def corpus() -> list[str]:
    words = [
        "the",
        "a",
        "an",
        "is",
        "of",
        "and",
        "to",
        "in",
        "what",
        "plus",
        "minus",
        "describe",
        "spell",
        "word",
        "colour",
        "color",
        "whose",
        "assistant",
        "user",
        "system",
        "you",
        "are",
        "terse",
        "red",
        "green",
        "blue",
        "yellow",
        "black",
        "white",
        "cat",
        "dog",
        "owl",
        "fox",
        "bee",
        "cow",
        "zero",
        "one",
        "two",
        "three",
        "four",
        "five",
        "six",
        "seven",
        "eight",
        "nine",
        "ten",
        "hello",
        "hi",
        "model",
        "answer",
        "question",
        "data",
        "text",
        "train",
        "memory",
    ]
    lines = [" ".join(words[i : i + 7]) for i in range(0, len(words), 3)]
    lines += [f"{a} plus {b} is {a + b}." for a in range(25) for b in range(25)]
    lines += ["ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz 0123456789 .,;:!?'\"()[]{}<>-_/\\|@#$%^&*+=~`"]
    return lines


def build_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer (so any UTF-8 text encodes) with Qwen's special tokens and ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", model_max_length=4096
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_config(vocab_size: int, **overrides):
    from transformers import Qwen2Config

    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    )
    kwargs.update(overrides)
    return Qwen2Config(**kwargs)


def build_tiny_model(out_dir: str | Path, seed: int = 0, **config_overrides) -> Path:
    """Write a tiny Qwen2 model and its tokenizer to `out_dir` (loadable with `from_pretrained`)."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = tiny_config(len(tokenizer), **config_overrides)
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = None
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devkit.tiny", description="Build the embedded tiny Qwen2 model.")
    parser.add_argument("--out", default="models/tiny-qwen2", help="model folder to write (default: %(default)s)")
    args = parser.parse_args(argv)
    print(f"wrote {build_tiny_model(args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
