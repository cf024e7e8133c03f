"""The zoo's on-disk cache (tests/zoo_cache.py): built once, copied to each session, rebuilt when its code changes."""

from __future__ import annotations

import pytest

import devkit.zoo
from tests import zoo_cache


@pytest.fixture
def builds(monkeypatch, tmp_path):
    """A stand-in for build_all that writes one file per family and counts its calls."""
    calls = []

    def build_all(root):
        calls.append(root)
        for name in devkit.zoo.NAMES:
            (root / name).mkdir(parents=True)
            (root / name / "config.json").write_text(f'{{"built": {len(calls)}}}')
        return {name: root / name for name in devkit.zoo.NAMES}

    monkeypatch.setattr(devkit.zoo, "build_all", build_all)
    monkeypatch.setenv("LOWMEM_FT_TEST_CACHE", str(tmp_path / "cache"))
    return calls


def test_built_once_then_copied(builds, tmp_path):
    first = zoo_cache.zoo(tmp_path / "a")
    second = zoo_cache.zoo(tmp_path / "b")
    assert len(builds) == 1 and sorted(first) == sorted(second) == sorted(devkit.zoo.NAMES)
    assert all(
        p.parent == tmp_path / "b" and (p / "config.json").read_text() == '{"built": 1}' for p in second.values()
    )
    (second["llama3"] / "config.json").write_text("changed by a test")  # a session's copy, not the cache
    assert (zoo_cache.zoo(tmp_path / "c")["llama3"] / "config.json").read_text() == '{"built": 1}'
    assert [p.name for p in (tmp_path / "cache" / "zoo").iterdir() if p.name.startswith(".staging")] == []


def test_a_change_to_the_code_that_builds_it_builds_again(builds, tmp_path, monkeypatch):
    zoo_cache.zoo(tmp_path / "a")
    before = zoo_cache.key()
    monkeypatch.setattr(zoo_cache, "SOURCES", (*zoo_cache.SOURCES, "devkit/docs.py"))
    assert zoo_cache.key() != before
    assert (zoo_cache.zoo(tmp_path / "b")["llama3"] / "config.json").read_text() == '{"built": 2}'


def test_off_builds_in_the_session(builds, tmp_path, monkeypatch):
    monkeypatch.setenv("LOWMEM_FT_TEST_CACHE", "off")
    zoo_cache.zoo(tmp_path / "a")
    zoo_cache.zoo(tmp_path / "b")
    assert builds == [tmp_path / "a", tmp_path / "b"]
