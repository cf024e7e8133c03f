"""Preference training (lowmem_ft/train/methods/preference.py): DPO end to end, and its loss against the definition on
every zoo family, whole and cut into pieces of pairs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.train.tiny_runs import tiny_run, tiny_trainer

PAIRS = str(Path(__file__).parents[1] / "data" / "fixtures" / "preference" / "pairs_chat.jsonl")


@pytest.mark.slow
def test_dpo_trains_lora_end_to_end(zoo_models, tmp_path):
    """A LoRA DPO run: the adapter is saved, the method's metrics are logged, the loss starts at log 2 (policy =
    reference: a fresh adapter changes nothing) and the adapter's weights move. The suite checks its memory."""
    result = tiny_run(zoo_models["qwen2.5"], PAIRS, tmp_path, "dpo", "training.method=dpo", "training.max_steps=2")
    assert (result.run_dir / "adapter" / "adapter_model.safetensors").is_file()
    logged = [h for h in result.log_history if "loss" in h]
    assert logged[0]["loss"] == pytest.approx(0.6931, abs=1e-3)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert key in logged[-1], key
    moved = [p for n, p in result.model.named_parameters() if "lora_B" in n and p.abs().sum() > 0]
    assert moved, "no LoRA weight moved"
    info = json.loads((result.run_dir / "run.json").read_text())
    assert info["data"]["format"] == "preference" and info["data"]["fit"]["samples_in"] == 24


def _manual_dpo_loss(model, batch, beta: float) -> torch.Tensor:
    """DPO's sigmoid loss from its definition: full logits, log-softmax, each row's answer log-probability summed;
    the reference is the same model with the adapter disabled."""

    def logps() -> torch.Tensor:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
        per_token = torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
        return (per_token * batch["completion_mask"][:, 1:]).sum(-1)

    policy = logps()
    with torch.no_grad(), model.disable_adapter():
        reference = logps()
    pc, pr = policy.chunk(2)
    rc, rr = reference.chunk(2)
    return -torch.nn.functional.logsigmoid(beta * ((pc - rc) - (pr - rr))).mean()


@pytest.mark.slow
@pytest.mark.memory_unchecked(reason="no training run: the loss of one batch is computed by hand beside TRL's")
def test_dpo_loss_is_the_definition_on_every_zoo_family(zoo_models, tmp_path):
    from lowmem_ft.train.methods.preference import pair_pieces

    for name, path in zoo_models.items():
        job = tiny_trainer(path, PAIRS, tmp_path / name, "training.method=dpo")
        trainer, model = job.trainer, job.trainer.model
        torch.manual_seed(0)
        with torch.no_grad():  # move the adapter off zero, so that policy and reference differ
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.5)
        batch = trainer.data_collator([job.train_ds[i] for i in range(4)])
        model.train()
        ours = trainer.compute_loss(model, batch)
        expected = _manual_dpo_loss(model, batch, trainer.args.beta)
        assert ours.item() == pytest.approx(expected.item(), rel=1e-4, abs=1e-5), name
        assert abs(ours.item() - math.log(2)) > 1e-4, name  # the reference really is another model than the policy
        pieces = pair_pieces(batch, 1)
        total = sum(trainer.compute_loss(model, p) * (p["input_ids"].shape[0] / batch["input_ids"].shape[0])
                    for p in pieces)  # fmt: skip
        assert total.item() == pytest.approx(ours.item(), rel=1e-5), name
        job.run.unlock()


@pytest.mark.slow
@pytest.mark.parametrize(("method", "data", "metric"), [
    ("orpo", PAIRS, "log_odds_ratio"),
    ("simpo", PAIRS, "rewards/margins"),
    ("kto", str(Path(PAIRS).with_name("kto_chat.jsonl")), "kl"),
])  # fmt: skip
def test_orpo_simpo_kto_train_end_to_end(zoo_models, tmp_path, method, data, metric):
    """Each other method trains 2 steps with LoRA and logs its own metric; the suite checks each run's memory."""
    result = tiny_run(zoo_models["llama3"], data, tmp_path, method, f"training.method={method}", "training.max_steps=2")
    assert (result.run_dir / "adapter" / "adapter_model.safetensors").is_file()
    logged = [h for h in result.log_history if "loss" in h]
    assert metric in logged[-1] and math.isfinite(logged[-1]["loss"])
