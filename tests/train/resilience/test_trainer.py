"""OOM recovery by fault injection: OOMs raised from model hooks at chosen steps, on the CPU."""

from __future__ import annotations

import json
import signal

import pytest
import torch
from safetensors.torch import load_file

from lowmem_ft.errors import Interrupted
from tests.train.resilience.test_interrupt import SendAt
from tests.train.tiny_runs import FaultInjector, memory_records, once, tiny_run, tiny_sets, tiny_trainer

pytestmark = pytest.mark.slow
DATA = "tests/data/numbered.jsonl"  # 64 prompt/completion samples that tokenize uniquely
ADAPTER = "adapter/adapter_model.safetensors"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny matmuls on a shared 2-core machine: intra-op threads only contend (15 ms vs 0.2 ms per linear).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def baseline(tiny_model, tmp_path_factory):
    """An uninterrupted run: 3 optimizer steps of micro batch 4 × accumulation 2."""
    out = tmp_path_factory.mktemp("runs")
    injector = FaultInjector()
    result = tiny_run(tiny_model, DATA, out, "baseline", callbacks=[injector])
    return result, injector


def max_weight_diff(a, b) -> float:
    wa, wb = load_file(a / ADAPTER), load_file(b / ADAPTER)
    assert wa.keys() == wb.keys()
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


def events(run_dir, kind: str) -> list[dict]:
    return [r for r in memory_records(run_dir) if r.get("event") == kind]


def test_forward_oom_keeps_steps_effective_batch_and_samples(baseline, tiny_model, tmp_path):
    base, base_ids = baseline
    # OOM in the first micro batch of step 2 (4 rows), then again in step 3 at the 2 rows it stepped down to.
    injector = FaultInjector(fail=once((2, 4), (3, 2)))
    result = tiny_run(tiny_model, DATA, tmp_path, "oom", callbacks=[injector])

    assert injector.raised == [(2, 4, True), (3, 2, True)]
    assert result.metrics["global_step"] == base.metrics["global_step"] == 3
    assert injector.ids == base_ids.ids  # the same samples, in the same order
    assert len(injector.ids) == 3 * 8 and len(set(injector.ids)) == 24  # 3 steps × effective batch 8, none twice
    recovered = events(result.run_dir, "oom_recovered")
    assert [(e["step"], e["before"]["micro_batch"], e["after"]["micro_batch"]) for e in recovered] == [
        (2, 4, 2),
        (3, 2, 1),
    ]
    assert [e["after"]["gradient_accumulation"] for e in recovered] == [4, 8]
    assert all(e["after"]["effective_batch"] == 8 for e in recovered)
    # the split factor persists: step 3's samples after the OOM run one row per forward
    assert {
        s["micro_batch"] for s in memory_records(result.run_dir) if s.get("phase") == "backward" and s["step"] == 3
    } == {1}
    # same gradients, so the same weights (float summation order aside)
    assert max_weight_diff(result.run_dir, base.run_dir) < 1e-4


def test_backward_oom_replays_the_accumulated_micro_batches(baseline, tiny_model, tmp_path):
    base, _ = baseline
    calls = []

    def fail_backward(step: int) -> bool:  # the second micro batch of step 2, after the first one's backward
        if step == 2:
            calls.append(step)
        return len(calls) == 2

    injector = FaultInjector(fail_backward=fail_backward)
    result = tiny_run(tiny_model, DATA, tmp_path, "oom-bwd", callbacks=[injector])
    assert injector.raised == [(2, -1, True)]
    assert result.metrics["global_step"] == 3
    assert len(events(result.run_dir, "oom_recovered")) == 1
    # Layer 1's adapter gradients of the failed micro batch were already accumulated when layer 0's backward
    # failed: without zeroing and replaying the step's first micro batch they would count twice (measured: 3e-2).
    assert max_weight_diff(result.run_dir, base.run_dir) < 1e-4


