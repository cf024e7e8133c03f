"""`train --adapter`: a run continues an adapter where the previous run left it, not from a fresh initialization."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from lowmem_ft.cli import main
from lowmem_ft.recipe.load import resolve
from tests.train.tiny_runs import FAST, tiny_run

TEXT = "the quick brown fox jumps over the lazy dog and the cat sat on the mat"


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    """A first run of 3 steps on one sample repeated (every step sees the same tokens, so a loss before a step is the
    adapter's loss on that sample), then a second run of 3 steps continuing its adapter through the command line."""
    out = tmp_path_factory.mktemp("runs")
    data = out / "same.jsonl"
    data.write_text("".join(json.dumps({"text": TEXT}) + "\n" for _ in range(16)))
    first = tiny_run(tiny_model, str(data), out, "first", "adapter.r=4", "adapter.target_modules=[q_proj, v_proj]")
    sets = [f"--set={s}" for s in FAST if not s.startswith("adapter.")]
    code = main(["train", "--recipe", "8gb", "--model", tiny_model, "--data", str(data), "--output-dir", str(out),
                 "--name", "second", "--adapter", str(first.run_dir / "adapter"), "--no-wandb", *sets])  # fmt: skip
    assert code == 0
    return first.run_dir, out / "second", data


def _loss(tiny_model, adapter, recipe) -> float:
    """The plain computation: the model's mean next-token cross-entropy on the training sample, as training
    tokenized it, for the base alone (adapter None) or with the adapter loaded."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lowmem_ft.data.prepare import prepare_datasets
    from lowmem_ft.train.model import load_tokenizer

    train_ds, _, _ = prepare_datasets(recipe, load_tokenizer(recipe))
    ids = torch.tensor([train_ds[0]["input_ids"]])
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    with torch.no_grad():
        return model.eval()(input_ids=ids, labels=ids).loss.item()


def test_the_second_run_starts_where_the_first_ended(runs, tiny_model):
    first, second, _ = runs
    m1 = json.loads((first / "metrics.json").read_text())
    m2 = json.loads((second / "metrics.json").read_text())
    recipe = resolve(second / "recipe.yaml")
    base_loss = _loss(tiny_model, None, recipe)
    trained_loss = _loss(tiny_model, first / "adapter", recipe)
    # the first run started from peft's fresh adapter (B = 0: the base model's loss) and learned
    assert m1["first_loss"] == pytest.approx(base_loss, rel=1e-4)
    assert trained_loss < base_loss - 0.05
    # the second run's first loss is the first run's adapter on the same tokens: continued, not re-initialized
    assert m2["first_loss"] == pytest.approx(trained_loss, rel=1e-4)
    assert m2["last_loss"] < m2["first_loss"]


def test_the_second_run_records_the_adapter_and_saves_a_new_one(runs):
    first, second, _ = runs
    recipe = resolve(second / "recipe.yaml")
    a = recipe.adapter
    assert (a.r, a.target_modules, a.name_or_path) == (4, ["q_proj", "v_proj"], str(first / "adapter"))
    before = load_file(first / "adapter" / "adapter_model.safetensors")
    after = load_file(second / "adapter" / "adapter_model.safetensors")
    assert before.keys() == after.keys() and len(before) == 8  # q and v, A and B, in both layers
    assert all(after[k].dtype == torch.float32 and after[k].shape == before[k].shape for k in before)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    card = (second / "adapter" / "README.md").read_text()
    assert f"continued from the adapter `{first / 'adapter'}`" in card
