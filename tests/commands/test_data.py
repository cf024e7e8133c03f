"""`lowmem-ft data stats`: the profile printed for a file with known token lengths, and one-line errors."""

from __future__ import annotations

import json
import os

import pytest

from lowmem_ft.cli import main

KNOWN = os.path.join(os.path.dirname(__file__), "..", "data", "fixtures", "known_lengths.jsonl")


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LOWMEM_FT_CACHE", str(tmp_path / "cache"))


def test_stats_prints_profile_histogram_and_cuts(tiny_model, capsys):
    # known_lengths.jsonl: 20 samples of 2..21 tokens (k special tokens + EOS).
    assert main(["data", "stats", KNOWN, "--model", tiny_model, "--max-len", "16"]) == 0
    out = capsys.readouterr().out
    assert "20 samples, format text, 230 tokens" in out
    assert "p50 11  p90 19  p99 21  max 21" in out
    assert "     9–16            8  " in out  # histogram bucket (8, 16]: lengths 9..16
    assert "      16             5      25.0%          15      6.5%" in out  # lengths 17..21 lose 1..5 tokens


def test_stats_json(tiny_model, capsys):
    assert main(["data", "stats", KNOWN, "--model", tiny_model, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["count"], out["max"], out["total_tokens"]) == (20, 21, 230)
    assert out["cuts"][-1] == {"max_len": 32, "samples_over": 0, "tokens_cut": 0}


def test_bad_line_is_one_line_exit_2(tiny_model, tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": ""}\n')
    assert main(["data", "stats", str(path), "--model", tiny_model]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"lowmem-ft data: error: {path}:2: field 'text' is empty (or pass --skip-bad-lines)"
    assert main(["data", "stats", str(path), "--model", tiny_model, "--skip-bad-lines"]) == 0
    out = capsys.readouterr().out
    assert "skipped 1 bad lines:" in out and f"{path}:2: field 'text' is empty" in out


def test_stats_count_tokens_with_the_chat_template_asked_for(zoo_models, capsys):
    """--chat-template renders with that template (as data.chat_template makes train do): other token counts."""
    alpaca = os.path.join(os.path.dirname(__file__), "..", "data", "fixtures", "alpaca.jsonl")
    model = zoo_models["llama-zephyr"]
    assert main(["data", "stats", alpaca, "--model", model, "--json"]) == 0
    zephyr = json.loads(capsys.readouterr().out)["total_tokens"]
    assert main(["data", "stats", alpaca, "--model", model, "--json", "--chat-template", "llama2"]) == 0
    llama2 = json.loads(capsys.readouterr().out)["total_tokens"]
    assert zephyr != llama2 > 0
    assert main(["data", "stats", alpaca, "--model", model, "--chat-template", "nope"]) == 2
    assert "data.chat_template='nope' is neither a known template" in capsys.readouterr().err
