"""The processes of one run (`train --gpus N`): how many, waiting for all, and agreeing on a yes/no.

One process (no process group) is a world of one, where each of these is free. Every call is a collective: all
ranks make it at the same point, or the ones that did wait for the others — until the process group's timeout
(training.rank_timeout_s), or at once when a rank's process is gone (gloo sees its sockets close): `lost_peer` tells
those failures from the others.

Two waits, not one: while the ranks build (import the libraries, read the data, load the model) one rank may be
minutes behind another on a loaded host, and that is not a hang, so building waits up to `SETUP_TIMEOUT_S`; once every
rank is built (`ready`, a barrier) the training's collectives wait training.rank_timeout_s, which can then be short.
"""

from __future__ import annotations

import torch
from torch import distributed as dist


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def set_timeout(seconds: float) -> None:
    """How long a collective waits for the other ranks before it fails (training.rank_timeout_s). transformers passes
    its ddp_timeout to the process group except on the CPU (TrainingArguments._setup_devices: the use_cpu branch sets
    no timeout, so gloo waits accelerate's default 30 minutes for a hung rank): set on the group itself, through
    torch's `_set_pg_timeout` (a private function; where it is missing the group keeps its own)."""
    if world_size() <= 1:
        return
    from datetime import timedelta

    from torch.distributed import distributed_c10d

    setter = getattr(distributed_c10d, "_set_pg_timeout", None)
    if setter is not None:
        setter(timedelta(seconds=seconds), None)


# How long a rank waits for the others while the ranks build: torch's default process-group timeout (30 minutes,
# torch.distributed.constants.default_pg_timeout) and transformers' default ddp_timeout (1800 s).
SETUP_TIMEOUT_S = 1800


def building(timeout_s: float) -> None:
    """While the ranks build, a collective waits for the slowest up to the longer of `timeout_s` (the training's)
    and `SETUP_TIMEOUT_S`: a rank still importing or loading is late, not hung."""
    set_timeout(max(timeout_s, SETUP_TIMEOUT_S))


def ready(timeout_s: float) -> None:
    """Every rank is built: wait here for the slowest, then let the training's collectives wait `timeout_s`
    (training.rank_timeout_s) for a rank that stops answering."""
    barrier()
    set_timeout(timeout_s)


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


# How torch's backends say a collective failed because another rank is gone or hung (gloo: its sockets closed or
# reset, or the process group's timeout; NCCL: a watchdog timeout, a remote error).
PEER_TEXT = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Timed out waiting",  # gloo: "Timed out waiting 30000ms for recv operation to complete"
    "collective operation timeout",  # NCCL's watchdog
    "NCCL communicator was aborted",
    "remote process exited",
)


def lost_peer(exc: BaseException | None) -> bool:
    """Whether `exc` (or one it came from) is a collective that failed for want of another rank."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, RuntimeError | OSError) and any(text in str(exc) for text in PEER_TEXT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
