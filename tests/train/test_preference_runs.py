"""A DPO run under what SFT runs have: `train --gpus 2` (two CPU gloo ranks), `--resume` of an interrupted copy,
then `generate` and `merge` on the trained adapter — one launch shared by the checks, one more for the resume. The
suite checks both launches' memory against the memory model (each rank's file)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from lowmem_ft.cli import main
from lowmem_ft.rundir import RunDir
from tests.train.tiny_runs import assert_same_adapter, interrupted_copy, tiny_sets

pytestmark = pytest.mark.slow
PAIRS = str(Path(__file__).parents[1] / "data" / "fixtures" / "preference" / "pairs_chat.jsonl")
ADAPTER = "adapter/adapter_model.safetensors"


def launch(*argv: str) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return main([*argv, "--gpus", "2", "--no-wandb"])


def losses(run: Path) -> list[tuple[int, float]]:
    rows = map(json.loads, (run / "log_history.jsonl").read_text().splitlines())
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def dpo_run(zoo_models, tmp_path_factory) -> Path:
    """Two optimizer steps of DPO on 2 ranks × 2 pairs, a checkpoint after each."""
    out = tmp_path_factory.mktemp("dpo")
    sets = tiny_sets(zoo_models["llama3"], PAIRS, out, "training.method=dpo", "training.max_steps=2",
                     "training.save_steps=1", "memory.micro_batch_size=2", "memory.gradient_accumulation=1")  # fmt: skip
    argv = ["train", "--recipe", "8gb", "--name", "dpo"]
    for item in sets:
        argv += ["--set", item]
    assert launch(*argv) == 0
    return out / "dpo"


def test_dpo_trains_on_two_ranks(dpo_run):
    assert RunDir(dpo_run).read_status().state == "completed"
    assert (dpo_run / ADAPTER).is_file() and (dpo_run / "memory.rank1.jsonl").is_file()
    logged = [json.loads(line) for line in (dpo_run / "log_history.jsonl").read_text().splitlines()]
    assert "rewards/margins" in [h for h in logged if "loss" in h][-1]
    assert [step for step, _ in losses(dpo_run)] == [1, 2]


def test_an_interrupted_dpo_run_resumes_to_the_same_adapter(dpo_run, tmp_path):
    """A copy cut back to checkpoint-1 (as a run stopped by a signal after step 1 looks) resumes to the losses and
    the adapter of the run that was never stopped."""
    run = interrupted_copy(dpo_run, tmp_path / "dpo", step=1)
    assert launch("train", "--resume", str(run)) == 0
    assert losses(run) == losses(dpo_run)
    assert_same_adapter(run, dpo_run)


def test_generate_and_merge_after_dpo(dpo_run, zoo_models, tmp_path, capsys):
    """The DPO adapter generates, and merges into weights whose logits are the base model's plus the adapter's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert main(["generate", str(dpo_run), "--prompt", "hi", "--max-new-tokens", "6", "--temperature", "0"]) == 0
    assert capsys.readouterr().out  # what a random tiny model answers (whitespace, often): it streamed
    out = tmp_path / "merged"
    assert main(["merge", str(dpo_run), "--output", str(out), "--dtype", "float32"]) == 0
    ids = AutoTokenizer.from_pretrained(out)("the cat sat", return_tensors="pt")["input_ids"]
    base = AutoModelForCausalLM.from_pretrained(zoo_models["llama3"], dtype=torch.float32).eval()
    expected = PeftModel.from_pretrained(base, dpo_run / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, expected(input_ids=ids).logits, atol=1e-4, rtol=1e-4)
