"""The step-down policy, batch splitting and allocator set-up (no training)."""

from __future__ import annotations

import pytest
import torch

from lowmem_ft.train import guard
from lowmem_ft.train.guard import OOMGuard, cap_process_memory, configure_allocator, label_count, split_batch


def test_step_down_halves_then_checkpoints_then_gives_up():
    g = OOMGuard(micro_batch=6, gradient_accumulation=2, checkpointing=False)
    steps = []
    while (action := g.step_down()) is not None:
        steps.append((action.split(",")[0], g.sub_batch, g.split, g.effective_accumulation, g.checkpointing))
    assert steps == [
        ("micro batch 6 → 3", 3, 2, 4, False),
        ("micro batch 3 → 2", 2, 3, 6, False),  # ceil halving: 3 rows as sub-batches of 2 + 1
        ("micro batch 2 → 1", 1, 6, 12, False),
        ("activation checkpointing switched on (micro batch already 1)", 1, 6, 12, True),
    ]
    assert g.describe()["effective_batch"] == 12  # unchanged throughout


def test_split_batch_keeps_rows_in_order_and_shares_non_batch_values():
    batch = {
        "input_ids": torch.arange(15).reshape(5, 3),
        "labels": torch.arange(15).reshape(5, 3),
        "use_cache": False,
    }
    parts = split_batch(batch, 2)
    assert [p["input_ids"].shape[0] for p in parts] == [2, 2, 1]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts]), batch["input_ids"])
    assert all(p["use_cache"] is False for p in parts)
    assert split_batch(batch, 8) == [batch]
    with pytest.raises(ValueError, match="disagree"):
        split_batch({"input_ids": torch.zeros(2, 3), "labels": torch.zeros(3, 3)}, 1)
    # a packed (padding-free) batch is one row with per-sequence tensors beside it: nothing to split
    packed = {"input_ids": torch.zeros(1, 9), "position_ids": torch.zeros(1, 9), "cu_seq_lens_q": torch.zeros(3)}
    assert split_batch(packed, 1) == [packed]


def test_label_count_matches_the_trainers_causal_shift():
    labels = torch.tensor([[-100, 5, 6, -100], [1, 2, -100, -100]])
    assert label_count({"labels": labels}, shifted=True) == 3  # labels[..., 1:] drops the first column
    assert label_count({"labels": labels}, shifted=False) == 4
    assert label_count({"labels": labels, "shift_labels": torch.tensor([[1, -100]])}, shifted=True) == 1


def test_allocator_conf_is_set_unless_the_user_set_it(monkeypatch):
    monkeypatch.delenv(guard.ALLOC_CONF, raising=False)
    assert configure_allocator() == "expandable_segments:True"
    assert guard.os.environ[guard.ALLOC_CONF] == "expandable_segments:True"
    monkeypatch.setenv(guard.ALLOC_CONF, "max_split_size_mb:128")
    assert configure_allocator() == "max_split_size_mb:128"
    assert guard.os.environ[guard.ALLOC_CONF] == "max_split_size_mb:128"


def test_cap_without_cuda_keeps_the_target_as_budget():
    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    assert cap_process_memory(24.0) == 24.0
    assert cap_process_memory(None) is None


@pytest.mark.requires_cuda
def test_cap_makes_the_allocator_raise_past_the_target():
    total = torch.cuda.get_device_properties(0).total_memory / guard.GB
    target = min(2.0, total / 2)
    assert cap_process_memory(target) == target
    try:
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(int((target + 0.5) * guard.GB), dtype=torch.uint8, device="cuda")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def test_resume_restores_the_last_step_down(tmp_path):
    import json

    g = OOMGuard(micro_batch=4, gradient_accumulation=2, checkpointing=False)
    assert guard.restore_step_down(g, tmp_path) is None  # no memory.jsonl: nothing to restore
    records = [
        {"step": 1, "phase": "forward"},
        {"event": "oom_recovered", "step": 2, "after": {"micro_batch": 2, "gradient_checkpointing": False}},
        {"event": "oom_recovered", "step": 5, "after": {"micro_batch": 1, "gradient_checkpointing": True}},
    ]
    text = "".join(json.dumps(r) + "\n" for r in records) + '{"event": "oom_recov'  # cut short by a crash
    (tmp_path / "memory.jsonl").write_text(text)
    restored = guard.restore_step_down(g, tmp_path)
    assert g.sub_batch == 1 and g.checkpointing
    assert restored["gradient_accumulation"] == 8 and restored["effective_batch"] == 8  # effective batch kept
