"""Shared fixtures: the embedded tiny model and the zoo (built once per session), and the CUDA marker."""

from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

DATA = os.path.join(os.path.dirname(__file__), "data")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "requires_cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _forget_bnb_module_overrides():
    """transformers' Trainer registers every nn.Embedding with bitsandbytes' process-wide `GlobalOptimManager` (32-bit
    optimizer states for embeddings, trainer.py create_optimizer) and nothing unregisters them, so each in-process
    training run's embedding would outlive its test and be counted by later exact memory measurements."""
    yield
    optim = sys.modules.get("bitsandbytes.optim")
    if optim is not None:
        optim.GlobalOptimManager.get_instance().module_weight_config_triple.clear()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """Path of a freshly built tiny Qwen2 model with its tokenizer."""
    from devkit.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2"))


@pytest.fixture(scope="session")
def zoo_models(tmp_path_factory) -> dict[str, str]:
    """Every zoo family (devkit/zoo.py) built once per session: name → model directory."""
    from devkit.zoo import build_all

    return {name: str(path) for name, path in build_all(tmp_path_factory.mktemp("zoo")).items()}


@pytest.fixture
def chat_data() -> str:
    return os.path.join(os.path.dirname(__file__), "..", "examples", "chat.jsonl")


@pytest.fixture(scope="session")
def finished_run(tiny_model, tmp_path_factory) -> str:
    """A finished LoRA run of the tiny model (2 steps, a checkpoint after each): recipe.yaml, run.json, adapter/,
    checkpoints/checkpoint-1 and -2. Shared by the tests that hand commands damaged or hostile copies of it."""
    from tests.train.tiny_runs import tiny_run

    out = tmp_path_factory.mktemp("finished")
    data = os.path.join(os.path.dirname(__file__), "..", "examples", "chat.jsonl")
    tiny_run(
        tiny_model, data, out, "done", "training.max_steps=2", "training.save_steps=1", "logging.wandb_mode=disabled"
    )
    return str(out / "done")
