"""The order a training epoch reads its samples in: seeded per epoch, the heaviest micro batch first.

A long sample that arrives at step 120 and runs out of memory there costs two hours; the same sample in step 1 costs
a minute. So each epoch's first micro batch is its heaviest by tokens — the most a batch will hold: micro batch ×
the longest sample in it where the collator pads, the sum of its samples' lengths where it does not (padding-free
packed rows) — and every other micro batch keeps its members and its place relative to the rest.

The order underneath is transformers' own (its length-grouped order, `get_length_grouped_indices`, or a random
permutation), each epoch's drawn from a generator seeded with (data seed + epoch): transformers'
`LengthGroupedSampler` draws it from the global RNG when the epoch's iterator is made, so a run resumed in its second
epoch saw other batches than one never stopped (measured: 1.7e-2 apart in the adapter of a tiny 12-step run resumed
at step 10, with or without dropout). The moved batch is a function of that order and the lengths alone, so
`--resume` (transformers skips the epoch's first batches of the same order) continues exactly. accelerate's
`DataLoaderShard.set_epoch` tells the sampler the epoch (also through `skip_first_batches`).

Under `train --gpus N`, accelerate deals the micro batches round robin (micro batch i to rank i mod N): the heaviest
goes to rank 0's first step. A stream (`data.streaming`) has no sampler: its order is its shuffle buffer's, and its
heaviest batch is not known before it is read.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import Sampler
from transformers.trainer_pt_utils import get_length_grouped_indices


def batch_tokens(batch: Sequence[int], lengths: Sequence[int], padded: bool) -> int:
    """Tokens a micro batch holds: padded to its longest sample, or (padding-free) its samples' lengths summed."""
    sizes = [lengths[i] for i in batch]
    return len(sizes) * max(sizes) if padded else sum(sizes)


def heaviest_first(order: list[int], lengths: Sequence[int], micro_batch: int, padded: bool = True) -> list[int]:
    """`order` with its heaviest micro batch (consecutive `micro_batch` indices) moved to the front, the others in
    their order. Whole batches move, so every batch keeps its members — except when the heaviest sample sits in the
    last, short batch (moving it would shift every boundary after it): then that sample trades places with the first
    batch's lightest, so step 1 still holds the longest sample."""
    batches = [order[i : i + micro_batch] for i in range(0, len(order), micro_batch)]
    if len(batches) < 2:
        return list(order)
    whole = batches if len(batches[-1]) == micro_batch else batches[:-1]
    heaviest = max(range(len(whole)), key=lambda b: (batch_tokens(whole[b], lengths, padded), -b))
    batches.insert(0, batches.pop(heaviest))
    last, first = batches[-1], batches[0]
    if len(last) < micro_batch:
        longest = max(range(len(last)), key=lambda i: lengths[last[i]])
        lightest = min(range(len(first)), key=lambda i: lengths[first[i]])
        if lengths[last[longest]] > max(lengths[i] for i in first):
            first[lightest], last[longest] = last[longest], first[lightest]
    return [i for batch in batches for i in batch]


class HeaviestFirstSampler(Sampler[int]):
    """An epoch's order (length-grouped in groups of `group_size`, or a random permutation when `group_size` is 0),
    seeded with `seed + epoch`, its heaviest micro batch first (`heaviest_first`)."""

    def __init__(
        self, lengths: Sequence[int], micro_batch: int, seed: int, *, group_size: int = 0, padded: bool = True
    ):
        self.lengths, self.micro_batch, self.seed = list(lengths), micro_batch, seed
        self.group_size, self.padded = group_size, padded
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def epoch_order(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        if self.group_size:
            order = get_length_grouped_indices(self.lengths, self.group_size, generator=generator)
        else:
            order = torch.randperm(len(self.lengths), generator=generator).tolist()
        return heaviest_first(order, self.lengths, self.micro_batch, self.padded)

    def __iter__(self) -> Iterator[int]:
        return iter(self.epoch_order())
