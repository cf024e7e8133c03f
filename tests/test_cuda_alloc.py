"""The allocator setting a run uses, decided once (`lowmem_ft.cuda_alloc`): `train` sets it up, `plan` prices it."""

from __future__ import annotations

import pytest

from lowmem_ft import cuda_alloc


@pytest.mark.parametrize(
    ("conf", "setting"),
    [
        ("expandable_segments:True", "expandable segments"),
        ("expandable_segments:true", "expandable segments"),
        ("max_split_size_mb:128, expandable_segments:True", "expandable segments"),
        ("expandable_segments:False", "default"),
        ("max_split_size_mb:128", "default"),
        ("", "default"),
    ],
)
def test_the_setting_is_read_from_torchs_options(conf, setting):
    assert cuda_alloc.setting_of(conf) == setting


def test_a_run_uses_expandable_segments_unless_the_user_set_either_variable():
    assert cuda_alloc.run_setting({}) == "expandable segments"
    assert cuda_alloc.run_setting({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}) == "default"
    assert cuda_alloc.run_setting({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}) == "default"
    # torch reads PYTORCH_CUDA_ALLOC_CONF first (c10/cuda/CUDAAllocatorConfig.h)
    both = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}
    assert cuda_alloc.run_setting(both) == "expandable segments"


def test_train_leaves_the_generic_variable_as_the_user_set_it(monkeypatch):
    from lowmem_ft.train import device

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:64")
    assert device.configure_allocator() == "max_split_size_mb:64"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in device.os.environ  # it would take precedence over the user's


def test_plan_prices_the_setting_train_would_use(monkeypatch):
    from lowmem_ft.choosing import setup_from_recipe
    from lowmem_ft.recipe.load import resolve

    recipe = resolve(None, {"model": {"name_or_path": "Qwen/Qwen2.5-0.5B"}})
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert setup_from_recipe(recipe).allocator == "expandable segments"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert setup_from_recipe(recipe).allocator == "default"
