"""What PyTorch's CUDA caching allocator reserves for a sequence of allocations: a replay of the tracer's log.

The tracer (`lowmem_ft.train.trace.step`) and the CPU yardstick count live tensor bytes: the bytes each storage asks for.
A GPU runs out of memory on what the caching allocator has *reserved* from the driver (`max_memory_reserved`), which
is more: each request is rounded up, served from a cached segment split to fit or from a new segment, and a free
block is only merged with its neighbours in the same segment, never across segments, so freed memory can be cached
in pieces too small for the next request (fragmentation). `Allocator` replays an allocation log — the storages'
allocations and frees in the order the step made them, `PeakMemory(log=[...])` — through the rules of
`DeviceCachingAllocator` in c10/cuda/CUDACachingAllocator.cpp (torch 2.13; the constants are also in the installed
headers, include/c10/core/AllocatorConfig.h), and reports the peaks of requested, allocated and reserved bytes.

The rules, as that file states and implements them (function names are the C++ ones):
- `round_size`: a request is rounded up to a multiple of kMinBlockSize = 512 B (512 B at least).
- `get_pool`: a rounded size ≤ kSmallSize = 1 MiB is served from the small pool, larger from the large pool.
- `get_free_block`: the best fit — the smallest cached free block of the pool that holds the request (among equal
  sizes the lowest address: the pool is a set ordered by (stream, size, address)). With `max_split_size` set, a
  block ≥ max_split_size is never given to a request below it, and a request ≥ max_split_size takes a cached block
  only if it is less than kLargeBuffer = 20 MiB larger.
- `get_allocation_size` (no cached block fits: a new segment from cudaMalloc): kSmallBuffer = 2 MiB for a small
  request, kLargeBuffer = 20 MiB for a request below kMinLargeAlloc = 10 MiB, otherwise the request rounded up to
  kRoundLarge = 2 MiB.
- `should_split`: the block found is split, the rest going back to the cache, when the rest is ≥ 512 B (small pool),
  or > kSmallSize and the request below max_split_size (large pool); otherwise the request takes the whole block
  (and `allocated_bytes`, what `max_memory_allocated` reports, counts the whole block).
- `free_block` / `try_merge_blocks`: a freed block merges with its free neighbours of the same segment.
- Under a memory limit (`capacity`: the card less what is not the allocator's), when cudaMalloc would fail:
  `release_available_cached_blocks` (only with max_split_size: free cached oversize blocks), then
  `release_cached_blocks` (every cached block that is a whole segment) and retry, else out of memory.
- `expandable_segments:True` (Note [Expandable Segments]): one segment per pool and stream that grows by mapping
  pages — 2 MiB for the small pool, 20 MiB for the large — at its lowest free address (the end, unless freed space
  precedes it); blocks split whenever the rest is ≥ 512 B; the best fit prefers a block that is not the growing
  end. Pages are unmapped only on release (empty_cache, or the retry above), which this model does not do.

What it leaves out, and why that is safe for one training step: streams (the log has one — the CPU trace has no
streams; activation offloading's side stream and `record_stream` events are not modelled), CUDA graphs' private
pools, `roundup_power2_divisions` and `garbage_collection_threshold` (off by default), and memory outside the
allocator (the CUDA context, cuBLAS handles' workspaces: `lowmem_ft.memory.overheads`), and bitsandbytes' paged
optimizer states, which live in CUDA managed memory outside the caching allocator. Addresses are modelled, not
known: a new segment takes the next free address range, which decides only ties between equal-sized free blocks.

Why it lives in `lowmem_ft.train` beside the tracer, not in the memory model: its input is the tracer's log (the
memory model imports no torch and has no allocation sequence), and `plan --verify` is where a reserved figure
would be shown; it imports nothing but the standard library.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field

# c10/core/AllocatorConfig.h (torch 2.13) and c10/cuda/CUDACachingAllocator.cpp
MIN_BLOCK = 512  # kMinBlockSize: every size is rounded to a multiple of 512 B
SMALL_SIZE = 1 << 20  # kSmallSize: the largest "small" request, 1 MiB
SMALL_BUFFER = 2 << 20  # kSmallBuffer: small requests are packed in 2 MiB segments
LARGE_BUFFER = 20 << 20  # kLargeBuffer: requests between 1 and 10 MiB are packed in 20 MiB segments
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge: larger requests get a segment of their size rounded up to 2 MiB
NO_LIMIT = 1 << 62  # max_split_size's default (SIZE_MAX: no limit)
_SPACE = 1 << 50  # an expandable segment's address space (the driver reserves 1 1/8 of the card; unbounded here)


class ReplayOutOfMemory(Exception):
    """The replay asked for more than `capacity` with nothing left to release (torch's OutOfMemoryError)."""


@dataclass(eq=False)
class Block:
    addr: int
    size: int
    small: bool
    allocated: bool = False
    mapped: bool = True
    expandable: bool = False
    requested: int = 0
    prev: Block | None = None
    next: Block | None = None

    @property
    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def key(self) -> tuple[int, int]:
        return self.size, self.addr


@dataclass
class Peaks:
    requested: int = 0  # live bytes as asked for: what the tracer and `PeakMemory` count
    allocated: int = 0  # the blocks handed out (rounded, unsplit remainders included): `max_memory_allocated`
    reserved: int = 0  # segments (or mapped pages) held from the driver: `max_memory_reserved`

    def raise_to(self, now: Peaks) -> None:
        """Each peak to at least the figure `now` holds."""
        self.requested = max(self.requested, now.requested)
        self.allocated = max(self.allocated, now.allocated)
        self.reserved = max(self.reserved, now.reserved)


class _Pool:
    """The cached free blocks of one pool, ordered by (size, address) as the C++ `BlockPool::blocks` set."""

    def __init__(self, small: bool):
        self.small = small
        self.keys: list[tuple[int, int]] = []
        self.blocks: list[Block] = []

    def insert(self, block: Block) -> None:
        i = bisect.bisect_left(self.keys, block.key())
        self.keys.insert(i, block.key())
        self.blocks.insert(i, block)

    def remove(self, block: Block) -> None:
        i = bisect.bisect_left(self.keys, block.key())
        while self.blocks[i] is not block:  # equal keys cannot occur (addresses differ); guard anyway
            i += 1
        del self.keys[i], self.blocks[i]

    def lower_bound(self, size: int) -> int:
        return bisect.bisect_left(self.keys, (size, -1))


@dataclass
class Allocator:
    """A model of one device's `DeviceCachingAllocator` on one stream (see the module docstring)."""

    max_split_size: int = NO_LIMIT  # PYTORCH_CUDA_ALLOC_CONF max_split_size_mb, in bytes
    expandable_segments: bool = False  # PYTORCH_CUDA_ALLOC_CONF expandable_segments:True
    capacity: int | None = None  # bytes the allocator may reserve (None: no limit; the peak is then what it asks)
    current: Peaks = field(default_factory=Peaks)
    peak: Peaks = field(default_factory=Peaks)
    segments: int = 0  # cudaMalloc calls (or page mappings) so far

    def __post_init__(self):
        self._pools = {True: _Pool(True), False: _Pool(False)}
        self._next_addr = 1 << 32
        self._tails: dict[bool, Block] = {}  # expandable: each pool's unmapped end

    def cached_free(self) -> list[int]:
        """The sizes of the cached free blocks (mapped and not in use): `memory_reserved` − `memory_allocated`."""
        return [b.size for b in self.cached_free_blocks()]

    def cached_free_blocks(self) -> list[Block]:
        """The cached free blocks themselves (their addresses say which segment each lies in)."""
        return [b for pool in self._pools.values() for b in pool.blocks]

    # -- sizes -----------------------------------------------------------------------------------------------------
    @staticmethod
    def round_size(size: int) -> int:
        return MIN_BLOCK if size < MIN_BLOCK else MIN_BLOCK * -(-size // MIN_BLOCK)

    @staticmethod
    def allocation_size(size: int) -> int:
        if size <= SMALL_SIZE:
            return SMALL_BUFFER
        if size < MIN_LARGE_ALLOC:
            return LARGE_BUFFER
        return ROUND_LARGE * -(-size // ROUND_LARGE)

    def _should_split(self, block: Block, size: int) -> bool:
        remaining = block.size - size
        if block.small or self.expandable_segments:
            return remaining >= MIN_BLOCK
        return size < self.max_split_size and remaining > SMALL_SIZE

    # -- malloc / free ---------------------------------------------------------------------------------------------
    def malloc(self, nbytes: int) -> Block:
        size = self.round_size(nbytes)
        pool = self._pools[size <= SMALL_SIZE]
        block = self._free_block(pool, size) or self._new_block(pool, size)
        if self._should_split(block, size):
            rest = Block(block.addr + size, block.size - size, block.small, expandable=block.expandable)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            pool.insert(rest)
        block.allocated, block.requested = True, nbytes
        self._count(nbytes, block.size, 0)
        return block

    def free(self, block: Block) -> None:
        block.allocated = False
        self._count(-block.requested, -block.size, 0)
        pool = self._pools[block.small]
        for other in (block.prev, block.next):
            self._merge(block, other, pool)
        pool.insert(block)

    def _count(self, requested: int, allocated: int, reserved: int) -> None:
        cur = self.current
        cur.requested += requested
        cur.allocated += allocated
        cur.reserved += reserved
        self.peak.raise_to(cur)

    def _merge(self, dst: Block, src: Block | None, pool: _Pool) -> None:
        """`try_merge_blocks`: `src` (a free neighbour in the same segment) joins `dst`; mapped pages never join
        the unmapped end."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return
        if src.mapped:
            pool.remove(src)
        if dst.prev is src:
            dst.addr, dst.prev = src.addr, src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    def _free_block(self, pool: _Pool, size: int) -> Block | None:
        """`get_free_block`: the best-fitting cached block, or None."""
        i = pool.lower_bound(size)
        if i == len(pool.blocks):
            return None
        if self.expandable_segments:  # best fit by the size a block can grow to: the growing end comes last
            while i + 1 < len(pool.blocks) and self._grows_to(pool.blocks[i + 1]) < self._grows_to(pool.blocks[i]):
                i += 1
        block = pool.blocks[i]
        if size < self.max_split_size <= block.size:
            return None  # an oversize block is not split for a smaller request
        if size >= self.max_split_size and block.size >= size + LARGE_BUFFER:
            return None
        pool.remove(block)
        return block

    @staticmethod
    def _grows_to(block: Block) -> int:
        nxt = block.next
        return block.size + (nxt.size if nxt is not None and not nxt.mapped else 0)

    # -- new memory ------------------------------------------------------------------------------------------------
    def _new_block(self, pool: _Pool, size: int) -> Block:
        """`alloc_block`, with the releases and retries of `malloc` under a capacity."""
        grow = self._expansion(pool, size) if self.expandable_segments else self.allocation_size(size)
        if self.capacity is not None and self.current.reserved + grow > self.capacity:
            if not self.expandable_segments:
                self._release_oversize(pool, size)
                if self.current.reserved + grow > self.capacity:
                    self._release_cached()
            if self.current.reserved + grow > self.capacity:
                raise ReplayOutOfMemory(
                    f"tried to allocate {grow} B with {self.current.reserved} B reserved of {self.capacity} B"
                )
        if self.expandable_segments:
            return self._expand(pool, grow)
        block = Block(self._next_addr, grow, pool.small)
        self._next_addr += grow
        self.segments += 1
        self._count(0, 0, grow)
        return block

    def _release_oversize(self, pool: _Pool, size: int) -> None:
        """`release_available_cached_blocks`: with max_split_size set, free cached oversize segments — the
        smallest that holds the request, else the largest ones until as many bytes are freed."""
        if self.max_split_size == NO_LIMIT:
            return
        want = max(size, self.max_split_size)
        i = pool.lower_bound(want)
        if i < len(pool.blocks):
            self._release(pool, pool.blocks[i])
            return
        released, i = 0, len(pool.blocks) - 1
        while i >= 0 and released < want and pool.blocks[i].size >= self.max_split_size:
            released += pool.blocks[i].size
            self._release(pool, pool.blocks[i])  # an oversize block is never split: a whole segment
            i -= 1

    def empty_cache(self) -> None:
        """`torch.cuda.empty_cache()` (`emptyCache` → `release_cached_blocks`): every cached block that is a whole
        segment goes back to the driver; a segment with any block in use stays."""
        self._release_cached()

    def _release_cached(self) -> None:
        """`release_cached_blocks`: give back every cached block that is a whole segment."""
        for pool in self._pools.values():
            for block in [b for b in pool.blocks if not b.is_split]:
                self._release(pool, block)

    def _release(self, pool: _Pool, block: Block) -> None:
        pool.remove(block)
        self.segments -= 1
        self._count(0, 0, -block.size)

    # -- expandable segments ---------------------------------------------------------------------------------------
    def _tail(self, pool: _Pool) -> Block:
        tail = self._tails.get(pool.small)
        if tail is None:  # the segment's whole address space, unmapped
            tail = Block(self._next_addr, _SPACE, pool.small, mapped=False, expandable=True)
            self._next_addr += _SPACE
            self._tails[pool.small] = tail
        return tail

    def _expansion(self, pool: _Pool, size: int) -> int:
        """Bytes of new pages `_expand` will map for `size`."""
        tail = self._tail(pool)
        start = tail.prev if tail.prev is not None and not tail.prev.allocated else None
        need = size - (start.size if start is not None else 0)
        page = SMALL_BUFFER if pool.small else LARGE_BUFFER
        return page * -(-need // page)

    def _expand(self, pool: _Pool, grow: int) -> Block:
        """`try_allocate_expandable_block`: map `grow` bytes of pages (`_expansion`) at the segment's end (after a
        free block there, if any)."""
        tail = self._tail(pool)
        mapped = Block(tail.addr, grow, pool.small, expandable=True)
        mapped.prev, mapped.next = tail.prev, tail
        if tail.prev is not None:
            tail.prev.next = mapped
        tail.prev = mapped
        tail.addr += grow
        tail.size -= grow
        self.segments += 1
        self._count(0, 0, grow)
        self._merge(mapped, mapped.prev, pool)  # the free block before the end joins the new pages
        return mapped

    # -- logs ------------------------------------------------------------------------------------------------------
    def replay(self, log: Iterable[tuple]) -> dict[str, Peaks]:
        """Replay a `PeakMemory` log: ("+", key, nbytes) allocates, ("-", key, nbytes) frees, ("mark", label, 0)
        closes a window. Returns label → the peaks within the window that label closes (and "total": overall).
        Zero-byte storages allocate nothing (torch's `allocate` skips malloc for size 0)."""
        live: dict[int, Block] = {}
        windows: dict[str, Peaks] = {}
        window = Peaks(**vars(self.current))
        for kind, key, nbytes in log:
            if kind == "+":
                if nbytes:
                    live[key] = self.malloc(nbytes)
                    window.raise_to(self.current)
            elif kind == "-":
                block = live.pop(key, None)
                if block is not None:
                    self.free(block)
            else:
                windows[key] = window
                window = Peaks(**vars(self.current))
        windows["total"] = Peaks(**vars(self.peak))
        return windows
