"""Long-context memory savers applied to a built model: the one place the recipe's `memory.tiled_mlp`,
`memory.tiled_norms`, `memory.recompute_lora` and `memory.embeddings_on_host` reach torch.

The one idea: every command builds its model through `lowmem_ft.train.model.build_model`, which calls
`apply_memory_savers` last, so training, the estimator's harnesses and generation run the same model the memory
model predicted. (The chunked loss's chunk is read where the loss head is installed: `install_loss_head`.)
"""

from __future__ import annotations

import logging

from lowmem_ft.errors import UserError
from lowmem_ft.recipe.schema import Recipe

log = logging.getLogger(__name__)


def check_memory_keys(recipe: Recipe) -> None:
    """UserError naming every LoRA-only saver a full fine-tune asks for (their ranges are the schema's)."""
    m = recipe.memory
    problems = []
    for key in ("embeddings_on_host", "recompute_lora"):
        if getattr(m, key) and recipe.adapter.kind == "full":
            problems.append(f"'memory.{key}' is for LoRA adapters (adapter.kind=lora)")
    if problems:
        raise UserError("; ".join(problems))


def apply_memory_savers(model, recipe: Recipe) -> list[str]:
    """Apply the recipe's long-context savers to `model` (PEFT model or bare causal LM); returns what was done."""
    from lowmem_ft.train.savers.host_embeddings import embeddings_on_host
    from lowmem_ft.train.savers.lora_recompute import recompute_lora
    from lowmem_ft.train.savers.tiles import mlp_tile_tokens, tile_mlps, tile_norms

    check_memory_keys(recipe)
    m = recipe.memory
    done = []
    if m.tiled_mlp:
        config = (model.get_base_model() if hasattr(model, "get_base_model") else model).config
        hidden = config.get_text_config().hidden_size
        tile = mlp_tile_tokens(m.mlp_tile_tokens, hidden)
        count = tile_mlps(model, tile)
        done.append(f"tiled_mlp: {count} decoder MLPs in tiles of {tile} tokens")
    if m.tiled_norms:
        config = (model.get_base_model() if hasattr(model, "get_base_model") else model).config
        tile = mlp_tile_tokens(m.mlp_tile_tokens, config.get_text_config().hidden_size)
        done.append(f"tiled_norms: {tile_norms(model, tile)} norms in tiles of {tile} tokens")
    if m.recompute_lora and recipe.adapter.kind == "lora":
        config = (model.get_base_model() if hasattr(model, "get_base_model") else model).config
        tile = mlp_tile_tokens(m.mlp_tile_tokens, config.get_text_config().hidden_size)
        count = recompute_lora(model, tile, skip_mlp=m.tiled_mlp)
        done.append(f"recompute_lora: {count} LoRA linears recomputed in tiles of {tile} tokens")
    if m.embeddings_on_host:
        emb = embeddings_on_host(model)
        done.append(f"embeddings_on_host: {tuple(emb.weight.shape)} table in host memory")
    for line in done:
        log.info("memory saver %s", line)
    return done
