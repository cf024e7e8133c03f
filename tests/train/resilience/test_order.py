"""The heaviest micro batch first: each epoch's order is seeded, starts with its heaviest batch by tokens (the rest in
their order), trains the longest sample in step 1, packed or not, and --resume stays exact."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

from lowmem_ft import cli
from lowmem_ft.train.resilience.order import HeaviestFirstSampler, batch_tokens, heaviest_first
from tests.train.tiny_runs import tiny_run

pytestmark = pytest.mark.slow


def test_the_heaviest_batch_moves_first_and_the_rest_keep_their_order():
    lengths = [5, 5, 9, 1, 30, 2, 4, 4]  # batches of 2: [5,5] [9,1] [30,2] [4,4]
    assert heaviest_first(list(range(8)), lengths, 2) == [4, 5, 0, 1, 2, 3, 6, 7]
    # padding-free batches weigh their samples' sum ([8,8] = 16), padded ones micro batch × longest ([9,1] = 18)
    assert heaviest_first(list(range(8)), [5, 5, 9, 1, 3, 2, 8, 8], 2, padded=False) == [6, 7, 0, 1, 2, 3, 4, 5]
    assert heaviest_first(list(range(8)), [5, 5, 9, 1, 3, 2, 8, 8], 2, padded=True) == [2, 3, 0, 1, 4, 5, 6, 7]
    assert batch_tokens([2, 3], [5, 5, 9, 1], padded=True) == 18 and batch_tokens([2, 3], [5, 5, 9, 1], False) == 10
    assert heaviest_first([3, 1, 2], [1, 2, 3, 4], 4) == [3, 1, 2]  # one batch: nothing to move


def test_the_longest_sample_in_the_short_last_batch_trades_into_the_first():
    # batches of 3: [1,1,1] [2,2,2] [50]: moving the short last batch would shift every boundary after it
    lengths = [1, 1, 1, 2, 2, 2, 50]
    order = heaviest_first(list(range(7)), lengths, 3)
    assert order[:3] == [6, 4, 5] and sorted(order) == list(range(7)) and order[-1] == 3


def test_each_epoch_is_seeded_and_a_permutation():
    lengths = [(i * 37) % 23 + 1 for i in range(40)]
    for group in (0, 8):
        a, b = (
            HeaviestFirstSampler(lengths, 4, 7, group_size=group),
            HeaviestFirstSampler(lengths, 4, 7, group_size=group),
        )
        first = list(a)
        assert first == list(b) and sorted(first) == list(range(40))
        a.set_epoch(1)
        assert list(a) != first  # another epoch, another order
        assert batch_tokens(first[:4], lengths, True) == max(
            batch_tokens(first[i : i + 4], lengths, True) for i in range(0, 40, 4)
        )


# -- in a real run -------------------------------------------------------------------------------------------------
class FirstStep(TrainerCallback):
    """Records the token count of each row of every training forward in optimizer step 1."""

    def __init__(self):
        self.rows: list[int] = []
        self.forwards: list[int] = []
        self.state = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.state = state
        model.register_forward_pre_hook(self._before, with_kwargs=True)

    def _before(self, module, args, kwargs):
        if not module.training or self.state.global_step != 0:
            return
        ids, mask = kwargs["input_ids"], kwargs.get("attention_mask")
        self.rows += mask.sum(dim=1).tolist() if mask is not None else [ids.shape[1]] * ids.shape[0]
        self.forwards.append(int(mask.sum()) if mask is not None else ids.numel())


def _data(path: Path, n: int, long_words: int) -> Path:
    """`n` short prompt/completion samples, the last one long."""
    rows = [{"prompt": f"Question {i}?", "completion": f" Answer {i}."} for i in range(n - 1)]
    rows.append({"prompt": "Tell a long story. " + "word " * long_words, "completion": " The end."})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_data_set_whose_longest_sample_is_last_trains_it_in_step_1(tiny_model, tmp_path):
    data = _data(tmp_path / "last.jsonl", 64, 30)
    seen = FirstStep()
    tiny_run(tiny_model, str(data), tmp_path, "last", "training.max_steps=1", "memory.max_seq_len=64", callbacks=[seen])
    assert max(seen.rows) >= 40, seen.rows  # the long sample (≥ 40 tokens; the others ~10) ran in step 1
    assert seen.forwards[0] == max(seen.forwards)  # and in its first micro batch


def test_packed_rows_run_their_heaviest_micro_batch_first(tiny_model, tmp_path):
    """Packed rows are read in a seeded random order (padding-free: a batch weighs its tokens); unsorted, this data's
    heaviest batch would not come first."""
    from lowmem_ft.data.profile import lengths_of
    from tests.train.tiny_runs import tiny_trainer

    data = _data(tmp_path / "packed.jsonl", 96, 20)
    job = tiny_trainer(tiny_model, str(data), tmp_path, "data.packing=true", "memory.max_seq_len=32")
    sampler = job.trainer._get_train_sampler()
    assert isinstance(sampler, HeaviestFirstSampler) and not sampler.padded and not sampler.group_size
    lengths = lengths_of(job.trainer.train_dataset)
    assert len(set(lengths)) > 1  # rows of different fill
    plain = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(sampler.seed)).tolist()
    weights = [batch_tokens(plain[i : i + 4], lengths, False) for i in range(0, len(plain) - 3, 4)]
    assert weights[0] < max(weights)  # the plain order would not have started with it
    first = next(iter(job.trainer.get_train_dataloader()))
    assert first["input_ids"].numel() == max(weights)


def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run / "log_history.jsonl").read_text().splitlines()) if "loss" in r]


def test_packed_resume_after_step_2_gives_the_uninterrupted_losses(tiny_model, tmp_path, monkeypatch):
    from tests.train.resilience.test_interrupt import SendAt
    from tests.train.tiny_runs import tiny_sets

    data = str(_data(tmp_path / "resume.jsonl", 96, 20))
    extra = ("data.packing=true", "memory.max_seq_len=32", "training.max_steps=4")
    baseline = tiny_run(tiny_model, data, tmp_path / "base", "base", *extra).run_dir
    from lowmem_ft.train import run as run_module

    train = run_module.train
    monkeypatch.setattr(
        run_module, "train", lambda *a, **k: train(*a, **{**k, "callbacks": [SendAt(3, signal.SIGTERM)]})
    )
    argv = ["train", "--recipe", "8gb", "--name", "cut", "--no-wandb"]
    for item in tiny_sets(tiny_model, data, tmp_path, *extra):
        argv += ["--set", item]
    assert cli.main(argv) == 143
    monkeypatch.undo()
    assert cli.main(["train", "--resume", str(tmp_path / "cut"), "--no-wandb"]) == 0
    assert _losses(tmp_path / "cut") == _losses(baseline) and len(_losses(baseline)) == 4
