"""The memory policy (step-downs for OOMs and the margin, its saved state) and the device set-up, without training."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lowmem_ft.memory.target import Target
from lowmem_ft.train import device
from lowmem_ft.train.device import cap_process_memory, configure_allocator
from lowmem_ft.train.observe.monitor import MemoryMonitor
from lowmem_ft.train.resilience.guard import MemoryGuard


def guard_recording(tmp_path, samples=(), **kw) -> tuple[MemoryGuard, MemoryMonitor]:
    """A guard whose events go to a monitor that reads the scripted `samples` (nothing written)."""
    pending = list(samples)
    monitor = MemoryMonitor(tmp_path / "memory.jsonl", reader=lambda: pending.pop(0), write=False)
    monitor.state = SimpleNamespace(global_step=0)
    defaults = dict(micro_batch=4, gradient_accumulation=2, checkpointing=True)
    guard = MemoryGuard(**{**defaults, **kw}, recorder=monitor)
    monitor.watch(guard.watch)
    return guard, monitor


def rows(n: int, width: int = 3) -> dict:
    return {"input_ids": torch.arange(n * width).reshape(n, width), "labels": torch.arange(n * width).reshape(n, width)}


def test_step_down_halves_then_checkpoints_then_gives_up(tmp_path):
    g, monitor = guard_recording(tmp_path, micro_batch=6, checkpointing=False)
    steps = []
    while True:
        g.pieces(rows(6))  # the batch at hand says whether it can be cut finer
        if not g.recover(1, {}):
            break
        steps.append((monitor.events[-1]["action"].split(",")[0], g.sub_batch, g.split, g.effective_accumulation))
    assert steps == [
        ("micro batch 6 → 3", 3, 2, 4),
        ("micro batch 3 → 2", 2, 3, 6),  # ceil halving: 6 rows as sub-batches of 2
        ("micro batch 2 → 1", 1, 6, 12),
        ("activation checkpointing switched on (micro batch already 1)", 1, 6, 12),
    ]
    assert g.checkpointing and g.describe()["effective_batch"] == 12  # unchanged throughout
    assert [e["event"] for e in monitor.events] == ["oom_recovered"] * 4 + ["oom_fatal"]


def test_margin_step_down_turns_checkpointing_on(tmp_path):
    """The margin's step-down used to record "activation checkpointing switched on" without switching it on, so the
    next OOM found nothing left and stopped the run with a false "even with checkpointing"."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    model = Qwen2ForCausalLM(config)
    cuda = {"allocated_gb": 5.0, "peak_gb": 5.0, "fragmentation_gb": 0.0, "rss_gb": 1.0}
    samples = [{**cuda, "reserved_gb": r} for r in (6.0, 9.2, 9.8)]  # budget 9 of VRAM 10: in, then deeper
    g, monitor = guard_recording(tmp_path, samples, micro_batch=1, checkpointing=False)
    g.target = Target(10.0, 1.0)
    g.on_train_begin(SimpleNamespace(), SimpleNamespace(stateful_callbacks={}), None, model=model)
    for _ in samples:
        monitor.sample("backward")
    assert [e["event"] for e in monitor.events] == ["margin", "margin_action"]
    assert "activation checkpointing switched on" in monitor.events[-1]["action"]
    assert g.checkpointing and model.is_activation_checkpointing  # switched on, on the model
    assert g.recover(2, {}) is False  # only now is nothing left


def test_margin_warns_once_naming_what_grew_then_steps_down(tmp_path):
    def cuda_like(allocated: float, reserved: float) -> dict:
        return {"allocated_gb": allocated, "reserved_gb": reserved, "peak_gb": allocated,
                "fragmentation_gb": reserved - allocated, "device_used_gb": reserved + 0.5, "rss_gb": 3.0}  # fmt: skip

    samples = [cuda_like(5.0, 6.0), cuda_like(5.0, 8.8), cuda_like(5.0, 8.9), cuda_like(5.0, 9.2)]
    g, monitor = guard_recording(tmp_path, samples)
    g.target = Target(10.0, 1.0)  # budget 9: used = reserved + 0.5 beyond it (NVML)
    for _ in samples:
        monitor.sample("backward")
    warning, action = monitor.events
    assert (warning["event"], action["event"]) == ("margin", "margin_action")
    assert warning["grew"].startswith("allocator fragmentation") and warning["grew_gb"] == pytest.approx(2.8)
    assert "memory in use 9.30 GB is over the 9 GB budget (VRAM 10 − safety margin 1)" in warning["message"]
    assert warning["headroom_gb"] == pytest.approx(-0.3)
    # the third sample (0.4 GB into the margin) is not yet past half of it: no second event until the fourth
    assert g.sub_batch == 2 and action["micro_batch"] == 2 and action["gradient_accumulation"] == 4


def test_no_margin_events_without_device_figures(tmp_path):
    g, monitor = guard_recording(tmp_path, [{"rss_gb": 7.9}] * 3)
    g.target = Target(8.0, 1.0)
    for _ in range(3):
        monitor.sample("forward")
    assert monitor.events == []


