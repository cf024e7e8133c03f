"""Image runs like every run, end to end on the CPU: `train --gpus 2` (two gloo ranks) on a `save_to_disk` data set
whose images are `Image` bytes, with image chats as eval data (`--eval-data`), and `--resume` of a copy cut back to its
first checkpoint ending where the uninterrupted run did — on Qwen2.5-VL, whose pixel values are concatenated over
the batch's patches rather than stacked per image (the harder case for a sampler, a collator and a resume); and an
OOM at a micro batch of 2 redone as the collator's pieces (each sample with its own images), to the losses and
adapter of the run that never ran short, on Qwen2.5-VL and Gemma-3 (a SigLIP ViT family). The pieces themselves are
checked on every family's batches in test_vision_runs.py. Two launches in all: each costs ~45 s on 2 cores."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

from lowmem_ft.cli import main
from lowmem_ft.rundir import RunDir
from tests.train.tiny_runs import assert_same_adapter, interrupted_copy
from tests.vision.conftest import ROWS, write_images, write_rows
from tests.vision.test_vision_sources import _image_dataset

pytestmark = pytest.mark.slow
ADAPTER = "adapter/adapter_model.safetensors"
FAMILIES = {"qwen2.5-vl": "qwen_vl", "gemma3-vision": "gemma3_vl"}
SETS = ("model.compute_dtype=float32", "model.quantization=none", "adapter.dropout=0", "memory.micro_batch_size=2",
        "memory.gradient_accumulation=1", "optimizer.name=adamw_torch", "optimizer.lr=0.03", "optimizer.warmup_ratio=0",
        "training.logging_steps=1")  # fmt: skip


def launch(*argv: str) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return main([*argv, "--gpus", "2", "--no-wandb"])


def losses(run: Path, key: str = "loss") -> list[tuple[int, float]]:
    rows = map(json.loads, (run / "log_history.jsonl").read_text().splitlines())
    return [(r["step"], r[key]) for r in rows if key in r]


def saved(out: Path) -> Path:
    """4 × ROWS image chats, saved with `save_to_disk`, whose images are `Image` bytes."""
    from datasets import concatenate_datasets

    write_images(out)
    ds = _image_dataset(out, lambda path: {"bytes": path.read_bytes(), "path": None})
    concatenate_datasets([ds] * 4).save_to_disk(str(out / "saved"))
    return out / "saved"


@pytest.fixture(scope="module")
def image_run(qwen_vl, tmp_path_factory):
    """Two optimizer steps of Qwen2.5-VL on 2 ranks × 2 image chats of a saved data set, evaluated and checkpointed
    after each. The images' bytes become files under the run's own cache (`LOWMEM_FT_CACHE`, both ranks)."""
    out = tmp_path_factory.mktemp("qwen2.5-vl")
    data, evaluation = saved(out), write_rows(out, ROWS, name="eval.jsonl")
    argv = ["train", "--vram", "8", "--model", qwen_vl, "--data", str(data), "--eval-data", str(evaluation),
            "--name", "run"]  # fmt: skip
    for kv in (*SETS, "training.max_steps=2", "training.save_steps=1", "training.eval_steps=1",
               f"training.output_dir={out}"):  # fmt: skip
        argv += ["--set", kv]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOWMEM_FT_CACHE", str(out / "cache"))
        assert launch(*argv) == 0
        yield out / "run"


def test_an_image_run_trains_on_two_ranks_and_evaluates_image_chats(image_run):
    run = image_run
    assert RunDir(run).read_status().state == "completed"
    assert (run / ADAPTER).is_file() and (run / "memory.rank1.jsonl").is_file()
    assert [step for step, _ in losses(run)] == [1, 2]
    assert [step for step, _ in losses(run, "eval_loss")] == [1, 2]  # the eval image chats ran, at each step
    data = json.loads((run / "run.json").read_text())["data"]
    assert data["records"] == 4 * len(ROWS) and data["eval_records"] == len(ROWS)
    assert data["vision"]["images_per_sample"]["max"] == 2


def test_an_interrupted_image_run_resumes_to_the_same_adapter(image_run, tmp_path):
    done = image_run
    run = interrupted_copy(done, tmp_path / "run", step=1)
    assert launch("train", "--resume", str(run)) == 0
    assert losses(run) == losses(done)
    assert_same_adapter(run, done)


class OomOnce(TrainerCallback):
    """Raises an OOM from the model's first training forward of 2 rows, as a GPU that ran short would."""

    def __init__(self):
        self.raised = 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        def before(module, args, kwargs):
            if module.training and kwargs["input_ids"].shape[0] == 2 and not self.raised:
                self.raised += 1
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected by the test)")

        model.register_forward_pre_hook(before, with_kwargs=True)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_an_oom_redoes_the_image_batch_in_pieces_with_their_images(family, request, tmp_path, monkeypatch):
    """One step in-process with and without an injected OOM: the guard's pieces (each sample with its own images,
    `VisionCollator.split`) give the loss and the adapter of the whole batch."""
    from lowmem_ft.choosing import Choice
    from lowmem_ft.recipe.load import resolve
    from lowmem_ft.train.run import train

    model = request.getfixturevalue(FAMILIES[family])
    monkeypatch.setenv("LOWMEM_FT_CACHE", str(tmp_path / "cache"))
    data = str(saved(tmp_path / "data"))
    results = {}
    for name, callbacks in (("whole", []), ("oom", [OomOnce()])):
        sets = [f"model.name_or_path={model}", f"data.path={data}", f"training.output_dir={tmp_path}", *SETS,
                "training.max_steps=1", "training.save_steps=100", "memory.max_seq_len=1024",
                "memory.gradient_checkpointing=false", "logging.wandb_mode=disabled"]  # fmt: skip
        run = RunDir.new(tmp_path, name, model)
        train(resolve("8gb", sets), run, choice=Choice("recipe", "8gb"), callbacks=callbacks)
        results[name] = (losses(run.path), load_file(run.path / ADAPTER))
    assert callbacks[0].raised == 1
    events = [json.loads(line) for line in (tmp_path / "oom" / "memory.jsonl").read_text().splitlines()]
    assert any("micro batch 2 → 1" in str(e.get("action", "")) for e in events), events[-3:]
    (whole_losses, whole), (oom_losses, oom) = results["whole"], results["oom"]
    assert [s for s, _ in oom_losses] == [1]
    assert oom_losses[0][1] == pytest.approx(whole_losses[0][1], rel=1e-5)
    assert whole.keys() == oom.keys()
    for key in whole:
        torch.testing.assert_close(oom[key], whole[key], rtol=1e-4, atol=1e-6)
