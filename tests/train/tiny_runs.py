"""Small CPU training runs of the embedded model, and a fault injector that raises OOMs from model hooks."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import TrainerCallback

# Fast and deterministic on the CPU: 16-bit storage off (float32), short sequences, no dropout, constant LR
# (no warmup step with LR 0, so every step moves the weights), micro batch 4 × accumulation 2.
FAST = [
    "model.quantization=none",
    "model.compute_dtype=float32",
    "memory.max_seq_len=48",
    "memory.gradient_checkpointing=false",
    "memory.micro_batch_size=4",
    "memory.gradient_accumulation=2",
    "optimizer.name=adamw_torch",
    "optimizer.lr=0.01",
    "optimizer.warmup_ratio=0",
    "optimizer.schedule=constant",
    "adapter.dropout=0",
    "training.max_steps=3",
    "training.save_steps=100",
    "training.logging_steps=1",
]


def tiny_sets(model: str, data: str, out: Path, *extra: str) -> list[str]:
    return [f"model.name_or_path={model}", f"data.path={data}", f"training.output_dir={out}", *FAST, *extra]


def tiny_run(model: str, data: str, out: Path, name: str, *extra: str, callbacks=None, choice=None):
    """A run of the embedded model; `choice` as run.json records it (default: an 8 GB target, margin 1 GB)."""
    from lowmem_ft.choosing import Choice
    from lowmem_ft.recipe.load import resolve
    from lowmem_ft.rundir import RunDir
    from lowmem_ft.train.run import train

    recipe = resolve("8gb", tiny_sets(model, data, out, *extra))
    run = RunDir.new(out, name, model)
    choice = Choice.from_dict({"how": "recipe", "recipe": "8gb", "vram_gb": 8, "safety_margin_gb": 1, **(choice or {})})
    return train(recipe, run, choice=choice, callbacks=callbacks)


def tiny_trainer(model: str, data: str, out: Path, *extra: str):
    """A set-up (not yet fitted) `FineTune` of the embedded model: its `trainer`, `guard` and `monitor`."""
    from lowmem_ft.choosing import Choice
    from lowmem_ft.recipe.load import resolve
    from lowmem_ft.rundir import RunDir
    from lowmem_ft.train.run import FineTune

    recipe = resolve("8gb", tiny_sets(model, data, out, *extra, "logging.wandb_mode=disabled"))
    return FineTune(recipe, RunDir.new(out, "trainer", model), Choice("recipe", "8gb")).build()


# The bound for the memory model against exact CPU measurements of real runs (#15): per run and per phase.
MEMORY_TOLERANCE = 0.08


def memory_disagreements(root: Path, tolerance: float = MEMORY_TOLERANCE) -> list[str]:
    """Where the exact CPU measurement of every run under `root` (a directory, or one memory file) disagrees with
    the memory model (empty: none).

    Each memory file whose start record says it was measured exactly (a CPU run through `train`): the peak of the
    batches that ran and each phase's peak within `tolerance` of the prediction for the same phase and batch, and
    the phases without a prediction (saves, the end of an evaluation loop) not above the training peak.
    """
    from lowmem_ft.report import compare_exact

    problems = []
    root = Path(root)
    for path in [root] if root.is_file() else sorted(root.rglob("memory*.jsonl")):
        records = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # a line a crash cut short
                continue
        starts = [r for r in records if r.get("event") == "start"]
        if not starts or not starts[-1].get("exact"):
            continue
        e = compare_exact(starts[-1], [r for r in records if "event" not in r])
        if e is None or "measured_gb" not in e:
            continue
        where = f"{path.parent.name}/{path.name}"
        if abs(e["error"]) > tolerance:
            problems.append(
                f"{where}: measured {e['measured_gb']:.6f} GB vs predicted {e['predicted_gb']:.6f} GB "
                f"({e['error']:+.1%}) at {e['phase']} of step {e['step']}, batch {e.get('batch')}"
            )
        for name, ph in e["phases"].items():
            if abs(ph["error"]) > tolerance:
                problems.append(
                    f"{where}: {name} measured {ph['measured_gb']:.6f} GB vs predicted {ph['predicted_gb']:.6f} GB "
                    f"({ph['error']:+.1%})"
                )
        if e.get("outside_gb", 0.0) > e["measured_gb"]:
            problems.append(
                f"{where}: {e['outside_phase']} peaked at {e['outside_gb']:.6f} GB, above the training peak"
            )
    return problems


def memory_records(run_dir: Path, rank: int = 0) -> list[dict]:
    from lowmem_ft.rundir import RunDir

    path = RunDir(run_dir).memory_file(rank)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class FaultInjector(TrainerCallback):
    """Raises `torch.OutOfMemoryError` where `fail(step, rows, training)` says, and records consumed sample ids.

    A forward pre-hook sees each forward's rows; it raises before the forward runs (as an OOM in the first
    allocation would) or records the rows' sample ids (the index of the row's tokens in the train dataset), so
    `ids` lists the samples whose forward actually ran, in order. `fail_backward(step)` raises from the backward
    of the first decoder layer (the last one backward reaches), when later layers' adapter gradients are already
    accumulated.
    """

    def __init__(
        self,
        fail: Callable[[int, int, bool], bool] | None = None,
        fail_backward: Callable[[int], bool] | None = None,
    ):
        self.fail = fail
        self.fail_backward = fail_backward
        self.ids: list[int] = []
        self.raised: list[tuple[int, int, bool]] = []
        self.state = None
        self._index: dict[tuple[int, ...], int] = {}

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        self.state = state
        for i, row in enumerate(train_dataloader.dataset["input_ids"]):
            self._index.setdefault(tuple(row), i)
        model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        layer = model.get_base_model().model.layers[0]
        layer.register_full_backward_pre_hook(self._before_backward)

    def _before_forward(self, module, args, kwargs):
        step = self.state.global_step + 1
        ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
        if self.fail is not None and self.fail(step, ids.shape[0], module.training):
            self.raised.append((step, ids.shape[0], module.training))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected by the test)")
        if module.training:
            self.ids += [self._index[tuple(row[m.bool()].tolist())] for row, m in zip(ids, mask, strict=True)]

    def _before_backward(self, module, grad_output):
        step = self.state.global_step + 1
        if self.fail_backward is not None and self.fail_backward(step):
            self.raised.append((step, -1, True))
            raise torch.OutOfMemoryError("CUDA out of memory in backward (injected by the test)")


def once(*triggers: tuple[int, int]) -> Callable[[int, int, bool], bool]:
    """Fail a training forward once for each (step, rows) trigger."""
    pending = list(triggers)

    def fail(step: int, rows: int, training: bool) -> bool:
        if training and (step, rows) in pending:
            pending.remove((step, rows))
            return True
        return False

    return fail


def interrupted_copy(done: Path, to: Path, step: int) -> Path:
    """A copy of the finished run `done` cut back to checkpoint-`step`, as a run a signal stopped after that step
    looks: the later checkpoints and the final adapter removed, run.json `interrupted` (SIGTERM) at `step`."""
    import shutil

    shutil.copytree(done, to)
    for checkpoint in (to / "checkpoints").glob("checkpoint-*"):
        if int(checkpoint.name.removeprefix("checkpoint-")) > step:
            shutil.rmtree(checkpoint)
    shutil.rmtree(to / "adapter")
    info = json.loads((to / "run.json").read_text())
    info["status"] = {**info["status"], "state": "interrupted", "signal": "SIGTERM", "step": step}
    (to / "run.json").write_text(json.dumps(info))
    return to


def assert_same_adapter(a: Path, b: Path) -> None:
    """The two runs' final adapters are equal, tensor by tensor, bit for bit."""
    from safetensors.torch import load_file

    x, y = (load_file(run / "adapter" / "adapter_model.safetensors") for run in (a, b))
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
