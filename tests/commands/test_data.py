"""`lowmem-ft data stats`: the profile printed for a file with known token lengths, and one-line errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

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


def test_stats_takes_data_as_train_spells_it(tiny_model, capsys):
    """`--data SOURCE` (train's flag) is SOURCE; two different sources are one line, exit 2."""
    assert main(["data", "stats", "--data", KNOWN, "--model", tiny_model, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["count"] == 20
    assert main(["data", "stats", KNOWN, "--data", "other.jsonl", "--model", tiny_model]) == 2
    assert "two data sources given" in capsys.readouterr().err


def test_bad_line_is_one_line_exit_2(tiny_model, tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": ""}\n')
    assert main(["data", "stats", str(path), "--model", tiny_model]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"lowmem-ft data: error: {path}:2: field 'text' is empty (or pass --skip-bad-lines)"
    assert main(["data", "stats", str(path), "--model", tiny_model, "--skip-bad-lines"]) == 0
    out = capsys.readouterr().out
    assert "skipped 1 bad lines:" in out and f"{path}:2: field 'text' is empty" in out


def _one_line_error(capsys, code: int) -> str:
    err = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def _qa_parquet(path) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"id": i, "question": f"What is {i} plus 1?", "answer": f" {i + 1}."} for i in range(4)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_stats_of_parquet_with_its_own_columns(tiny_model, tmp_path, capsys):
    path = _qa_parquet(tmp_path / "qa.parquet")
    argv = [
        "data",
        "stats",
        path,
        "--model",
        tiny_model,
        "--column",
        "prompt=question",
        "--column",
        "completion=answer",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{path}: 4 samples, format prompt_completion, ")
    assert f"{path}: columns not used: id" in out
    assert main(["data", "stats", path, "--model", tiny_model, "--column", "prompt"]) == 2
    assert "--column 'prompt': expected OURS=THEIRS" in capsys.readouterr().err


def test_stats_of_a_directory_split_and_a_saved_dataset(tiny_model, tmp_path, capsys):
    from datasets import Dataset, DatasetDict

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "train.jsonl").write_text(Path(KNOWN).read_text())
    (tmp_path / "d" / "test.jsonl").write_text('{"text": "the owl"}\n')
    (tmp_path / "d" / "train-notes.txt").write_text("not data")
    assert main(["data", "stats", str(tmp_path / "d"), "--model", tiny_model]) == 0
    out = capsys.readouterr().out
    assert "20 samples, format text, 230 tokens" in out
    assert f"{tmp_path / 'd'}: not data files, not read: {tmp_path / 'd' / 'train-notes.txt'}" in out
    assert main(["data", "stats", str(tmp_path / "d"), "--model", tiny_model, "--split", "test", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["count"] == 1 and out["sources"][0]["kind"] == "dir" and out["sources"][0]["split"] == "test"
    rows = [json.loads(line) for line in Path(KNOWN).read_text().splitlines()]
    DatasetDict({"train": Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saved"))
    assert main(["data", "stats", str(tmp_path / "saved"), "--model", tiny_model]) == 0
    assert "20 samples, format text, 230 tokens" in capsys.readouterr().out


def test_stats_of_a_mix_prints_what_each_source_gave(tiny_model, tmp_path, capsys):
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"text": f"the cat {i}"}) + "\n" for i in range(5)))
    mix = f"data.mix=[{{path: {KNOWN}, weight: 3}}, {{path: {other}, weight: 1}}]"
    assert main(["data", "stats", "--model", tiny_model, "--set", mix]) == 0
    out = capsys.readouterr().out
    assert out.startswith("the mix: 20 samples, format text, ")  # 15 of 20 + all 5: 3 to 1
    assert f"mix (undersample, seed 42, in the mix): {KNOWN} 15 (75 %), {other} 5 (25 %)" in out


def test_stats_of_a_stream_says_it_profiled_the_first_samples(tiny_model, capsys, monkeypatch):
    import lowmem_ft.data.tokenize as tk

    monkeypatch.setattr(tk, "STREAM_HEAD", 8)
    assert main(["data", "stats", KNOWN, "--model", tiny_model, "--streaming"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{KNOWN}: the first 8 samples of the stream, format text, ")


def test_a_hub_id_without_network_is_one_line(tiny_model, capsys):
    err = _one_line_error(capsys, main(["data", "stats", "someorg/some-data", "--model", tiny_model]))
    assert "data someorg/some-data is not a local path, so it is read as a Hugging Face Hub data set id" in err
    assert "the Hub is unreachable (offline mode is on, HF_HUB_OFFLINE=1)" in err


def test_an_empty_directory_names_what_was_looked_for(tiny_model, tmp_path, capsys):
    err = _one_line_error(capsys, main(["data", "stats", str(tmp_path), "--model", tiny_model]))
    assert f"{tmp_path} holds no data files (.jsonl, .json, .parquet, .csv, .tsv, .arrow)" in err


def test_a_very_long_line_is_profiled_truthfully(tiny_model, tmp_path, capsys):
    """One ~1 MB sample (issue #16 saw the planner pick max_seq_len 984272 for a 5 MB one): the profile reports its
    true token count, as the tokenizer counts it, and nothing fails."""
    from lowmem_ft.data.tokenize import load_tokenizer

    words = ["the", "cat", "dog", "red", "blue", "owl", "fox", "bee"]
    text = " ".join(words[i * 7 % 8] for i in range(200_000))
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"text": "a short one"}) + "\n" + json.dumps({"text": text}) + "\n")
    tokenizer = load_tokenizer(tiny_model)
    expected = len(tokenizer(text + tokenizer.eos_token)["input_ids"])
    assert expected > 100_000
    assert main(["data", "stats", str(path), "--model", tiny_model, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["count"] == 2 and out["max"] == expected
    assert out["cuts"][-1]["max_len"] >= expected and out["cuts"][-1]["samples_over"] == 0


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


PAIRS = "tests/data/fixtures/preference/pairs_chat.jsonl"
KTO = "tests/data/fixtures/preference/kto_chat.jsonl"
PROMPTS = "tests/data/fixtures/grpo/gsm8k_mini.jsonl"


@pytest.mark.parametrize(
    ("source", "method", "extra", "unit"),
    [(PAIRS, "dpo", [], "pair"), (PAIRS, "simpo", [], "pair"), (KTO, "kto", [], "completion"),
     (PROMPTS, "grpo", ["--column", "prompt=question"], "prompt")],
)  # fmt: skip
def test_stats_profiles_preference_and_grpo_data(tiny_model, capsys, source, method, extra, unit):
    """Issue 32: preference data could not be profiled, and the refusal advised `--method dpo`, which `data stats`
    did not take. Now the advice works, and the profile is the one `train --method M --vram` sizes lengths from."""
    from lowmem_ft.data.prepare import length_profile
    from lowmem_ft.recipe.load import resolve

    assert main(["data", "stats", source, "--model", tiny_model, *extra]) == 2  # as SFT data: refused...
    if method != "grpo":
        assert f"--method {'kto' if method == 'kto' else 'dpo'}" in capsys.readouterr().err  # ...saying what works
    capsys.readouterr()
    assert main(["data", "stats", source, "--model", tiny_model, "--method", method, "--json", *extra]) == 0
    out = json.loads(capsys.readouterr().out)
    columns = {"columns": {"prompt": "question"}} if extra else {}
    recipe = resolve(None, {"model": {"name_or_path": tiny_model}, "training": {"method": method},
                            "data": {"path": source, **columns}})  # fmt: skip
    expected = length_profile(recipe)
    assert out["method"] == method and out["measured"].startswith(unit)
    assert (out["count"], out["max"], out["p99"]) == (expected.count, expected.max, expected.p99)
    assert main(["data", "stats", source, "--model", tiny_model, "--method", method, *extra]) == 0
    assert f" {unit}s for --method {method}" in capsys.readouterr().out
