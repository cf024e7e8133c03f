"""Cutting micro batches into pieces: rows in order, packed rows at sample boundaries with their boundary tensors."""

from __future__ import annotations

import pytest
import torch

from lowmem_ft.train.resilience.split import label_count, sample_starts, samples_in, split_packed, split_rows


def packed(lengths: list[int], pad: int = 0) -> dict:
    """A padding-free row as TRL's collator makes it: samples of these lengths (then `pad` padding tokens)."""
    positions = torch.cat([torch.arange(n) for n in lengths] + ([torch.arange(pad)] if pad else []))[None]
    total = positions.shape[1]
    ids = torch.arange(100, 100 + total)[None]
    labels = ids.clone()
    labels[positions == 0] = -100  # TRL masks each sample's first label
    if pad:
        labels[0, -pad:] = -100
    starts = (positions[0] == 0).nonzero().flatten()
    cu = torch.cat([starts, torch.tensor([total])]).to(torch.int32)
    seq_idx = torch.repeat_interleave(torch.arange(cu.numel() - 1, dtype=torch.int32), cu.diff())[None]
    return {"input_ids": ids, "labels": labels, "position_ids": positions, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
            "max_length_q": int(cu.diff().max()), "max_length_k": int(cu.diff().max()), "seq_idx": seq_idx}  # fmt: skip


def test_split_rows_keeps_rows_in_order_and_shares_non_batch_values():
    batch = {"input_ids": torch.arange(15).reshape(5, 3), "labels": torch.arange(15).reshape(5, 3), "use_cache": False}
    parts = split_rows(batch, 2)
    assert [p["input_ids"].shape[0] for p in parts] == [2, 2, 1]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts]), batch["input_ids"])
    assert all(p["use_cache"] is False for p in parts)
    assert split_rows(batch, 8) == [batch]
    with pytest.raises(ValueError, match="disagree"):
        split_rows({"input_ids": torch.zeros(2, 3), "labels": torch.zeros(3, 3)}, 1)


def test_a_padded_batch_is_not_a_packed_row():
    assert sample_starts({"input_ids": torch.zeros(2, 4), "attention_mask": torch.ones(2, 4),
                          "position_ids": torch.zeros(2, 4)}) is None  # fmt: skip
    assert sample_starts(packed([3, 2])) == [0, 3]
    assert samples_in(packed([3, 2, 4])) == 3 and samples_in({"input_ids": torch.zeros(5, 2)}) == 5


def test_a_packed_row_is_cut_at_sample_boundaries_with_its_tensors_recomputed():
    batch = packed([5, 3, 4, 4], pad=2)  # 18 tokens; the padding is a "sample" of its own (positions restart)
    halves = split_packed(batch, 2)
    assert [p["input_ids"].shape[1] for p in halves] == [8, 10]  # the cut nearest 9 tokens
    assert torch.equal(torch.cat([p["input_ids"] for p in halves], dim=1), batch["input_ids"])
    first, second = halves
    assert first["cu_seq_lens_q"].tolist() == [0, 5, 8] and second["cu_seq_lens_k"].tolist() == [0, 4, 8, 10]
    assert first["cu_seq_lens_q"].dtype == torch.int32
    assert (first["max_length_q"], second["max_length_k"]) == (5, 4)
    assert first["seq_idx"].tolist() == [[0] * 5 + [1] * 3] and second["seq_idx"][0, 0] == 0
    assert all(p["position_ids"][0, 0] == 0 for p in halves)
    # no loss token crosses a cut: the pieces' loss tokens add up to the row's, as the trainer counts them
    assert sum(label_count(p, shifted=True) for p in halves) == label_count(batch, shifted=True)
    quarters = split_packed(batch, 4)
    assert [samples_in(p) for p in quarters] == [1, 1, 1, 2]
    assert len(split_packed(batch, 64)) == 5  # at most one piece per sample
    assert len(split_packed(packed([7]), 2)) == 1  # one sample: nothing to cut
