"""The model states (weights, trainable tensors, gradients, optimizer states) read nothing the step alone reads, so
one count serves every batch shape, length and saver the planner tries (`static.states_key`)."""

from __future__ import annotations

from dataclasses import replace

import golden_grid
import pytest

from lowmem_ft.memory import sharding, static
from lowmem_ft.memory.records import Setup

GOLDEN = golden_grid.load()
# the other value of each field `states_key` clears, so that every one of them is seen changed
CHANGED = {
    "micro_batch_size": 3, "max_seq_len": 777, "gradient_accumulation": 5, "loss_tokens": 123,
    "gradient_checkpointing": True, "activation_offloading": True, "loss_impl": "chunked", "loss_chunk_tokens": 64,
    "tiled_mlp": True, "mlp_tile_tokens": 32, "recompute_lora": True, "tiled_norms": True, "allocator": "default",
}  # fmt: skip


def test_every_cleared_field_is_changed_here():
    assert set(CHANGED) == set(static._STEP_ONLY)


@pytest.mark.parametrize("name", sorted(GOLDEN["models"]))
def test_the_model_states_read_no_step_field(name):
    """Every family and catalog model, a third of its recorded setups (a sample over adapters, quantization,
    optimizers, devices): the states of the setup as given, of its key, and of the setup with every step field
    changed are the same."""
    record = GOLDEN["models"][name]
    arch = golden_grid.architecture(record["spec"])
    for p in record["setups"][::3]:
        s = Setup(**{**p["fields"], "lora_targets": tuple(p["fields"]["lora_targets"])})
        changed = replace(s, **CHANGED)
        for states in (static._state.__wrapped__, lambda a, x: sharding._states_of.__wrapped__(a, x, False, None)):
            want = states(arch, s)
            assert states(arch, static.states_key(s)) == want, p["fields"]
            assert states(arch, changed) == want, p["fields"]
