"""Loading an exported GGUF back through transformers' GGUF loader and comparing it with the merged model."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

# Sample text: words, digits, punctuation, a newline and an indented line, a double space — none starting with a
# space: transformers rebuilds Phi-3's SentencePiece normalizer from a GGUF so that a leading space doubles its `▁`
# (its gguf_tokenizer_mapping.phi3_tokenizer docstring), which is the loader's known difference, not the file's.
TEXTS = [
    "Hello world, what is two plus three? The answer is 5.\n  Indented line.",
    "Numbers 12345 and symbols #@! mixed  with double  spaces.",
]


def gguf_model(path: Path, config=None):
    """The GGUF's weights in fp32 through `from_pretrained(dir, gguf_file=...)`; with `config`, that config instead
    of the one transformers rebuilds from the file's keys (it reads no softcapping, head_dim or RoPE scaling)."""
    from transformers import AutoModelForCausalLM

    kwargs = {"config": config} if config is not None else {}
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32, **kwargs).eval()


def gguf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def rounded(model, quant: str):
    """`model` with every matrix stored as the GGUF stores it: f16 / bf16 rounding, or Q8_0 blocks (gguf.quants)."""
    import gguf

    out = copy.deepcopy(model)
    for _, p in out.named_parameters():
        if p.dim() < 2:
            continue
        if quant == "q8_0":
            if p.shape[-1] % 32:
                p.data = p.data.half().float()
                continue
            q = gguf.quants.quantize(p.data.numpy(), gguf.GGMLQuantizationType.Q8_0)
            p.data = torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).copy()).reshape(p.shape)
        else:
            p.data = p.data.to({"f16": torch.float16, "bf16": torch.bfloat16}[quant]).float()
    return out


def logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Mean KL(reference ‖ other) per position, in nats."""
    p = torch.log_softmax(reference, -1)
    q = torch.log_softmax(other, -1)
    return (p.exp() * (p - q)).sum(-1).mean().item()


def confident_top1_agreement(reference: torch.Tensor, other: torch.Tensor, margin: float = 0.05) -> tuple[float, int]:
    """Top-1 agreement over the positions whose reference top-1 leads its runner-up by `margin` logits, and how
    many positions that is: a tiny random model's near-ties would flip under any rounding at all."""
    top2 = reference.topk(2, dim=-1).values
    confident = (top2[..., 0] - top2[..., 1]) > margin
    same = reference.argmax(-1) == other.argmax(-1)
    n = int(confident.sum())
    return (float(same[confident].float().mean()) if n else 0.0), n
