"""Frozen input embeddings kept in host memory (`memory.embeddings_on_host`): the lookup runs on the CPU and only
the gathered rows move to the device.

The one idea: with LoRA the input embedding table is frozen and used only to gather `tokens` rows per step, yet it
holds vocab × hidden 16-bit values on the device — 1.05 GB for Llama-3.1-8B (128k × 4096), 13 % of an 8 GB card.
The gather needs no device at all: look the ids up in the host copy and send the (tokens × hidden) result over,
from pinned memory without blocking the host on CUDA. Per step that is one host→device copy of the embedding
output (2·hidden bytes per token: 8 KB/token for Llama-3.1-8B, ~33 ms for 100k tokens at a pinned PCIe 4 x16
transfer of ~25 GB/s — a prediction, not measured: no GPU here) and a host gather of the same size.

Untied models only: a tied table is also the lm_head, which the loss multiplies on the device every step. Not for
full fine-tuning (the table is trained there). Not supported with several processes (DDP broadcasts every
parameter from its device at start; a host parameter breaks that).

Not found in the field's libraries: accelerate's `cpu_offload` / device maps move a module's weights to the device
for each call (the full table would cross PCIe every step); transformers' `offload_embeddings` does not exist in
5.24. Hence this small wrapper around the module's own forward (which keeps Gemma's embedding scale and padding
handling as the model defines them).
"""

from __future__ import annotations

import logging

import torch

from lowmem_ft.errors import UserError

log = logging.getLogger(__name__)


def _base(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def embeddings_on_host(model) -> torch.nn.Module:
    """Move `model`'s input embedding table to host memory and look ids up there; returns the embedding module.

    The module keeps its class, hooks (transformers' `enable_input_require_grads` marks its output as requiring
    grad) and parameter; only its weight's device and its instance `forward` change.
    """
    base = _base(model)
    emb = base.get_input_embeddings()
    head = base.get_output_embeddings()
    if head is not None and head.weight is emb.weight:
        raise UserError(
            "memory.embeddings_on_host: this model ties its input embeddings to the lm_head, which the loss uses on "
            "the device every step; set memory.embeddings_on_host=false"
        )
    if any(p.requires_grad for p in emb.parameters()):
        raise UserError(
            "memory.embeddings_on_host: the input embeddings are trained (full fine-tuning); host embeddings are "
            "for frozen tables (LoRA); set memory.embeddings_on_host=false"
        )
    if (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    ):
        raise UserError("memory.embeddings_on_host is not supported with several processes; set it to false")
    if getattr(emb, "_lowmem_on_host", False):
        return emb
    device = emb.weight.device
    emb.to("cpu")
    pin = device.type == "cuda"
    lookup = emb.forward  # the module's own forward (scaling, padding_idx), bound before we replace it

    def forward(input_ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        rows = lookup(input_ids.to("cpu"), *args, **kwargs)
        if pin:  # pinned pages let the copy run asynchronously (the caching host allocator keeps them alive)
            rows = rows.pin_memory()
        return rows.to(device, non_blocking=pin)

    emb.forward = forward
    emb._lowmem_on_host = True
    log.info("memory.embeddings_on_host: %s input embedding table in host memory", tuple(emb.weight.shape))
    return emb
