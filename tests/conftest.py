"""Shared fixtures: the embedded tiny model and the zoo (built once per session), the CUDA marker, and the
memory-model check every CPU training run of every test goes through."""

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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """After a test passes: every run it trained on the CPU under its tmp_path measured its memory exactly, and the
    memory model must agree with it (tests/train/tiny_runs.py `memory_disagreements`, ≤ 8 % per run and per phase).
    A test opts out with `@pytest.mark.memory_unchecked(reason=...)`, saying why."""
    result = yield
    unchecked = item.get_closest_marker("memory_unchecked")
    assert unchecked is None or unchecked.kwargs.get("reason"), "memory_unchecked needs reason=... (why not checked)"
    tmp = item.funcargs.get("tmp_path") if hasattr(item, "funcargs") else None
    if tmp is not None and unchecked is None:
        from tests.train.tiny_runs import memory_disagreements

        problems = memory_disagreements(tmp)
        assert not problems, "the memory model disagrees with the exact CPU measurement:\n" + "\n".join(problems)
    return result


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
