"""LoRA branches recomputed in tiles: the same outputs and gradients as peft's own forward (fp32), across model
families, plain and 4-bit base layers, with and without layer checkpointing; dropout masks replayed."""

from __future__ import annotations

import pytest
import torch
from peft.tuners.lora import LoraLayer

from lowmem_ft.train.savers import tiles
from lowmem_ft.train.savers.lora_recompute import recompute_lora
from lowmem_ft.train.savers.tiles import tile_mlps
from tests.train.lora_models import FAMILIES, assert_same, batch, grads_of, model_of


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ckpt", "ckpt"])
def test_gradients_equal_peft(family, checkpointing):
    ids, mask = batch()
    loss, plain = grads_of(model_of(family, checkpointing=checkpointing), ids, mask)
    model = model_of(family, checkpointing=checkpointing)
    assert recompute_lora(model, 16, skip_mlp=False) == 2 * len(model.peft_config["default"].target_modules)
    recomputed_loss, grads = grads_of(model, ids, mask)
    torch.testing.assert_close(recomputed_loss, loss, rtol=1e-6, atol=1e-6)
    assert_same(grads, plain)


def test_with_tiled_mlp_the_mlp_adapters_stay_inside_the_tiles():
    ids, mask = batch()
    _, plain = grads_of(model_of("llama", checkpointing=True), ids, mask)
    model = model_of("llama", checkpointing=True)
    tile_mlps(model, 16)
    wrapped = recompute_lora(model, 16, skip_mlp=True)
    assert wrapped == 2 * 2  # q_proj and v_proj of two layers; gate/up/down run in the MLP's tiles
    _, grads = grads_of(model, ids, mask)
    assert_same(grads, plain)


def test_dropout_masks_are_replayed(monkeypatch):
    """Reference: the same tiles with every tensor kept (the checkpoint replaced by a plain call)."""
    ids, mask = batch()
    with monkeypatch.context() as m:
        m.setattr(tiles, "checkpoint", lambda fn, *args, **kwargs: fn(*args))
        reference = model_of("qwen2", dropout=0.3, checkpointing=True)
        recompute_lora(reference, 16, skip_mlp=False)
        ref_loss, expected = grads_of(reference, ids, mask)
    model = model_of("qwen2", dropout=0.3, checkpointing=True)
    recompute_lora(model, 16, skip_mlp=False)
    loss, grads = grads_of(model, ids, mask)
    torch.testing.assert_close(loss, ref_loss)
    assert_same(grads, expected)


def test_qlora_build_path_matches_peft(tiny_model):
    """bnb Linear4bit base layers (peft's bnb forward: the update is cast before the add), built as `train` does."""
    from lowmem_ft.recipe.load import resolve
    from lowmem_ft.train.model import build_model

    ids = torch.randint(0, 500, (1, 40))
    grads, outputs = {}, {}
    for recompute in (False, True):
        recipe = resolve(
            "8gb",
            {
                "model": {"name_or_path": tiny_model, "compute_dtype": "float32"},
                "adapter": {"dropout": 0.0},
                "memory": {"recompute_lora": recompute, "mlp_tile_tokens": 16},
            },
        )
        torch.manual_seed(0)
        model = build_model(recipe)
        layers = [m for m in model.modules() if isinstance(m, LoraLayer) and hasattr(m, "base_layer")]
        assert all(getattr(m, "_lowmem_recompute", False) == recompute for m in layers)
        assert any(type(m.base_layer).__name__ == "Linear4bit" for m in layers)
        torch.manual_seed(3)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.data.normal_(0, 0.1)
        model.train()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        outputs[recompute] = out.logits.detach()
        grads[recompute] = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    torch.testing.assert_close(outputs[True], outputs[False])
    assert_same(grads[True], grads[False])


def test_disabled_adapters_take_peft_s_path():
    ids, _ = batch(1, 12)
    plain, model = model_of("llama").eval(), model_of("llama").eval()
    recompute_lora(model, 4, skip_mlp=False)
    with torch.no_grad(), plain.disable_adapter(), model.disable_adapter():
        torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_layers_kept_on_peft_forward_are_one_warning(caplog):
    """GPT-2's fused attention is a Conv1D, not an nn.Linear: its LoRA keeps peft's forward, one line for all the
    blocks (one line per block before)."""
    import logging

    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=3, n_embd=16, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0)
    model = get_peft_model(GPT2LMHeadModel(config), LoraConfig(r=2, target_modules=["c_attn"]))
    with caplog.at_level(logging.WARNING, logger="lowmem_ft.train.savers.lora_recompute"):
        assert recompute_lora(model, 16, skip_mlp=False) == 0
    assert [r.getMessage() for r in caplog.records if r.name.startswith("lowmem_ft")] == [
        "memory.recompute_lora: 3 LoRA layers on Conv1D keep peft's forward (base_model.model.transformer.h.0.attn."
        "c_attn, base_model.model.transformer.h.1.attn.c_attn, base_model.model.transformer.h.2.attn.c_attn)"
    ]
