"""The data's token-length profile: what planning needs to pick a sequence length, and what `data stats` prints.

The one `LengthProfile` of the package: `lowmem_ft.choosing` sizes `memory.max_seq_len` from its p99 (and says
how many samples a shorter length cuts, `over`).

Lengths come from the same tokenization as training (`lowmem_ft.data.tokenize`, chat template and EOS
included), before any truncation, so the profile says what the data *is*; `over(max_len)` says what a given budget
would cut. Percentiles are sample lengths that cover that share of the data (numpy's `inverted_cdf`: the smallest
length ℓ with at least q% of samples ≤ ℓ), so `max_seq_len = p99` really keeps 99% of samples whole.

The tokenized dataset behind it is cached by content (see `lowmem_ft.data.tokenize`), so asking twice reads the
arrow length column instead of tokenizing again.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class LengthProfile:
    """Token lengths of the training data (untruncated)."""

    count: int
    p50: int
    p90: int
    p99: int
    max: int
    mean: float
    total_tokens: int
    histogram: list[tuple[int, int]] = field(
        default_factory=list
    )  # (upper bound in tokens, samples ≤ it and > the previous)
    lengths: tuple[int, ...] = field(default=(), repr=False, compare=False)  # every sample's length, for over()
    sampled: int = 0  # 0: every sample; N: only the first N samples of a stream (data.streaming) were measured
    image_patches: int = 0  # image chats: the most pixel-value rows (patches) of one sample's images at the cap

    def over(self, max_len: int) -> tuple[int, int]:
        """(samples longer than max_len, tokens beyond max_len in them) — what keep_start/keep_end would cut."""
        longer = [n for n in self.lengths if n > max_len]
        return len(longer), sum(n - max_len for n in longer)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("lengths")
        d["histogram"] = [list(b) for b in self.histogram]
        return d

    @classmethod
    def from_lengths(cls, lengths, sampled: int = 0) -> LengthProfile:
        import numpy as np

        arr = np.asarray(list(lengths), dtype=np.int64)
        if arr.size == 0:
            raise ValueError("no samples to profile")

        def pct(q: float) -> int:
            return int(np.percentile(arr, q, method="inverted_cdf"))

        # Power-of-two buckets: the sequence lengths people choose, and a readable spread for skewed data.
        top = 1 << int(np.ceil(np.log2(max(int(arr.max()), 1))))
        edges = [1 << k for k in range(0, top.bit_length())]
        # bucket k holds lengths in (edges[k-1], edges[k]]; counted as "≤ edge" minus "≤ previous edge"
        le = np.searchsorted(np.sort(arr), edges, side="right")
        counts = np.diff([0, *le])
        histogram = [(e, int(c)) for e, c in zip(edges, counts, strict=True)]
        while histogram and histogram[0][1] == 0:  # drop the empty short buckets
            histogram.pop(0)
        return cls(
            count=int(arr.size),
            p50=pct(50),
            p90=pct(90),
            p99=pct(99),
            max=int(arr.max()),
            mean=round(float(arr.mean()), 2),
            total_tokens=int(arr.sum()),
            histogram=histogram,
            lengths=tuple(int(x) for x in arr),
            sampled=sampled,
        )


def lengths_of(dataset) -> list[int]:
    """Token count of every row of a tokenized dataset (arrow, no Python loop over tokens)."""
    import pyarrow.compute as pc

    lengths = pc.list_value_length(dataset.data.column("input_ids"))
    # A select() / shuffle() view (held-out splits, data.mix) keeps the whole table and an indices mapping over it
    # (datasets' own layout); its rows are the table's rows taken in that order.
    if dataset._indices is not None:
        lengths = pc.take(lengths, dataset._indices.column(0))
    return lengths.to_pylist()


def profile_of(tokenized) -> LengthProfile:
    """Profile of a `Tokenized` result (lengths read from its arrow column; the tokens themselves are cached)."""
    if tokenized.head is not None:  # a stream: its first samples
        return LengthProfile.from_lengths(lengths_of(tokenized.head), sampled=len(tokenized.head))
    return LengthProfile.from_lengths(lengths_of(tokenized.dataset))
