"""The caching allocator model against allocation sequences worked by hand from the rules of
c10/cuda/CUDACachingAllocator.cpp (torch 2.13): each expected figure is derived in the test's comments from those
rules (512 B rounding, 1 MiB small/large threshold, 2 MiB and 20 MiB segments, 2 MiB rounding of requests ≥ 10 MiB,
best fit, split thresholds, no merging across segments, max_split_size, expandable segments), not read from the
model's output."""

import pytest
import torch

from lowmem_ft.train.measure.allocator import Allocator, ReplayOutOfMemory
from lowmem_ft.train.measure.peak import PeakMemory

KiB, MiB = 1 << 10, 1 << 20


def test_small_requests_round_to_512_and_share_a_2_mib_segment():
    a = Allocator()
    a.malloc(1)  # 512 B block, small pool, a new 2 MiB segment
    assert (a.current.requested, a.current.allocated, a.current.reserved) == (1, 512, 2 * MiB)
    a.malloc(600 * KiB)  # 614,400 B = 1,200 × 512: same segment (512 + 614,400 < 2 MiB)
    a.malloc(1000)  # 1,024 B
    assert a.current.allocated == 512 + 600 * KiB + 1024
    assert a.current.reserved == 2 * MiB and a.segments == 1
    a.malloc(1500 * KiB)  # 1,536,000 B > 1 MiB: the large pool; < 10 MiB: a 20 MiB segment
    assert a.current.reserved == 22 * MiB and a.segments == 2


def test_two_small_requests_that_overflow_one_segment_open_a_second():
    a = Allocator()
    a.malloc(MiB)  # exactly kSmallSize: still small; the 2 MiB segment keeps 1 MiB free
    a.malloc(MiB)  # fits the remaining 1 MiB exactly
    assert a.current.reserved == 2 * MiB
    a.malloc(512)  # nothing left: a second 2 MiB segment
    assert a.current.reserved == 4 * MiB


def test_mid_sized_requests_pack_into_a_20_mib_segment():
    a = Allocator()
    a.malloc(4 * MiB)  # < kMinLargeAlloc: a 20 MiB segment, split (16 MiB rest > 1 MiB)
    a.malloc(16 * MiB)  # takes the 16 MiB rest exactly (best fit)
    assert a.current.reserved == 20 * MiB and a.current.allocated == 20 * MiB
    a.malloc(3 * MiB)  # nothing cached: a second 20 MiB segment
    assert a.current.reserved == 40 * MiB


def test_large_requests_round_to_2_mib_and_an_unsplit_remainder_counts_as_allocated():
    a = Allocator()
    a.malloc(11 * MiB)  # ≥ 10 MiB: its own segment of 12 MiB; rest 1 MiB is not > kSmallSize: not split
    assert a.current.reserved == 12 * MiB
    assert a.current.allocated == 12 * MiB  # max_memory_allocated counts the whole block
    assert a.current.requested == 11 * MiB


def test_freed_blocks_do_not_merge_across_segments():
    a = Allocator()
    x, y = a.malloc(12 * MiB), a.malloc(12 * MiB)  # two 12 MiB segments
    a.free(x)
    a.free(y)
    a.malloc(24 * MiB)  # 24 MiB free in the cache, but in two segments: a third segment
    assert a.current.reserved == 48 * MiB and a.peak.reserved == 48 * MiB
    assert a.current.allocated == 24 * MiB


def test_freed_neighbours_in_one_segment_merge():
    a = Allocator()
    x, y = a.malloc(4 * MiB), a.malloc(4 * MiB)  # one 20 MiB segment: x | y | 12 MiB free
    a.free(x)
    a.free(y)  # x, y and the free rest merge back into one 20 MiB block
    a.malloc(20 * MiB)  # fits the merged block
    assert a.current.reserved == 20 * MiB


def test_best_fit_takes_the_smallest_block_that_holds_the_request():
    a = Allocator()
    x, y = a.malloc(30 * MiB), a.malloc(40 * MiB)
    a.free(y)
    a.free(x)
    a.malloc(25 * MiB)  # best fit: the 30 MiB block, split (5 MiB rest > 1 MiB)
    a.malloc(39 * MiB)  # the 40 MiB block holds it, the 5 MiB rest does not; 1 MiB rest is not > 1 MiB: whole
    assert a.current.reserved == 70 * MiB
    assert a.current.allocated == (25 + 40) * MiB and a.current.requested == (25 + 39) * MiB
    a.malloc(5 * MiB)  # the 5 MiB rest of the 30 MiB segment, not a new segment
    assert a.current.reserved == 70 * MiB
    a.malloc(2 * MiB)  # nothing cached: a new 20 MiB segment
    assert a.current.reserved == 90 * MiB


