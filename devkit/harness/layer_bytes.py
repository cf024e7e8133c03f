"""One decoder layer's kept activations, measured: what `lowmem_ft.memory.estimate.layer_activation_bytes` predicts.

    python -m devkit.harness.layer_bytes          # heads·head_dim ≠ hidden shapes (tests/memory/test_estimate.py)
    python -m devkit.harness.layer_bytes --adapters full --set tiled_mlp=true

A model of `config` is built with 3 and with 2 layers through `build_model` (the path `train` uses), the backbone runs
one forward of `seq` tokens under `PeakMemory`, and the live bytes after it minus the static ones are what its layers
keep for backward (with the embeddings' output and RoPE's cos/sin, the same in both): the difference of the two
models is one layer, divided by the tokens. No checkpointing (every layer keeps its tensors), one row, no padding.
Eager attention's s² scores are part of the layer here and a term of their own in the model (`eager_scores_bytes`).
"""

from __future__ import annotations

import argparse
import gc
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from devkit.harness.estimator import write_model
from lowmem_ft.choosing import setup_from_recipe
from lowmem_ft.memory.arch import Architecture
from lowmem_ft.memory.estimate import eager_scores_bytes, effective_setup, layer_activation_bytes
from lowmem_ft.recipe.load import resolve

WIDTH = {
    "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 704, "num_attention_heads": 4,
    "num_key_value_heads": 2,
}  # fmt: skip
# heads · head_dim wider (4 × 96) and narrower (4 × 32) than hidden 256, as Qwen3 / Gemma-2 / Mistral-Nemo have it
SHAPES: dict[str, dict[str, Any]] = {
    "llama 4×96": {**WIDTH, "model_type": "llama", "head_dim": 96},
    "llama 4×32": {**WIDTH, "model_type": "llama", "head_dim": 32},
    "phi3 4×96": {**WIDTH, "model_type": "phi3", "head_dim": 96, "pad_token_id": 0},
    "cohere 4×96": {**WIDTH, "model_type": "cohere", "head_dim": 96, "use_qk_norm": True},
    "apertus 4×32": {**WIDTH, "model_type": "apertus", "head_dim": 32, "hidden_act": "xielu"},
    "qwen3 4×96": {**WIDTH, "model_type": "qwen3", "head_dim": 96},
    "gemma2 4×96": {**WIDTH, "model_type": "gemma2", "head_dim": 96, "query_pre_attn_scalar": 96},
}


def _recipe(model_dir: Path, adapter: str, seq: int, knobs: dict[str, Any]):
    return resolve(
        None,
        {
            "model": {"name_or_path": str(model_dir), "quantization": "nf4" if adapter == "qlora" else "none"},
            "adapter": {"kind": "full" if adapter == "full" else "lora", "r": 8},
            "memory": {"gradient_checkpointing": False, "micro_batch_size": 1, "max_seq_len": seq, **knobs},
        },
    )


def _kept_after_forward(config: dict[str, Any], layers: int, adapter: str, seq: int, knobs: dict[str, Any]) -> int:
    import torch

    from lowmem_ft.train.measure.peak import PeakMemory
    from lowmem_ft.train.model import build_model

    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(
            _recipe(write_model({**config, "num_hidden_layers": layers}, Path(tmp)), adapter, seq, knobs)
        )
        model.train()
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        ids = torch.randint(0, config["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(0))
        with PeakMemory(roots=[model]) as pm:
            static = pm.mark("static").live_bytes
            out = base.base_model(input_ids=ids, attention_mask=torch.ones_like(ids))
            kept = pm.mark("forward").live_bytes - static
            del out
    del model, base
    gc.collect()
    return kept


def measured_layer_bytes(config: dict[str, Any], adapter: str, seq: int = 256, **knobs: Any) -> float:
    """Bytes per token one layer of `config` keeps for backward (3- minus 2-layer models; see the module doc)."""
    three = _kept_after_forward(config, 3, adapter, seq, knobs)
    return (three - _kept_after_forward(config, 2, adapter, seq, knobs)) / seq


def predicted_layer_bytes(config: dict[str, Any], adapter: str, seq: int = 256, **knobs: Any) -> float:
    """The memory model's bytes per token for the same layer, eager scores included where eager attention runs."""
    arch = Architecture.from_config({**config, "num_hidden_layers": 3})
    with tempfile.TemporaryDirectory() as tmp:
        recipe = _recipe(Path(tmp), adapter, seq, knobs)
        s, _ = effective_setup(arch, replace(setup_from_recipe(recipe, device="cpu"), gradient_checkpointing=False))
    scores = eager_scores_bytes(arch, s) / seq if s.attn_implementation == "eager" else 0
    return layer_activation_bytes(arch, s) + scores


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m devkit.harness.layer_bytes", description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of: {', '.join(SHAPES)}")
    ap.add_argument("--adapters", default="full,lora,qlora")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--set", action="append", default=[], help="memory.KEY=VALUE (e.g. tiled_mlp=true)")
    args = ap.parse_args(argv)
    knobs = {k: {"true": True, "false": False}.get(v, v) for k, v in (kv.split("=", 1) for kv in args.set)}
    print("| shape | adapter | measured B/token | predicted B/token | error |\n| --- | --- | --- | --- | --- |")
    for name in args.shapes.split(","):
        for adapter in args.adapters.split(","):
            m = measured_layer_bytes(SHAPES[name], adapter, args.seq, **knobs)
            p = predicted_layer_bytes(SHAPES[name], adapter, args.seq, **knobs)
            print(f"| {name} | {adapter} | {m:,.0f} | {p:,.0f} | {(p - m) / m:+.2%} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
