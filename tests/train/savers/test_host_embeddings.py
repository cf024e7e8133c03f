"""Frozen input embeddings in host memory: the table stays on the host, outputs and LoRA gradients are unchanged."""

from __future__ import annotations

import pytest
import torch

from lowmem_ft.errors import UserError
from lowmem_ft.recipe.load import resolve
from lowmem_ft.train.model import build_model
from lowmem_ft.train.savers.host_embeddings import embeddings_on_host


def _recipe(tiny_model, **memory):
    return resolve(
        "8gb",
        {"model": {"name_or_path": tiny_model, "quantization": "none"}, "adapter": {"dropout": 0.0}, "memory": memory},
    )


def _step(model, ids):
    model.train()
    torch.manual_seed(3)  # lora_B starts at zero: give it values so every LoRA weight gets a gradient
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(0, 0.1)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("checkpointing", [True, False], ids=["ckpt", "no-ckpt"])
def test_host_table_gives_the_same_outputs_and_gradients(tiny_model, checkpointing):
    ids = torch.randint(0, 500, (2, 24))
    results = {}
    for host in (False, True):
        torch.manual_seed(0)
        model = build_model(_recipe(tiny_model, embeddings_on_host=host, gradient_checkpointing=checkpointing))
        emb = model.get_base_model().get_input_embeddings()
        assert emb.weight.device.type == "cpu" and not emb.weight.requires_grad
        assert getattr(emb, "_lowmem_on_host", False) is host
        results[host] = _step(model, ids)
    torch.testing.assert_close(results[True][0], results[False][0])
    assert results[True][1].keys() == results[False][1].keys()
    for name, grad in results[False][1].items():
        torch.testing.assert_close(results[True][1][name], grad, msg=name)
        assert grad.abs().sum() > 0, name


def test_rows_are_looked_up_on_the_host_and_sent_to_the_models_device(tiny_model, monkeypatch):
    """What runs where: the lookup sees host ids; the rows are moved to the device the table came from."""
    model = build_model(_recipe(tiny_model))
    emb = model.get_base_model().get_input_embeddings()
    seen = []
    plain = torch.nn.functional.embedding

    def spy(ids, weight, *args, **kwargs):
        seen.append((ids.device.type, weight.device.type))
        return plain(ids, weight, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "embedding", spy)
    embeddings_on_host(model)
    moved = []
    real_to = torch.Tensor.to

    def spy_to(self, *args, **kwargs):
        moved.append((self.dtype, args, kwargs))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", spy_to)
    rows = emb(torch.tensor([[1, 2, 3]]))
    assert seen == [("cpu", "cpu")]
    assert rows.shape == (1, 3, emb.weight.shape[1])
    # ids go to the host; the gathered rows (16-bit) go to the device the table was on (here the CPU)
    assert (torch.int64, ("cpu",), {}) in moved
    assert (emb.weight.dtype, (torch.device("cpu"),), {"non_blocking": False}) in moved


def test_tied_and_trained_tables_are_refused(tiny_model):
    from transformers import AutoModelForCausalLM, Qwen2Config

    tied = AutoModelForCausalLM.from_config(
        Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                    tie_word_embeddings=True)
    )  # fmt: skip
    for p in tied.parameters():
        p.requires_grad_(False)
    with pytest.raises(UserError, match="ties its input embeddings"):
        embeddings_on_host(tied)
    trained = AutoModelForCausalLM.from_config(
        Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                    tie_word_embeddings=False)
    )  # fmt: skip
    with pytest.raises(UserError, match="trained"):
        embeddings_on_host(trained)
