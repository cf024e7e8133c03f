"""Where the caching allocator's cached free blocks come from, for the explain tools (`devkit.bench.allocator_term
--explain`, `devkit.bench.published_leads --explain`): an allocation log replayed through the model of torch's
caching allocator (`lowmem_ft.train.measure.allocator`), keeping for every block the request that last held it (the
rest of a split block keeps its tenant) and for every segment what it was mapped for."""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

from lowmem_ft.train.measure.allocator import Allocator, Block


@dataclass(frozen=True)
class FreeBlock:
    """A cached free block: its size, the request that last held it (bytes; 0: none), its segment's start address
    and what that segment was mapped for (None where no segment is recorded)."""

    size: int
    last: int
    segment: int | None
    made: Any


class Tenants:
    """`alloc` driven request by request, with each block's last tenant and each segment's maker recorded;
    `segments` False (expandable segments: one segment grows in place) records no segment."""

    def __init__(self, alloc: Allocator, segments: bool = True):
        self.alloc = alloc
        self.segments = segments
        self.live: dict[Any, Block] = {}
        self._tenant: dict[Block, int] = {}  # keyed by the block itself: no id reuse
        self._starts: list[int] = []  # the recorded segments' start addresses, sorted
        self._made: list[Any] = []  # what each was mapped for, in the same order

    def malloc(self, key: Any, nbytes: int, made: Any = None) -> Block:
        """Allocate `nbytes` for `key`; a segment this maps records `made` (None: the bytes it added and `nbytes`)."""
        before = self.alloc.current.reserved
        block = self.live[key] = self.alloc.malloc(nbytes)
        rest = block.next  # the rest of a split block: a piece of what its previous tenant held
        if rest is not None and not rest.allocated and rest not in self._tenant:
            self._tenant[rest] = self._tenant.get(block, 0)
        self._tenant[block] = nbytes
        grew = self.alloc.current.reserved - before
        if self.segments and grew > 0:  # a new segment starts at the block
            j = bisect.bisect(self._starts, block.addr)
            self._starts.insert(j, block.addr)
            self._made.insert(j, (grew, nbytes) if made is None else made)
        return block

    def free(self, key: Any) -> Block | None:
        """Free `key`'s block (None: `key` holds none)."""
        block = self.live.pop(key, None)
        if block is not None:
            self.alloc.free(block)
        return block

    def segment(self, addr: int) -> int | None:
        """The start address of the recorded segment `addr` lies in (None: before every recorded one)."""
        j = bisect.bisect(self._starts, addr) - 1
        return self._starts[j] if j >= 0 else None

    def free_blocks(self) -> list[FreeBlock]:
        """The cached free blocks now, in the allocator's order."""
        out = []
        for b in self.alloc.cached_free_blocks():
            j = bisect.bisect(self._starts, b.addr) - 1
            seg, made = (self._starts[j], self._made[j]) if j >= 0 else (None, None)
            out.append(FreeBlock(b.size, self._tenant.get(b, 0), seg, made))
        return out
