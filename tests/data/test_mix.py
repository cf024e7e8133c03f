"""Mixing data sets by weight: exact counts, seeded and reproducible, recorded for run.json."""

from __future__ import annotations

import numpy as np
import pytest

from lowmem_ft.data.mix import mix_counts, mix_datasets, mix_record, mix_streams


def tagged(n: int, tag: int):
    from datasets import Dataset

    return Dataset.from_dict({"input_ids": [[tag, i] for i in range(n)], "labels": [[tag, i] for i in range(n)]})


def test_counts_follow_the_weights():
    # 100 and 30 rows at 3:1 — undersampling uses all 30 and 90 of the 100 (no repeats) ...
    assert mix_counts([100, 30], [3, 1], "undersample") == [90, 30]
    # ... oversampling uses all 100 and repeats the 30 up to 33 (100 / 0.75 = 133.3 samples in all)
    assert mix_counts([100, 30], [3, 1], "oversample") == [100, 33]
    assert mix_counts([10, 10, 10], [1, 1, 2], "undersample") == [5, 5, 10]
    assert mix_counts([7, 1000], [1, 1], "undersample") == [7, 7]


@pytest.mark.parametrize("strategy", ["undersample", "oversample"])
def test_the_mix_holds_exactly_the_counted_rows_and_the_same_seed_gives_the_same_mix(strategy):
    a, b = tagged(100, 0), tagged(30, 1)
    mixed, counts = mix_datasets([a, b], [3, 1], strategy, seed=7)
    rows = mixed["input_ids"]
    assert len(rows) == sum(counts)
    assert np.bincount([r[0] for r in rows]).tolist() == counts
    for tag, n in ((0, 100), (1, 30)):
        seen = [r[1] for r in rows if r[0] == tag]
        assert set(seen) <= set(range(n))
        if strategy == "undersample":
            assert len(set(seen)) == len(seen)  # no sample repeats
        else:
            assert set(seen) == set(range(n))  # every sample is used
    again, _ = mix_datasets([a, b], [3, 1], strategy, seed=7)
    assert again["input_ids"] == rows
    other, _ = mix_datasets([a, b], [3, 1], strategy, seed=8)
    assert other["input_ids"] != rows


def test_a_larger_source_gives_a_random_subset_not_its_first_rows():
    mixed, counts = mix_datasets([tagged(1000, 0), tagged(10, 1)], [1, 1], "undersample", seed=0)
    assert counts == [10, 10]
    picked = sorted(r[1] for r in mixed["input_ids"] if r[0] == 0)
    assert picked != list(range(10)) and max(picked) > 100


def test_streams_are_interleaved_by_weight_and_counted_on_their_head():
    a, b = tagged(2000, 0).to_iterable_dataset(), tagged(2000, 1).to_iterable_dataset()
    mixed, head, counts = mix_streams([a, b], [3, 1], "undersample", seed=1, head=400)
    assert len(head) == 400 and sum(counts) == 400 and "source" not in head.column_names
    assert 0.68 < counts[0] / 400 < 0.82  # random draws with probabilities 0.75 / 0.25
    assert [r["input_ids"] for r in head] == [r["input_ids"] for r, _ in zip(mixed, range(400), strict=False)]
    _, again, _ = mix_streams([a, b], [3, 1], "undersample", seed=1, head=400)
    assert again["input_ids"] == head["input_ids"]


def test_the_record_says_what_each_source_gave():
    rec = mix_record(["a.jsonl", "b.csv"], [100, 30], [3, 1], [100, 33], "oversample", 42, streaming=False)
    assert rec["samples"] == 133 and rec["seed"] == 42 and rec["strategy"] == "oversample"
    assert rec["sources"][0] == {
        "source": "a.jsonl",
        "weight": 3,
        "share": 0.75,
        "records": 100,
        "samples": 100,
        "repeated": 0,
        "not_used": 0,
    }
    assert rec["sources"][1]["repeated"] == 3
