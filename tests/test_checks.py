"""The directory checks agree with the loaders: what they pass loads, what they refuse fails to load."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from lowmem_ft.checks import (
    check_adapter_dir,
    check_model,
    check_model_dir,
    checkpoint_problem,
    safetensors_problem,
    torch_file_problem,
)
from lowmem_ft.errors import UserError


@pytest.fixture
def tensors(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.arange(10.0), "b": torch.ones(3, 3), "c": torch.zeros(0)}, path, metadata={"format": "pt"})
    return path


def test_a_complete_safetensors_file_passes_and_loads(tensors):
    assert safetensors_problem(tensors) is None
    assert set(load_file(tensors)) == {"a", "b", "c"}


@pytest.mark.parametrize("cut", [1, 8, 40, 100])
def test_every_truncation_is_caught_and_safetensors_agrees(tensors, cut):
    size = tensors.stat().st_size
    os.truncate(tensors, size - cut)
    problem = safetensors_problem(tensors)
    assert problem is not None and "truncated" in problem
    with pytest.raises(SafetensorError):
        load_file(tensors)


def test_bytes_after_the_last_tensor_are_caught_and_safetensors_agrees(tensors):
    with tensors.open("ab") as handle:
        handle.write(b"junk")
    assert "4 bytes after its last tensor" in safetensors_problem(tensors)
    with pytest.raises(SafetensorError, match="not fully covered"):
        load_file(tensors)


def test_an_empty_safetensors_file_is_fine(tmp_path):
    path = tmp_path / "empty.safetensors"
    save_file({}, path)
    assert safetensors_problem(path) is None and load_file(path) == {}


def test_torch_files_truncated_or_garbage_are_caught_and_torch_agrees(tmp_path):
    path = tmp_path / "optimizer.pt"
    torch.save({"state": {0: torch.ones(100)}}, path)
    assert torch_file_problem(path) is None
    os.truncate(path, path.stat().st_size - 30)
    assert "truncated or corrupt" in torch_file_problem(path)
    with pytest.raises(RuntimeError):
        torch.load(path, weights_only=True)
    path.write_bytes(b"")
    assert torch_file_problem(path) == "optimizer.pt is empty"


def test_a_model_directory_needs_config_and_complete_weights(tiny_model, tmp_path):
    check_model_dir(Path(tiny_model))  # the real thing passes
    model = tmp_path / "m"
    shutil.copytree(tiny_model, model)
    check_model_dir(model)
    (model / "model.safetensors").unlink()
    check_model_dir(model, weights=False)  # plan reads config.json only
    with pytest.raises(UserError, match="no weights"):
        check_model_dir(model)
    (model / "config.json").unlink()
    with pytest.raises(UserError, match="no config.json"):
        check_model_dir(model, weights=False)
    check_model_dir(model, weights=False, config=False)  # data stats reads the tokenizer only


def test_hub_ids_are_left_to_the_loader_and_paths_must_exist(tmp_path):
    check_model("Qwen/Qwen2.5-7B")  # a Hub id: not this module's business
    check_model("gpt2")
    for path in (str(tmp_path / "nope"), "./nope", "../a/b", "a/b/c"):
        with pytest.raises(UserError, match="no such directory"):
            check_model(path)


def test_an_adapter_directory_is_a_lora_with_complete_weights(finished_run, tmp_path):
    adapter = tmp_path / "adapter"
    shutil.copytree(f"{finished_run}/adapter", adapter)
    assert check_adapter_dir(adapter)["peft_type"] == "LORA"
    config = json.loads((adapter / "adapter_config.json").read_text())
    for field, value, words in (("r", 0, "r must be a positive integer"), ("lora_alpha", "x", "lora_alpha"),
                                ("target_modules", 5, "target_modules"), ("base_model_name_or_path", 3, "string")):  # fmt: skip
        (adapter / "adapter_config.json").write_text(json.dumps({**config, field: value}))
        with pytest.raises(UserError, match=words):
            check_adapter_dir(adapter)


def test_checkpoints_complete_and_incomplete(finished_run, tmp_path):
    """The finished run's checkpoints are complete; each part removed or damaged makes one incomplete."""
    source = f"{finished_run}/checkpoints/checkpoint-2"
    assert checkpoint_problem(tmp_path / "missing") == "not a directory"
    damage = {
        "trainer_state.json": ("unlink", "no trainer_state.json"),
        "adapter_model.safetensors": ("unlink", "no weights"),
        "optimizer.pt": ("unlink", "no optimizer state"),
        "scheduler.pt": ("truncate", "scheduler.pt is truncated"),
        "rng_state.pth": ("truncate", "rng_state.pth is truncated"),
    }
    checkpoint = tmp_path / "checkpoint-2"
    shutil.copytree(source, checkpoint)
    assert checkpoint_problem(checkpoint) is None
    for name, (how, words) in damage.items():
        shutil.rmtree(checkpoint)
        shutil.copytree(source, checkpoint)
        path = checkpoint / name
        path.unlink() if how == "unlink" else os.truncate(path, path.stat().st_size // 2)
        assert words in checkpoint_problem(checkpoint), name
