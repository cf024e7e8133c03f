"""The sequence lengths the planner chooses and offers: multiples of SEQ_MULTIPLE, and the search for the longest
that fits (`planner.max_seq_len`, `choosing`'s length from the data)."""

from __future__ import annotations

from collections.abc import Callable

# The one rounding rule for the lengths the planner chooses: a multiple of 16 tokens (tensor-core friendly tiles),
# rounded up to cover the data, down to fit memory.
SEQ_MULTIPLE = 16
MAX_SEQ_LEN = 262144  # where `planner.max_seq_len` starts its search


def round_seq_len(tokens: int, up: bool = True) -> int:
    """`tokens` as a multiple of SEQ_MULTIPLE: up (to cover a length) or down (to stay within one)."""
    steps = -(-tokens // SEQ_MULTIPLE) if up else tokens // SEQ_MULTIPLE
    return steps * SEQ_MULTIPLE


def longest_length(fits: Callable[[int], bool], limit: int) -> int:
    """The longest multiple of SEQ_MULTIPLE up to `limit` for which `fits(length)` holds (binary search: `fits`
    holds up to some length and not beyond), else 0."""
    lo, hi, best = 1, limit // SEQ_MULTIPLE, 0
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(mid * SEQ_MULTIPLE):
            best, lo = mid * SEQ_MULTIPLE, mid + 1
        else:
            hi = mid - 1
    return best
