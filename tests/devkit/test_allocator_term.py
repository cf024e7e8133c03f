"""The allocator-term bench's instrumentation (`devkit.bench.allocator_term.stranded`): what a replay's excess of
reserved over live bytes is made of, on logs whose allocator behaviour is known from CUDACachingAllocator's rules."""

from __future__ import annotations

from devkit.bench.allocator_term import stranded

MiB = 1 << 20


def test_a_split_segment_strands_its_rest_when_a_larger_request_comes():
    """100 MiB freed, 60 MiB takes a piece of its segment (default settings split a large block when the rest is
    over 1 MiB), the next 100 MiB fits no cached block and maps a segment of its own: the excess is the 40 MiB
    rest, last held by the 100 MiB tensor, in the segment mapped for it."""
    log = [("+", 1, 100 * MiB), ("-", 1, 0), ("+", 2, 60 * MiB), ("+", 3, 100 * MiB)]
    at = stranded(log, "default")
    assert at["trigger"] == 100 * MiB and at["live"] == 160 * MiB and at["reserved"] == 200 * MiB
    assert at["free"] == 40 * MiB
    assert at["blocks"] == [(40 * MiB, 100 * MiB, (100 * MiB, 100 * MiB))]


def test_an_expandable_segment_grows_over_its_free_end():
    """The same log with expandable segments: the 40 MiB rest lies at the growing end and the new request maps
    only what it lacks (20 MiB pages), so nothing is stranded."""
    log = [("+", 1, 100 * MiB), ("-", 1, 0), ("+", 2, 60 * MiB), ("+", 3, 100 * MiB)]
    at = stranded(log, "expandable")
    assert at["reserved"] == 160 * MiB and at["free"] == 0 and at["blocks"] == []
