"""The token budget: samples at, over and far over max_len under each truncate mode, and its report."""

from __future__ import annotations

import pytest
from datasets import Dataset

from lowmem_ft.data.budget import apply_budget, check_budget
from lowmem_ft.errors import UserError


def rows(*samples):
    """Samples as (input_ids, labels); labels default to input_ids (loss on every token)."""
    out = {"input_ids": [], "labels": []}
    for s in samples:
        ids, labels = s if isinstance(s, tuple) else (s, s)
        out["input_ids"].append(list(ids))
        out["labels"].append(list(labels))
    return Dataset.from_dict(out)


def test_sample_exactly_at_the_limit_is_kept_whole():
    for mode in ("keep_start", "keep_end", "drop"):
        ds, report = apply_budget(rows(range(8)), 8, mode, 0, "text")
        assert ds["input_ids"] == [list(range(8))]
        assert report["kept_whole"] == 1 and report["tokens_lost"] == 0
    ds, report = apply_budget(rows(range(8)), 8, "chunk", 3, "text")
    assert ds["input_ids"] == [list(range(8))] and report["chunked"] == 0


def test_keep_start_and_keep_end_cut_the_right_side():
    data = rows(range(10), range(100, 104))
    ds, report = apply_budget(data, 8, "keep_start", 0, "text")
    assert ds["input_ids"] == [list(range(8)), list(range(100, 104))]
    assert (report["truncated"], report["tokens_lost"], report["kept_whole"]) == (1, 2, 1)
    ds, report = apply_budget(data, 8, "keep_end", 0, "text")
    assert ds["input_ids"][0] == list(range(2, 10))
    assert report["tokens_out"] == 12


def test_drop_removes_and_counts():
    ds, report = apply_budget(rows(range(9), range(3)), 8, "drop", 0, "text")
    assert ds["input_ids"] == [[0, 1, 2]]
    assert (report["dropped_too_long"], report["tokens_lost"], report["samples_out"]) == (1, 9, 1)


def test_truncation_that_leaves_no_loss_tokens_drops_and_counts():
    prompt_heavy = (range(10), [-100] * 8 + [8, 9])  # the completion is the last 2 tokens
    ds, report = apply_budget(rows(prompt_heavy, range(3)), 8, "keep_start", 0, "prompt_completion")
    assert len(ds) == 1 and report["dropped_no_loss_tokens"] == 1 and report["tokens_lost"] == 10
    ds, report = apply_budget(rows(prompt_heavy), 8, "keep_end", 0, "prompt_completion")
    assert ds["labels"] == [[-100] * 6 + [8, 9]] and report["truncated"] == 1


@pytest.mark.parametrize("n", [9, 10, 17, 23])
def test_chunks_cover_every_token_and_learn_each_once(n):
    max_len, overlap = 8, 3
    ds, report = apply_budget(rows(range(n)), max_len, "chunk", overlap, "text")
    pieces = ds["input_ids"]
    assert all(len(p) <= max_len for p in pieces)
    assert pieces[0] == list(range(8))
    for prev, cur in zip(pieces, pieces[1:], strict=False):  # sliding window: each starts `overlap` back
        assert cur[:overlap] == prev[-overlap:]
    learned = [t for labels in ds["labels"] for t in labels if t != -100]
    assert learned == list(range(n))  # every token, exactly once, in order
    assert report["chunked"] == 1 and report["chunks_out"] == len(pieces) and report["tokens_lost"] == 0


def test_overlap_at_or_over_the_chunk_length_is_rejected():
    for overlap in (8, 9, -1):
        with pytest.raises(UserError, match=r"data\.overlap=.* smaller than the chunk length memory\.max_seq_len=8"):
            check_budget(8, "chunk", overlap)
    check_budget(8, "chunk", 7)
    check_budget(8, "keep_start", 99)  # overlap only matters for chunk


def test_chunking_chat_data_is_refused():
    with pytest.raises(UserError, match="splits plain-text documents only, and this data is messages"):
        apply_budget(rows(range(3)), 8, "chunk", 2, "messages")


def test_nothing_left_is_a_user_error():
    with pytest.raises(UserError, match="no sample is left"):
        apply_budget(rows(range(9)), 8, "drop", 0, "text")
