"""Split-stable LoRA dropout: the same masks whether a micro batch runs whole or in pieces, and still dropout."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from lowmem_ft.train.resilience.dropout import DropoutContext, Piece, StableDropout, install


def _run(module: StableDropout, x: torch.Tensor, dim: int, sizes: list[int], seed: int = 7) -> torch.Tensor:
    """`x` through the dropout as pieces of `sizes` along `dim`, put back together."""
    outs, start = [], 0
    for size in sizes:
        with module.context.piece(Piece(seed, dim, x.shape[dim], start, size)):
            outs.append(module(x.narrow(dim, start, size)))
        start += size
    return torch.cat(outs, dim)


@pytest.mark.parametrize(
    "dim,sizes",
    [(0, [8]), (0, [4, 4]), (0, [2, 2, 2, 2]), (0, [1] * 8), (1, [40]), (1, [13, 27]), (1, [5, 10, 25])],
    ids=["rows-whole", "rows-2", "rows-4", "rows-8", "packed-whole", "packed-2", "packed-3"],
)
def test_pieces_draw_the_whole_micro_batchs_mask(dim, sizes):
    """Rows of a padded batch (dim 0) and tokens of a packed row (dim 1), cut as an OOM step-down cuts them."""
    module = StableDropout(0.25, index=3, context=DropoutContext()).train()
    x = torch.randn(8, 40, 16) if dim == 0 else torch.randn(1, 40, 16)
    whole = _run(module, x, dim, [x.shape[dim]])
    assert torch.equal(_run(module, x, dim, sizes), whole)
    assert not torch.equal(_run(module, x, dim, sizes, seed=8), whole)  # another micro batch, other masks
    other = StableDropout(0.25, index=4, context=module.context).train()
    assert not torch.equal(_run(other, x, dim, sizes), whole)  # another module, another mask


def test_it_is_dropout():
    p = 0.05
    module = StableDropout(p, 0, DropoutContext()).train()
    x = torch.ones(64, 128, 32)
    with module.context.piece(Piece(11, 0, 64, 0, 64)):
        y = module(x)
    dropped = (y == 0).float().mean().item()
    assert abs(dropped - p) < 0.005  # 262144 draws: 4σ ≈ 0.0017
    assert torch.all((y == 0) | torch.isclose(y, torch.tensor(1 / (1 - p))))  # kept values scaled by 1/(1−p)
    assert torch.equal(module.eval()(x), x)  # eval: identity
    module.train()
    y = module(x)  # outside a trainer's micro batch: torch's dropout
    assert 0 < (y == 0).float().mean().item() < 0.1


def test_gradients_flow_through_the_kept_values_only():
    module = StableDropout(0.5, 0, DropoutContext()).train()
    x = torch.randn(4, 6, 8, requires_grad=True)
    with module.context.piece(Piece(3, 0, 4, 0, 4)):
        y = module(x)
    y.sum().backward()
    kept = y.detach() != 0
    assert torch.equal(x.grad, kept.float() * 2.0)


def test_an_input_that_does_not_follow_the_batch_gets_a_repeatable_mask():
    """Tokens regrouped per expert (MoE) have no row or token dimension matching the micro batch's: the mask is
    repeatable for the same piece, not split-stable."""
    module = StableDropout(0.3, 0, DropoutContext()).train()
    x = torch.randn(7, 16)  # 7 routed tokens, whatever the piece
    piece = Piece(5, 0, 4, 2, 2)
    with module.context.piece(piece):
        first = module(x)
    with module.context.piece(piece):
        assert torch.equal(module(x), first)


def test_install_replaces_the_lora_dropouts_only(tiny_model):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    base.config.attention_dropout = 0.0
    model = get_peft_model(base, LoraConfig(r=4, lora_dropout=0.1, target_modules=["q_proj", "v_proj"]))
    plain = [m for m in model.modules() if type(m) is nn.Dropout]
    context = install(model)
    stable = [m for m in model.modules() if isinstance(m, StableDropout)]
    layers = model.config.num_hidden_layers
    assert len(stable) == 2 * layers == len(plain) and [m.index for m in stable] == list(range(2 * layers))
    assert all(m.context is context and m.p == 0.1 for m in stable)
    assert not [m for m in model.modules() if type(m) is nn.Dropout]
    none = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), LoraConfig(r=4, lora_dropout=0.0))
    install(none)
    assert not [m for m in none.modules() if isinstance(m, StableDropout)]  # p = 0: peft's Identity stays