def test_oom_at_batch_one_with_checkpointing_saves_and_exits(tiny_model, tmp_path, monkeypatch, capsys):
    from lowmem_ft import cli
    from lowmem_ft.train import run as run_module

    injector = FaultInjector(fail=lambda step, rows, training: training and step >= 2)
    train = run_module.train
    monkeypatch.setattr(run_module, "train", lambda *a, **k: train(*a, **{**k, "callbacks": [injector]}))
    sets = tiny_sets(tiny_model, DATA, tmp_path)
    argv = ["train", "--vram", "8", "--name", "fatal", "--no-wandb"]
    for item in sets:
        argv += ["--set", item]
    assert cli.main(argv) == 2
    # stderr also carries progress bars; the error itself is one line
    # stderr also carries progress bars (an unfinished one shares the error's line); the error itself is one line
    (err,) = [
        line.partition("lowmem-ft train: error: ")[2]
        for line in capsys.readouterr().err.splitlines()
        if "lowmem-ft train: error: " in line
    ]
    assert "out of memory at step 2 even with micro batch 1 and activation checkpointing" in err
    assert "checkpoint-1" in err and "allocated" not in err and "host RSS" in err  # CPU: host figures only

    run_dir = tmp_path / "fatal"
    assert (run_dir / "checkpoints" / "checkpoint-1" / "adapter_model.safetensors").is_file()
    recovered = events(run_dir, "oom_recovered")
    assert [e["action"].split(" (")[0] for e in recovered] == [
        "micro batch 4 → 2, gradient accumulation 2 → 4",
        "micro batch 2 → 1, gradient accumulation 4 → 8",
        "activation checkpointing switched on",
    ]
    (fatal,) = events(run_dir, "oom_fatal")
    assert fatal["before"]["gradient_checkpointing"] is True and "rss_gb" in fatal["memory"]
    assert (run_dir / "memory.png").is_file()
    from lowmem_ft.rundir import RunDir

    status = RunDir(run_dir).read_status()  # the run's record says the same as the console (issue #24)
    assert (status.state, status.reason, status.checkpoint) == (
        "failed",
        err,
        str(run_dir / "checkpoints/checkpoint-1"),
    )


def test_eval_oom_lowers_the_eval_batch_not_the_train_batch(tiny_model, tmp_path):
    injector = FaultInjector(fail=lambda step, rows, training: not training and rows > 1)
    result = tiny_run(
        tiny_model,
        DATA,
        tmp_path,
        "eval-oom",
        "data.eval_fraction=0.1",
        "training.eval_steps=1",
        "training.max_steps=2",
        callbacks=[injector],
    )
    eval_events = events(result.run_dir, "eval_oom_recovered")
    assert [(e["eval_batch_before"], e["eval_batch_after"]) for e in eval_events] == [(4, 2), (2, 1)]
    assert not events(result.run_dir, "oom_recovered")
    samples = [r for r in memory_records(result.run_dir) if r.get("phase") in ("forward", "backward")]
    assert samples and {s["micro_batch"] for s in samples} == {4}
    assert len(injector.ids) == 2 * 8
    evals = [json.loads(line) for line in (result.run_dir / "log_history.jsonl").read_text().splitlines()]
    assert sum("eval_loss" in row for row in evals) == 2  # both evaluations completed at the lower eval batch


def _gradients_by_step_down(trainer, batch, num_items, halvings: tuple[int, ...], seed: int = 0):
    """Loss and gradients of one micro batch run at each step-down level, from zero gradients each time and from
    the same RNG state (the micro batch draws its dropout seed from it)."""
    trainer.current_gradient_accumulation_steps = 1
    trainer.monitor.close()
    results = []
    for level in halvings:
        trainer.model.zero_grad(set_to_none=True)
        trainer.guard.halvings, trainer._window_step = level, -1
        torch.manual_seed(seed)
        loss = trainer.training_step(trainer.model, batch, num_items)
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        results.append((loss.item(), grads))
    return results


def _assert_same(results):
    (loss0, grads0), *splits = results
    assert grads0
    for loss, grads in splits:
        assert loss == pytest.approx(loss0, rel=1e-5)
        assert grads.keys() == grads0.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], grads0[name], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("with_num_items", [True, False], ids=["num_items_in_batch", "per-batch-mean"])
def test_split_micro_batch_gives_the_same_loss_and_gradients(tiny_model, tmp_path, with_num_items):
    """Both loss normalisations transformers uses: token sum over `num_items_in_batch` (what SFTTrainer gets for
    this model), and the per-micro-batch mean (models without loss kwargs), which the split must re-weight."""
    trainer = tiny_trainer(tiny_model, DATA, tmp_path).trainer
    batch = next(iter(trainer.get_train_dataloader()))
    # uneven loss-token counts across rows, so an unweighted mean of sub-batch means would differ
    assert len({int(n) for n in batch["labels"][:, 1:].ne(-100).sum(1)}) > 1
    num_items = trainer._get_num_items_in_batch([batch], trainer.args.device) if with_num_items else None
    _assert_same(_gradients_by_step_down(trainer, batch, num_items, (0, 1, 2)))  # rows 4, 2, 1


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_a_step_down_keeps_the_lora_dropout_masks(tiny_model, tmp_path, packing):
    """Under the shipped LoRA dropout (0.05) the pieces draw the whole micro batch's masks (lowmem_ft.train.resilience.dropout),
    and activation checkpointing, switched on by the last step-down, recomputes the forward with the same masks."""
    from lowmem_ft.train.resilience.guard import enable_checkpointing

    trainer = tiny_trainer(tiny_model, DATA, tmp_path, "adapter.dropout=0.05", f"data.packing={packing}").trainer
    batch = next(iter(trainer.get_train_dataloader()))
    num_items = trainer._get_num_items_in_batch([batch], trainer.args.device)
    results = _gradients_by_step_down(trainer, batch, num_items, (0, 1, 2))
    enable_checkpointing(trainer.model)
    results += _gradients_by_step_down(trainer, batch, num_items, (2,))
    _assert_same(results)
    # the masks matter: another micro batch seed gives other gradients
    (_, other), (_, first) = _gradients_by_step_down(trainer, batch, num_items, (0,), seed=1)[0], results[0]
    assert any(not torch.allclose(other[n], first[n], rtol=1e-3, atol=1e-6) for n in first)