def test_fragmentation_under_a_growing_request():
    a = Allocator()
    live = []
    for size in (20, 22, 24, 26):  # each step frees the last and asks 2 MiB more: nothing cached ever fits
        live.append(a.malloc(size * MiB))
        if len(live) > 1:
            a.free(live.pop(0))
    assert a.current.reserved == (20 + 22 + 24 + 26) * MiB
    assert a.peak.allocated == (24 + 26) * MiB


def test_max_split_size_keeps_oversize_blocks_for_large_requests():
    a = Allocator(max_split_size=20 * MiB)
    a.free(a.malloc(40 * MiB))  # a cached 40 MiB segment (≥ max_split_size: oversize)
    a.malloc(12 * MiB)  # below max_split_size: may not take the oversize block: a new 12 MiB segment
    assert a.current.reserved == 52 * MiB
    a.malloc(30 * MiB)  # ≥ max_split_size and 40 < 30 + 20: takes the 40 MiB block whole (no split)
    assert a.current.reserved == 52 * MiB and a.current.allocated == 52 * MiB
    a.free(a.malloc(60 * MiB))  # new 60 MiB segment, cached
    a.malloc(36 * MiB)  # 60 ≥ 36 + 20: refused, a new 36 MiB segment
    assert a.current.reserved == (52 + 60 + 36) * MiB


def test_without_max_split_size_a_large_cached_block_is_split():
    a = Allocator()
    a.free(a.malloc(40 * MiB))
    a.malloc(12 * MiB)  # best fit is the 40 MiB block: split, 28 MiB rest cached
    a.malloc(28 * MiB)
    assert a.current.reserved == 40 * MiB


def test_capacity_releases_whole_cached_segments_before_failing():
    a = Allocator(capacity=60 * MiB)
    keep = a.malloc(4 * MiB)  # a 20 MiB segment, split: 16 MiB rest cached, but the segment is in use
    a.free(a.malloc(24 * MiB))  # a 24 MiB segment, cached whole
    assert a.current.reserved == 44 * MiB
    a.malloc(30 * MiB)  # no cached block holds it; 44 + 30 > 60: the whole 24 MiB segment is released, 20 + 30 ≤ 60
    assert a.current.reserved == 50 * MiB and a.peak.reserved == 50 * MiB
    with pytest.raises(ReplayOutOfMemory):
        a.malloc(20 * MiB)  # the 16 MiB rest is too small, 50 + 20 > 60, and the split segment cannot be released
    assert keep.allocated


def test_expandable_segments_grow_one_segment_in_20_mib_pages():
    a = Allocator(expandable_segments=True)
    x = a.malloc(30 * MiB)  # maps 2 pages (40 MiB) of the large pool's segment; 10 MiB free at its end
    assert a.current.reserved == 40 * MiB
    a.malloc(5 * MiB)  # fits the 10 MiB free end (split: rest ≥ 512 B)
    assert a.current.reserved == 40 * MiB
    a.free(x)  # 30 MiB free at the start
    a.malloc(35 * MiB)  # no mapped block holds it; the 5 MiB free end + 30 MiB of new pages (2 pages = 40 MiB)
    assert a.current.reserved == 80 * MiB
    a.malloc(30 * MiB)  # the 30 MiB at the start: no new pages
    assert a.current.reserved == 80 * MiB


def test_expandable_segments_avoid_the_cross_segment_fragmentation():
    a = Allocator(expandable_segments=True)
    x, y = a.malloc(12 * MiB), a.malloc(12 * MiB)  # 24 MiB in one segment: 2 pages (40 MiB)
    a.free(x)
    a.free(y)  # merge into one 40 MiB free block (16 MiB of it was never used)
    a.malloc(24 * MiB)
    assert a.current.reserved == 40 * MiB  # against 48 MiB in three cudaMalloc segments (test above)


def test_expandable_best_fit_keeps_the_growing_end_for_last():
    a = Allocator(expandable_segments=True)
    x = a.malloc(12 * MiB)  # one 20 MiB page: x | 8 MiB free
    a.malloc(8 * MiB)  # the 8 MiB exactly
    a.malloc(10 * MiB)  # a second page: 10 MiB | 10 MiB free at the end
    a.free(x)  # free: 12 MiB at the start, 10 MiB at the growing end
    assert a.current.reserved == 40 * MiB
    a.malloc(8 * MiB)  # the smallest fit is the end (10 MiB), but it can grow: the 12 MiB block is taken
    a.malloc(11 * MiB)  # left: 4 MiB and the 10 MiB end: the end grows by one page
    assert a.current.reserved == 60 * MiB


def test_expandable_small_pool_uses_2_mib_pages():
    a = Allocator(expandable_segments=True)
    a.malloc(MiB)  # the small pool's segment: one 2 MiB page, split (1 MiB rest)
    a.malloc(MiB)  # the page's second half
    assert a.current.reserved == 2 * MiB
    a.malloc(700 * KiB)  # one more 2 MiB page
    assert a.current.reserved == 4 * MiB


