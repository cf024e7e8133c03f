"""Fixtures for the data tests: a private tokenization cache per test and the tiny model's tokenizer."""

from __future__ import annotations

import os

import pytest

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
FORMAT_FILES = {
    "text": "text.jsonl",
    "prompt_completion": "prompt_completion.jsonl",
    "messages": "messages.jsonl",
    "sharegpt": "sharegpt.jsonl",
    "alpaca": "alpaca.jsonl",
}


def fixture(name: str) -> str:
    return os.path.join(FIXTURES, name)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Each test tokenizes into its own cache, so no test sees another's cached data."""
    monkeypatch.setenv("LOWMEM_FT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def tokenizer(tiny_model):
    from lowmem_ft.data.tokenize import load_tokenizer

    return load_tokenizer(tiny_model)