def test_recovered_steps_equal_the_uninterrupted_run_under_shipped_dropout(tiny_model, tmp_path):
    """A retry used to draw new dropout masks: 3e-2 apart in the adapter after one forward OOM in this run (lr 0.01),
    measured before lowmem_ft.train.resilience.dropout (restoring the RNG state alone left it at 3e-2: the pieces' masks differ
    from the whole batch's). A forward OOM (split) and a backward OOM (replay of the step's first micro batch)."""
    dropout = "adapter.dropout=0.05"
    base = tiny_run(tiny_model, DATA, tmp_path, "base", dropout)
    forward = tiny_run(tiny_model, DATA, tmp_path, "fwd", dropout, callbacks=[FaultInjector(fail=once((2, 4), (3, 2)))])
    calls = []

    def fail_backward(step: int) -> bool:
        calls.append(step)
        return calls.count(2) == 2 and calls[-1] == 2

    backward = tiny_run(
        tiny_model, DATA, tmp_path, "bwd", dropout, callbacks=[FaultInjector(fail_backward=fail_backward)]
    )
    assert len(events(forward.run_dir, "oom_recovered")) == 2 and len(events(backward.run_dir, "oom_recovered")) == 1
    assert max_weight_diff(forward.run_dir, base.run_dir) < 1e-5
    assert max_weight_diff(backward.run_dir, base.run_dir) < 1e-5


@pytest.mark.parametrize("with_num_items", [True, False], ids=["num_items_in_batch", "per-batch-mean"])
def test_a_packed_micro_batch_steps_down_at_sample_boundaries(tiny_model, tmp_path, with_num_items):
    """OOM halving used to do nothing to a packed (padding-free) batch — one row — and retry the same batch: now the
    row is cut at sample boundaries, each piece a forward of fewer tokens, with the same gradients."""
    trainer = tiny_trainer(tiny_model, DATA, tmp_path, "data.packing=true").trainer
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch  # one packed row
    samples = int((batch["position_ids"][0] == 0).sum())
    assert samples >= 4
    tokens: list[int] = []
    hook = trainer.model.register_forward_pre_hook(
        lambda module, args, kwargs: tokens.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    num_items = trainer._get_num_items_in_batch([batch], trainer.args.device) if with_num_items else None
    results = _gradients_by_step_down(trainer, batch, num_items, (0, 1, 2))
    hook.remove()
    whole = batch["input_ids"].shape[1]
    assert tokens[0] == whole and len(tokens) == 1 + 2 + 4  # one forward, then two, then four pieces
    assert sum(tokens[1:3]) == sum(tokens[3:]) == whole and max(tokens[1:]) < whole
    _assert_same(results)


def test_resume_continues_at_the_step_down_saved_in_the_checkpoint(tiny_model, tmp_path):
    """The guard's state rides in each checkpoint (transformers' ExportableState); --resume reads it from there, not
    by parsing memory.jsonl."""
    from lowmem_ft.cli import main

    # Step 2 steps down (an injected OOM), then SIGTERM stops the run after it with checkpoint-2: a finished run
    # is not resumed (it is finished), an interrupted one is.
    injector = FaultInjector(fail=once((2, 4)))
    with pytest.raises(Interrupted):
        tiny_run(tiny_model, DATA, tmp_path, "resumed", "training.max_steps=3", "training.save_steps=2",
                 callbacks=[injector, SendAt(2, signal.SIGTERM)])  # fmt: skip
    run_dir = tmp_path / "resumed"
    state = json.loads((run_dir / "checkpoints" / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["stateful_callbacks"]["MemoryGuard"]["attributes"]["halvings"] == 1
    (run_dir / "memory.jsonl").unlink()  # nothing to parse: the checkpoint alone carries the step-down
    assert main(["train", "--resume", str(run_dir), "--no-wandb"]) == 0
    records = memory_records(run_dir)
    assert records[0]["event"] == "start" and records[0]["micro_batch"] == 2 and records[0]["pieces"] == 2
    assert {r["micro_batch"] for r in records if r.get("phase") == "forward"} == {2}
    assert not [r for r in records if r.get("event") == "oom_recovered"]
