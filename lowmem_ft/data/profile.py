"""The data's token-length profile: what the planner needs to pick a sequence length, and what `data stats` prints.

Lengths come from the same tokenization as training (`lowmem_ft.data.tokenize`, chat template and EOS
included), before any truncation, so the profile says what the data *is*; `over(max_len)` says what a given budget
would cut. Percentiles are sample lengths that cover that share of the data (numpy's `inverted_cdf`: the smallest
length ℓ with at least q% of samples ≤ ℓ), so `max_seq_len = p99` really keeps 99% of samples whole.

The tokenized dataset behind it is cached by content (see `lowmem_ft.data.tokenize`), so asking twice reads the
arrow length column instead of tokenizing again.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class LengthProfile:
    """Token lengths of one data file (untruncated)."""

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

    def __getitem__(self, key: str):  # the planner may read it as a mapping: profile["p99"]
        return getattr(self, key)

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
    def from_lengths(cls, lengths) -> LengthProfile:
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
        )


def lengths_of(dataset) -> list[int]:
    """Token count of every row of a tokenized dataset (arrow, no Python loop over tokens)."""
    import pyarrow.compute as pc

    return pc.list_value_length(dataset.data.column("input_ids")).to_pylist()


def length_profile(
    recipe=None,
    *,
    path: str | Path | None = None,
    tokenizer=None,
    fmt: str | None = None,
    train_on_prompt: bool | None = None,
    skip_bad_lines: bool | None = None,
) -> LengthProfile:
    """The length profile of the recipe's training data (or of `path`), tokenized as training tokenizes it.

    Either `length_profile(recipe)` (data.path, model tokenizer, data.format/train_on_prompt/skip_bad_lines from the
    recipe) or `length_profile(path=..., tokenizer=...)`; explicit arguments override the recipe's.
    """
    from lowmem_ft.data.tokenize import load_tokenizer, tokenize_file

    if recipe is not None:
        d = recipe.data
        path = path or d.path
        fmt = fmt or d.format
        train_on_prompt = d.train_on_prompt if train_on_prompt is None else train_on_prompt
        skip_bad_lines = d.skip_bad_lines if skip_bad_lines is None else skip_bad_lines
        tokenizer = tokenizer or load_tokenizer(
            recipe.model.name_or_path, recipe.model.trust_remote_code, recipe.data.chat_template or None
        )
    if path is None or tokenizer is None:
        raise TypeError("length_profile needs a recipe, or path= and tokenizer=")
    tok = tokenize_file(
        path, tokenizer, fmt=fmt or "auto", train_on_prompt=bool(train_on_prompt), skip_bad_lines=bool(skip_bad_lines)
    )
    return profile_of(tok)


def profile_of(tokenized) -> LengthProfile:
    """Profile of a `Tokenized` result (lengths read from its arrow column; the tokens themselves are cached)."""
    return LengthProfile.from_lengths(lengths_of(tokenized.dataset))
