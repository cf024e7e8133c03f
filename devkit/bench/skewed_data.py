"""Shared by the data benchmarks: a deterministic skewed-length dataset in the formats lowmem-ft reads."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = [
    "the",
    "a",
    "red",
    "green",
    "blue",
    "cat",
    "dog",
    "owl",
    "fox",
    "bee",
    "cow",
    "one",
    "two",
    "three",
    "four",
    "five",
    "is",
    "of",
    "and",
    "to",
    "in",
    "what",
    "plus",
]


def skewed_lengths(n: int, seed: int = 0, median: int = 24, cap: int = 900) -> list[int]:
    """Word counts with a long tail (log-normal): most samples short, a few near `cap` — typical SFT data."""
    rng = random.Random(seed)
    return [max(2, min(cap, int(rng.lognormvariate(0, 1.1) * median))) for _ in range(n)]


def sentence(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def write_dataset(path: Path, fmt: str, n: int, seed: int = 0) -> Path:
    rng = random.Random(seed + 1)
    with path.open("w", encoding="utf-8") as handle:
        for length in skewed_lengths(n, seed):
            prompt, answer = sentence(rng, max(1, length // 3)), sentence(rng, max(1, length - length // 3))
            if fmt == "text":
                row = {"text": prompt + " " + answer}
            elif fmt == "prompt_completion":
                row = {"prompt": prompt, "completion": " " + answer}
            else:
                row = {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}
            handle.write(json.dumps(row) + "\n")
    return path
