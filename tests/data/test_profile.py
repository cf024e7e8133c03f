"""The length profile: percentiles that cover the data, histogram, cuts, on data with known lengths."""

from __future__ import annotations

from lowmem_ft.data.prepare import length_profile
from lowmem_ft.data.profile import LengthProfile
from tests.data.conftest import fixture


def test_profile_of_known_lengths():
    p = LengthProfile.from_lengths([5] * 50 + [100] * 40 + [300] * 9 + [1000])
    assert (p.count, p.p50, p.p90, p.p99, p.max) == (100, 5, 100, 300, 1000)
    assert p.total_tokens == 250 + 4000 + 2700 + 1000
    assert p.histogram == [(8, 50), (16, 0), (32, 0), (64, 0), (128, 40), (256, 0), (512, 9), (1024, 1)]
    assert p.over(300) == (1, 700)
    assert p.over(99) == (50, 40 * 1 + 9 * 201 + 901)


def test_length_profile_of_a_file_counts_training_tokens(tokenizer, tiny_model):
    # known_lengths.jsonl: line k is k <|im_start|> special tokens; training appends EOS → k + 1 tokens.
    p = length_profile(path=fixture("known_lengths.jsonl"), tokenizer=tokenizer)
    assert p.lengths == tuple(range(2, 22))
    assert (p.count, p.p50, p.p90, p.p99, p.max) == (20, 11, 19, 21, 21)
    assert p.histogram == [(2, 1), (4, 2), (8, 4), (16, 8), (32, 5)]
    assert p.over(16) == (5, 1 + 2 + 3 + 4 + 5)


def test_length_profile_from_a_recipe(tiny_model):
    from lowmem_ft.recipe.load import resolve

    recipe = resolve(None, {"model": {"name_or_path": tiny_model}, "data": {"path": fixture("known_lengths.jsonl")}})
    assert length_profile(recipe).max == 21
