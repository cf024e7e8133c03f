"""The processes of one run (`train --gpus N`): how many, waiting for all, and agreeing on a yes/no.

One process (no process group) is a world of one, where each of these is free. Every call is a collective: all
ranks make it at the same point, or the ones that did wait for the others.
"""

from __future__ import annotations

import torch
from torch import distributed as dist


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def barrier() -> None:
    """Wait until every rank is here."""
    if world_size() > 1:
        dist.barrier()


def largest(value: int, device: torch.device | str) -> int:
    """The largest of every rank's `value`, on every rank (one all-reduce of one integer on `device`, the rank's
    own: NCCL reduces only CUDA tensors)."""
    if world_size() <= 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def any_rank(flag: bool, device: torch.device | str) -> bool:
    """True on every rank when `flag` is true on any."""
    return largest(int(flag), device) > 0