def test_state_is_saved_in_checkpoints_and_restored_in_place(tmp_path):
    """`ExportableState`: the step-down reached is in trainer_state.json, and a resumed run continues from it (the
    instance the trainer and monitor hold, not a rebuilt one)."""
    from transformers.trainer_callback import TrainerState

    g, _ = guard_recording(tmp_path, checkpointing=False)
    g.pieces(rows(4))
    g.recover(1, {})
    g.recover(2, {})
    saved = TrainerState(stateful_callbacks=[g])  # what Trainer._save_checkpoint writes
    path = tmp_path / "trainer_state.json"
    saved.save_to_json(str(path))
    loaded = TrainerState.load_from_json(str(path))

    fresh, monitor = guard_recording(tmp_path, checkpointing=False)
    args = SimpleNamespace(per_device_eval_batch_size=4)
    fresh.on_train_begin(args, loaded, None, model=None)
    assert (fresh.halvings, fresh.sub_batch, fresh.checkpointing) == (2, 1, False)
    assert fresh.describe()["gradient_accumulation"] == 8 and fresh.describe()["effective_batch"] == 8
    assert monitor._tags["micro_batch"] == 1  # every later sample says so

    changed, _ = guard_recording(tmp_path, micro_batch=2, checkpointing=False)  # another configuration: not applied
    changed.on_train_begin(args, TrainerState.load_from_json(str(path)), None, model=None)
    assert changed.halvings == 0


def test_eval_step_down_halves_the_eval_batch_then_skips(tmp_path):
    g, monitor = guard_recording(tmp_path, eval_batch=4)
    assert [g.recover_eval({}), g.recover_eval({}), g.recover_eval({})] == [True, True, False]
    assert g.eval_batch == 1 and g.sub_batch == 4  # training keeps its batch
    assert [e["event"] for e in monitor.events] == ["eval_oom_recovered"] * 2 + ["eval_skipped"]


def test_a_packed_row_steps_down_by_samples_then_to_checkpointing(tmp_path):
    from tests.train.resilience.test_split import packed

    g, monitor = guard_recording(tmp_path, micro_batch=1, checkpointing=False)
    batch = packed([5, 3, 4, 4])
    assert len(g.pieces(batch)) == 1
    assert g.recover(1, {}) and len(g.pieces(batch)) == 2
    assert "packed micro batch cut at sample boundaries into 1 → 2 pieces" in monitor.events[-1]["action"]
    assert g.recover(1, {}) and len(g.pieces(batch)) == 4
    assert g.recover(1, {})  # every piece is one sample now: checkpointing is next
    assert monitor.events[-1]["action"] == (
        "activation checkpointing switched on (a piece holds one sample, which cannot be cut)"
    )


# -- the device ------------------------------------------------------------------------------------------------------
def test_allocator_conf_is_set_unless_the_user_set_it(monkeypatch):
    monkeypatch.delenv(device.ALLOC_CONF, raising=False)
    assert configure_allocator() == "expandable_segments:True"
    assert device.os.environ[device.ALLOC_CONF] == "expandable_segments:True"
    monkeypatch.setenv(device.ALLOC_CONF, "max_split_size_mb:128")
    assert configure_allocator() == "max_split_size_mb:128"
    assert device.os.environ[device.ALLOC_CONF] == "max_split_size_mb:128"


def test_cap_without_cuda_keeps_the_target():
    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    assert cap_process_memory(24.0) == 24.0
    assert cap_process_memory(None) is None


class FakeCuda:
    """A stand-in for `torch.cuda` on a 2-GPU, 80 GB machine that records every call naming a device (no GPU
    here: this checks the order of calls, not CUDA itself)."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []
        self.current = 0

    def is_available(self):
        return True

    def set_device(self, index):
        self.calls.append(("set_device", index))
        self.current = index

    def current_device(self):
        return self.current

    def get_device_properties(self, index):
        self.calls.append(("get_device_properties", index))
        return SimpleNamespace(total_memory=80e9)

    def set_per_process_memory_fraction(self, fraction, index):
        self.calls.append(("set_per_process_memory_fraction", index))


def test_each_rank_caps_its_own_gpu(monkeypatch):
    """Under `train --gpus 2` rank 1 used to cap (and open a context on) GPU 0: the cap came before its device."""
    fake = FakeCuda()
    for name in ("is_available", "set_device", "current_device", "get_device_properties",
                 "set_per_process_memory_fraction"):  # fmt: skip
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert cap_process_memory(24.0) == 24.0
    assert fake.calls[0] == ("set_device", 1)
    assert {index for _, index in fake.calls} == {1}
    assert ("set_per_process_memory_fraction", 1) in fake.calls


@pytest.mark.requires_cuda
def test_cap_makes_the_allocator_raise_past_the_target():
    total = torch.cuda.get_device_properties(0).total_memory / device.GB
    target = min(2.0, total / 2)
    assert cap_process_memory(target) == target
    try:
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(int((target + 0.5) * device.GB), dtype=torch.uint8, device="cuda")
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