def test_replay_reads_a_peak_memory_log_with_its_marks():
    log = []
    with PeakMemory(device="cpu", roots=[], log=log) as pm:
        x = torch.empty(3 * MiB // 4, dtype=torch.float32)  # 3 MiB: a 20 MiB segment
        y = torch.empty(256, dtype=torch.float32)  # 1 KiB: small pool
        pm.mark("first")
        del x
        z = torch.empty(6 * MiB // 4, dtype=torch.float32)  # 6 MiB: the 20 MiB segment, freed, holds it
        pm.mark("second")
    assert [e[0] for e in log] == ["+", "+", "mark", "-", "+", "mark"]
    windows = Allocator().replay(log)
    assert windows["first"].reserved == 22 * MiB and windows["first"].requested == 3 * MiB + 1024
    assert windows["second"].reserved == 22 * MiB and windows["second"].requested == 6 * MiB + 1024
    assert windows["total"].allocated == 6 * MiB + 1024
    del y, z


@pytest.mark.slow
def test_the_traced_step_log_replays_to_the_traced_peaks(zoo_models):
    """The tracer's allocation log holds every storage it counts: replayed, the requested bytes of each phase window
    are the trace's own peaks to the byte, and the allocator never holds less than was asked for."""
    from pathlib import Path

    from devkit.harness import estimator as estimator_check
    from devkit.harness.estimator import Point
    from lowmem_ft.train.trace.step import allocation_log, model_config, trace

    point = Point("qwen2.5", "lora", "adamw_torch", False, 2, 40)
    recipe = estimator_check.recipe_for(Path(zoo_models["qwen2.5"]), point)
    windows = Allocator().replay(allocation_log(recipe, model_config(recipe)))
    traced = trace(recipe, whole=True).marks
    assert set(traced) <= set(windows)
    for label, (peak, _) in traced.items():
        w = windows[label]
        assert w.requested == peak, label
        assert w.requested <= w.allocated <= w.reserved


def test_the_log_records_a_resized_storage_as_a_new_block_then_the_old_ones_free():
    log = []
    with PeakMemory(device="cpu", roots=[], log=log) as pm:
        x = torch.empty(256, dtype=torch.float32)  # 1 KiB
        x.resize_(1024)  # its storage grows to 4 KiB in place: a new block, the copy, then the old one freed
        pm.mark("after")
        del x
    assert log[1:3] == [("+", -1, 4096), ("-", log[0][1], 1024)]
    assert log[4] == ("-", -1, 4096)  # the storage's free names its new block
    assert Allocator().replay(log)["after"].requested == 4096 + 1024


def test_empty_cache_returns_whole_free_segments_and_keeps_any_segment_in_use():
    a = Allocator()
    x = a.malloc(12 * MiB)  # its own 12 MiB segment
    y = a.malloc(4 * MiB)  # a 20 MiB segment, split: 16 MiB cached beside y
    a.malloc(100)  # a 2 MiB small segment, in use
    a.free(x)
    a.free(y)  # y merges with its 16 MiB neighbour: the 20 MiB segment is whole and free again
    assert a.current.reserved == 34 * MiB
    a.empty_cache()  # release_cached_blocks: the free 12 and 20 MiB segments go; the small one holds a block
    assert a.current.reserved == 2 * MiB and a.segments == 1
    assert a.peak.reserved == 34 * MiB  # max_memory_reserved keeps its peak


@pytest.mark.slow
def test_a_one_micro_batch_step_runs_its_full_batch_without_gradients(zoo_models):
    """`ONE_MICRO_BATCH` (`allocation_log`'s sequence for a run of one micro batch per optimizer step): the full
    batch's forward runs with no gradient alive, so its window peaks exactly every gradient's bytes below the same
    forward in `STEPS`, where the micro batch before it left them accumulated (a full fine-tune: every weight's)."""
    from pathlib import Path

    from devkit.harness import estimator as estimator_check
    from devkit.harness.estimator import Point
    from lowmem_ft.choosing import setup_from_recipe
    from lowmem_ft.memory.arch import load_architecture
    from lowmem_ft.memory.estimate import estimate
    from lowmem_ft.train.trace.step import ONE_MICRO_BATCH, allocation_log, model_config

    point = Point("llama3", "full", "adamw_torch", False, 2, 40)
    recipe = estimator_check.recipe_for(Path(zoo_models["llama3"]), point)
    config = model_config(recipe)
    accumulating = Allocator().replay(allocation_log(recipe, config))
    one = Allocator().replay(allocation_log(recipe, config, steps=ONE_MICRO_BATCH))
    assert "forward 2.1" not in one and "optimizer 2" in one
    arch = load_architecture(recipe.model.name_or_path)
    gradients = estimate(arch, setup_from_recipe(recipe, "cpu")).by_name()["gradients"]  # exact on the CPU
    assert gradients > 0
    assert accumulating["forward 2.2"].requested - one["forward 2.2"].requested == gradients
