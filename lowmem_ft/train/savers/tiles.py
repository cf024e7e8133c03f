"""Token tiles: the tiled MLP (`memory.tiled_mlp`), the tiled norms (`memory.tiled_norms`, `tile_norms`) and the
tiling the recomputed LoRA branches use (`tiled_forward`). Each decoder MLP runs over a tile of tokens at a time and
is recomputed tile by tile in backward, so no (tokens × intermediate) tensor of the whole sequence ever exists.

The one idea: an MLP acts on each token alone, so its forward over `tokens` equals the concatenation of its forward
over tiles of tokens. Each tile runs under torch's non-reentrant `checkpoint`, which keeps only the tile's input
(a view of the MLP input, no copy) and the tile's autograd graph; the tile's own saved tensors — the gate and up
outputs, the activation, peft's fp32 copies of the LoRA inputs and their dropout masks — are recomputed in
backward one tile at a time. At 100k tokens on Llama-3.1-8B that is ~10 GB of MLP activations replaced by one
tile's (see `lowmem_ft.memory.savers.TiledMLP`).

Why our own and not DeepSpeed's `TiledMLP` (deepspeed 0.19.8, `runtime/sequence_parallel/ulysses_sp.py`, the
implementation Snowflake's Arctic Long Sequence Training uses) or liger-kernel's `LigerTiledMLPFunction` (0.8.5, a
copy of it): both run each shard under `no_grad` in forward and again in backward without saving and restoring
the RNG state, so peft's LoRA dropout inside the MLP draws different masks in the recompute and the gradients are
not those of the forward that produced the loss (checked on a copy of DeepSpeed 0.19.8's class with LoRA dropout
0.3: its gradients differ from those of its own shards computed without recompute by up to 5.6× their size; ours
match exactly; `tests/train/savers/test_tiles.py` reproduces the failure mode by turning our RNG restore off). Read
from their code, not run: they shard the sequence dimension in forward but the flattened batch × sequence in
backward, so the two passes see different tiles when the micro batch is above 1; they hand parameter gradients
to a nested `autograd.backward` per shard, which fires DDP's per-parameter hooks once per shard; and liger-kernel
needs Triton to import, DeepSpeed its whole runtime. torch's `checkpoint` already does the recompute with the RNG
state restored (`preserve_rng_state=True`) and lets the one autograd graph accumulate each weight's gradient
once; what is ours is the ~20 lines that split the tokens and concatenate the tiles.

The same tiling serves the norms (`tile_norms`; `lowmem_ft.train.savers.apply` applies both): an RMSNorm is per
token too, and tiled it keeps a view of its c-byte input instead of its fp32 upcast, and its fp32 backward runs one
tile at a time.

Works with LoRA / QLoRA adapters inside the MLP (peft's layers are ordinary modules called by the MLP's forward)
and with activation checkpointing (a checkpoint nested in transformers' per-layer checkpoint: the layer's recompute
runs the tiles again under their own checkpoints). Without gradients (evaluation, generation) the tiles run one
after another with no checkpoint, which bounds the prefill's MLP working set too.
"""

from __future__ import annotations

import re
import types

import torch
from torch.utils.checkpoint import checkpoint

from lowmem_ft.errors import UserError

# Decoder MLPs by module path: `model.layers.N.mlp` (Llama, Qwen2/3, Mistral, Gemma 1-3, Phi-3, Granite) and
# `transformer.h.N.mlp` (Qwen v1 remote code). Phi-3's fused gate_up_proj is per-token too.
MLP_PATH = re.compile(r"(^|\.)(layers|h)\.\d+\.mlp$")


def mlp_tile_tokens(tile_tokens: int, hidden_size: int) -> int:
    """Tokens per tile: the recipe's `memory.mlp_tile_tokens`, or hidden_size when 0 — the shard size DeepSpeed's
    and liger-kernel's tiled MLPs default to (`ceil(seqlen / hidden_size)` shards), where a tile's
    (tile × intermediate) tensors are about the size of the MLP's own weights."""
    return tile_tokens if tile_tokens > 0 else hidden_size


def tiled_forward(mlp_forward, tile_tokens: int):
    """`mlp_forward(x)` computed over `tile_tokens` rows of the flattened (batch × seq, hidden) input at a time."""

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])
        tiles = flat.split(tile_tokens)
        if torch.is_grad_enabled():
            # preserve_rng_state (the default) replays each tile's dropout masks exactly in the recompute
            outs = [checkpoint(mlp_forward, tile, use_reentrant=False) for tile in tiles]
        else:
            outs = [mlp_forward(tile) for tile in tiles]
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.view(*shape[:-1], out.shape[-1])

    return forward


def decoder_mlps(model) -> list[tuple[str, torch.nn.Module]]:
    """(path, module) of each decoder layer's MLP; UserError for a mixture of experts or no MLP found."""
    found = [(name, module) for name, module in model.named_modules() if MLP_PATH.search(name)]
    if not found:
        raise UserError(
            "memory.tiled_mlp: no decoder MLP found (looked for layers.N.mlp); set memory.tiled_mlp=false for "
            "this model"
        )
    moe = [name for name, module in found if hasattr(module, "experts")]
    if moe:
        raise UserError(
            f"memory.tiled_mlp: {moe[0]} is a mixture of experts, which is not tiled (its router sees the whole "
            "sequence); set memory.tiled_mlp=false"
        )
    return found


def hidden_norms(model) -> list[tuple[str, torch.nn.Module]]:
    """(path, module) of every RMSNorm / LayerNorm over the hidden size: each layer's norms and the final norm (not
    Qwen3's / Gemma 3's per-head q/k norms, whose width is head_dim)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = base.config.get_text_config().hidden_size
    return [
        (name, module)
        for name, module in model.named_modules()
        if type(module).__name__.endswith(("RMSNorm", "LayerNorm"))
        and getattr(module, "weight", None) is not None
        and tuple(module.weight.shape) == (hidden,)
    ]


def tile_norms(model, tile_tokens: int) -> int:
    """Make every hidden-size norm of `model` sequence-tiled; returns how many.

    An RMSNorm keeps its input upcast to fp32 (4 B per element) for backward; tiled, it keeps only a view of its
    c-byte input, and the fp32 copies (and the fp32 gradients of its backward) exist for one tile at a time."""
    if tile_tokens < 1:
        raise UserError(f"memory.mlp_tile_tokens is {tile_tokens}; it must be at least 1 (0 = automatic)")
    norms = hidden_norms(model)
    for _, norm in norms:
        if getattr(norm, "_lowmem_tile_tokens", None):
            continue
        norm.forward = tiled_forward(types.MethodType(type(norm).forward, norm), tile_tokens)
        norm._lowmem_tile_tokens = tile_tokens
    return len(norms)


def tile_mlps(model, tile_tokens: int) -> int:
    """Make every decoder MLP of `model` (a PEFT model or the bare causal LM) sequence-tiled; returns how many.

    The instance's `forward` is replaced, so hooks and wrappers around the module (peft, accelerate) still run.
    Applying it twice keeps the first tiling.
    """
    if tile_tokens < 1:
        raise UserError(f"memory.mlp_tile_tokens is {tile_tokens}; it must be at least 1 (0 = automatic)")
    mlps = decoder_mlps(model)
    for _, mlp in mlps:
        if getattr(mlp, "_lowmem_tile_tokens", None):
            continue
        plain = types.MethodType(type(mlp).forward, mlp)
        mlp.forward = tiled_forward(plain, tile_tokens)
        mlp._lowmem_tile_tokens = tile_tokens
    return len(mlps)
