"""The trainer arguments: built whole from the recipe (packing decided first), without deprecated names."""

from __future__ import annotations

import warnings

from lowmem_ft.recipe.load import resolve
from lowmem_ft.train.args import batching, save_steps, sft_config


def test_the_config_uses_transformers_current_checkpointing_argument(tmp_path):
    """TRL's config defaults the deprecated `gradient_checkpointing` alias, which printed a FutureWarning on every
    run; `activation_checkpointing` is the current name (and checkpointing stays off: the model sets its own)."""
    recipe = resolve("8gb", ["model.name_or_path=x"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = sft_config(recipe, tmp_path / "checkpoints", "run", trackers=[], packed=False)
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == []
    assert args.activation_checkpointing is False and args.gradient_checkpointing is False


def test_packing_is_decided_before_the_config_is_built(tiny_model, tmp_path):
    packed = resolve("8gb", [f"model.name_or_path={tiny_model}", "data.packing=true"])
    decision = batching(packed)
    assert decision.packed and "block-diagonal" in decision.how
    args = sft_config(packed, tmp_path, "run", trackers=[], packed=decision.packed)
    assert args.packing and args.padding_free is False and args.train_sampling_strategy == "random"
    eager_remote = resolve("8gb", [f"model.name_or_path={tiny_model}", "data.packing=true",
                                   "model.attn_implementation=flash_attention_2"])  # fmt: skip
    assert batching(eager_remote).packed  # flash-attention's varlen kernels keep samples apart too
    unpacked = sft_config(packed, tmp_path, "run", trackers=[], packed=False)
    assert not unpacked.packing and unpacked.train_sampling_strategy == "group_by_length"
    assert batching(resolve("8gb", [f"model.name_or_path={tiny_model}"])).to_dict() == {
        "packing": False,
        "batches": "length-grouped",
    }


def test_saves_follow_the_eval_cadence_when_there_is_eval_data():
    assert save_steps(resolve("8gb", ["training.save_steps=30", "training.eval_steps=10"])) == 30
    with_eval = resolve("8gb", ["training.save_steps=30", "training.eval_steps=10", "data.eval_fraction=0.1"])
    assert save_steps(with_eval) == 10
