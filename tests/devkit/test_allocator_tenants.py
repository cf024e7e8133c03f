"""The explain tools' replay: each cached free block's last tenant and its segment's maker."""

from __future__ import annotations

from devkit.harness.allocator_tenants import Tenants
from lowmem_ft.train.measure.allocator import Allocator

MiB = 1 << 20


def test_a_split_block_keeps_its_tenant_and_its_segment_says_what_it_was_mapped_for():
    replay = Tenants(Allocator())
    replay.malloc("a", 50 * MiB)
    assert replay.free("a") is not None and replay.free("a") is None  # freed once; a key holds no block after
    replay.malloc("b", 30 * MiB, made="unused: no segment is mapped for b")
    (rest,) = replay.free_blocks()  # b took the front of a's block; the rest is a piece of what a held
    assert rest.size == 20 * MiB and rest.last == 50 * MiB
    assert rest.made == (50 * MiB, 50 * MiB) and rest.segment == replay.segment(replay.live["b"].addr)
    replay.malloc("c", 64 * MiB, made="c's")  # no cached block holds it: a segment of its own
    assert replay.segment(replay.live["c"].addr) != rest.segment
    replay.free("c")
    assert {f.made for f in replay.free_blocks()} == {(50 * MiB, 50 * MiB), "c's"}


def test_expandable_segments_record_no_segment():
    replay = Tenants(Allocator(expandable_segments=True), segments=False)
    replay.malloc("a", 50 * MiB)
    replay.free("a")
    assert all(f.segment is None and f.made is None and f.last == 50 * MiB for f in replay.free_blocks())
