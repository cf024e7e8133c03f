"""Sequence-tiled MLP: gradients equal the untiled ones (fp32) across model families, with LoRA/QLoRA inside the MLP,
with and without layer checkpointing; with LoRA dropout the recompute replays the forward's masks."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from lowmem_ft.errors import UserError
from lowmem_ft.train.savers import tiles
from lowmem_ft.train.savers.tiles import decoder_mlps, hidden_norms, tile_mlps
from tests.train.lora_models import FAMILIES, SMALL, assert_same, batch, grads_of, model_of


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ckpt", "ckpt"])
def test_tiled_gradients_equal_untiled(family, checkpointing):
    ids, mask = batch()
    loss, plain = grads_of(model_of(family, checkpointing=checkpointing), ids, mask)
    tiled = model_of(family, checkpointing=checkpointing)
    assert tile_mlps(tiled, 16) == 2  # 74 tokens → tiles of 16, 16, 16, 16, 10
    tiled_loss, grads = grads_of(tiled, ids, mask)
    torch.testing.assert_close(tiled_loss, loss, rtol=1e-6, atol=1e-6)
    assert_same(grads, plain)


def _untiled_loop(model, tile: int) -> None:
    """The same tiles with every tensor kept (no recompute): the plain computation of the tiled forward."""
    for _, mlp in decoder_mlps(model):
        plain = mlp.forward

        def forward(x, plain=plain):
            flat = x.reshape(-1, x.shape[-1])
            return torch.cat([plain(t) for t in flat.split(tile)]).view(*x.shape[:-1], -1)

        mlp.forward = forward


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ckpt", "ckpt"])
def test_dropout_masks_are_replayed_in_the_recompute(checkpointing):
    """With LoRA dropout the tiled forward draws its masks tile by tile; the backward's recompute must use the same
    masks, so the gradients equal those of the same tiles computed once with every tensor kept."""
    ids, mask = batch()
    reference = model_of("llama", dropout=0.3, checkpointing=checkpointing)
    _untiled_loop(reference, 16)
    ref_loss, expected = grads_of(reference, ids, mask)
    tiled = model_of("llama", dropout=0.3, checkpointing=checkpointing)
    tile_mlps(tiled, 16)
    loss, grads = grads_of(tiled, ids, mask)
    torch.testing.assert_close(loss, ref_loss)
    assert_same(grads, expected)


def test_the_dropout_check_catches_a_recompute_without_rng_restore(monkeypatch):
    """DeepSpeed's / liger-kernel's TiledMLP failure mode (fresh masks in the recompute) fails the check above."""
    ids, mask = batch()
    reference = model_of("llama", dropout=0.3)
    _untiled_loop(reference, 16)
    _, expected = grads_of(reference, ids, mask)

    def no_rng_restore(fn, *args, **kwargs):
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)

    monkeypatch.setattr(tiles, "checkpoint", no_rng_restore)
    broken = model_of("llama", dropout=0.3)
    tile_mlps(broken, 16)
    _, grads = grads_of(broken, ids, mask)
    lora_mlp = [n for n in grads if "mlp" in n and "lora_A" in n]
    assert any(not torch.allclose(grads[n], expected[n], rtol=1e-3) for n in lora_mlp)


def test_no_grad_forward_runs_the_tiles_without_checkpoints():
    ids, mask = batch()
    plain, tiled = model_of("qwen2").eval(), model_of("qwen2").eval()
    tile_mlps(tiled, 8)
    with torch.no_grad():
        torch.testing.assert_close(tiled(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_qlora_through_the_build_path_matches_untiled(tiny_model):
    """NF4 base layers with LoRA inside the MLP and layer checkpointing, built as `train` builds them; the tiles
    survive the trainer's train() / eval() switches."""
    from lowmem_ft.recipe.load import resolve
    from lowmem_ft.train.model import build_model

    ids = torch.randint(0, 500, (1, 50))
    grads = {}
    for tiled in (False, True):
        recipe = resolve(
            "8gb",
            {
                "model": {"name_or_path": tiny_model, "compute_dtype": "float32"},
                "adapter": {"dropout": 0.1},
                "memory": {"tiled_mlp": tiled, "tiled_norms": tiled, "mlp_tile_tokens": 12},
            },
        )
        torch.manual_seed(0)
        model = build_model(recipe)
        model.eval()  # transformers 5.25 with Hub kernels on re-kernelized here and dropped the tiled norms
        model.train()
        if tiled:
            tiled_modules = decoder_mlps(model) + hidden_norms(model)
            assert len(tiled_modules) == 2 + 5  # 2 layers' MLPs; 2 norms per layer and the final one
            assert all(m.forward.__qualname__.startswith("tiled_forward") for _, m in tiled_modules)
        # dropout draws differ between tiled and untiled forwards; compare at dropout 0 by switching it off
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        torch.manual_seed(3)  # lora_B starts at zero: give it values so lora_A gets gradients too
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.data.normal_(0, 0.1)
        _, grads[tiled] = grads_of(model, ids, torch.ones_like(ids))
    assert_same(grads[True], grads[False])


def test_mixture_of_experts_and_missing_mlps_are_refused():
    from transformers import AutoModelForCausalLM, MixtralConfig

    moe = AutoModelForCausalLM.from_config(
        MixtralConfig(**SMALL, num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1)
    )
    with pytest.raises(UserError, match="mixture of experts"):
        tile_mlps(moe, 16)
    with pytest.raises(UserError, match="no decoder MLP"):
        tile_mlps(torch.nn.Sequential(torch.nn.Linear(2, 2)), 16)
    with pytest.raises(UserError, match="at least 1"):
        tile_mlps(model_of("llama"), 0)


def test_tiling_twice_keeps_the_first():
    model = model_of("llama")
    tile_mlps(model, 16)
    forwards = [m.forward for _, m in decoder_mlps(model)]
    tile_mlps(model, 8)
    assert [m.forward for _, m in decoder_mlps(model)] == forwards


@pytest.mark.parametrize("family", FAMILIES)
def test_tiled_norms_gradients_equal_untiled(family):
    """Every hidden-size norm (Gemma 2's four per layer and its (1 + w) scale included) tiled, with the MLPs."""
    from lowmem_ft.train.savers.tiles import tile_norms

    ids, mask = batch()
    loss, plain = grads_of(model_of(family, checkpointing=True), ids, mask)
    tiled = model_of(family, checkpointing=True)
    per_layer = 4 if family == "gemma2" else 2
    assert tile_norms(tiled, 16) == 2 * per_layer + 1  # the layers' norms and the final norm
    assert all(n.weight.shape == (SMALL["hidden_size"],) for _, n in hidden_norms(tiled))
    tile_mlps(tiled, 16)
    tiled_loss, grads = grads_of(tiled, ids, mask)
    torch.testing.assert_close(tiled_loss, loss, rtol=1e-6, atol=1e-6)
    assert_same(grads, plain)


def test_tiled_norms_train_the_norm_weights_of_a_full_fine_tune():
    """Norm weights that require grad (full fine-tuning) get the untiled gradients too."""
    from lowmem_ft.train.savers.tiles import tile_norms
    from tests.train.lora_models import configs

    ids, mask = batch()
    grads = {}
    for tiled in (False, True):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(configs()["llama"], dtype=torch.float32).train()
        if tiled:
            tile_norms(model, 16)
        _, grads[tiled] = grads_of(model, ids, mask)
    norm_grads = [n for n in grads[True] if "norm" in n]
    assert norm_grads
    assert_same(grads[True], grads[False])
