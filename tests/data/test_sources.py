"""Resolving `--data` / `data.*` into sources without reading them: kinds, splits, Hub ids, and one-line errors."""

from __future__ import annotations

import pytest

from lowmem_ft.data.sources import check_source, eval_source_of, looks_like_hub_id, resolve_source, sources_of
from lowmem_ft.errors import ConfigError, UserError
from lowmem_ft.recipe.load import resolve
from tests.data.conftest import fixture


def recipe(*sets):
    return resolve(None, list(sets))


@pytest.mark.parametrize(
    "suffix, kind", [(".jsonl", "jsonl"), (".JSON", "json"), (".parquet", "parquet"), (".tsv", "tsv")]
)
def test_a_file_is_its_suffix(tmp_path, suffix, kind):
    path = tmp_path / f"d{suffix}"
    path.write_text("x")
    source = resolve_source(str(path))
    assert (source.kind, source.files, source.split) == (kind, (str(path),), "train")


def test_unsupported_file_and_split_of_a_single_file(tmp_path):
    path = tmp_path / "d.txt"
    path.write_text("x")
    with pytest.raises(UserError, match=r"d\.txt: unsupported file type '\.txt'; data files are \.jsonl"):
        resolve_source(str(path))
    with pytest.raises(UserError, match=r"data\.split='test': .*text\.jsonl is one file, which is the whole 'train'"):
        resolve_source(fixture("text.jsonl"), split="test")
    with pytest.raises(UserError, match=r"data\.subset names a configuration of a Hub data set"):
        resolve_source(fixture("text.jsonl"), subset="en")


def test_hub_ids_and_missing_local_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    assert looks_like_hub_id("tatsu-lab/alpaca") and looks_like_hub_id("HuggingFaceH4/ultrachat_200k")
    assert not looks_like_hub_id("alpaca")  # not org/name
    assert not looks_like_hub_id("org/data.jsonl")  # a data file's name: a missing local file
    assert not looks_like_hub_id("data/train")  # data/ is a local folder
    assert not looks_like_hub_id("./org/name") and not looks_like_hub_id("/abs/name")
    hub = resolve_source("tatsu-lab/alpaca", split="train[:100]", subset="default")
    assert (hub.kind, hub.label) == ("hub", "tatsu-lab/alpaca [default/train[:100]]")
    for missing in ("data/train", "org/data.jsonl", "alpaca"):
        with pytest.raises(UserError, match=f"data {missing} does not exist; pass --data a data file"):
            resolve_source(missing)


def test_a_fifo_is_not_a_data_file(tmp_path):
    import os

    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(UserError, match=r"pipe\.jsonl is not a regular file"):
        resolve_source(str(fifo))


def test_directory_of_files_is_split_by_file_names_as_load_dataset_does(tmp_path):
    for name in ("train-0.jsonl", "train-1.parquet", "test.csv", "README.md"):
        (tmp_path / name).write_text("x")
    train = resolve_source(str(tmp_path))
    assert train.kind == "dir"
    assert [p.rsplit("/", 1)[1] for p in train.files] == ["train-0.jsonl", "train-1.parquet"]
    test = resolve_source(str(tmp_path), split="test")
    assert [p.rsplit("/", 1)[1] for p in test.files] == ["test.csv"] and test.label == f"{tmp_path} [test]"
    with pytest.raises(UserError, match=r"data\.split='validation': .* has the splits train, test"):
        resolve_source(str(tmp_path), split="validation")


def test_directory_without_split_names_is_all_train_and_reports_other_files(tmp_path):
    for name in ("a.jsonl", "b.jsonl", "notes.txt"):
        (tmp_path / name).write_text("x")
    source = resolve_source(str(tmp_path))
    assert len(source.files) == 2 and [p.rsplit("/", 1)[1] for p in source.ignored] == ["notes.txt"]
    assert source.to_dict()["ignored"] == list(source.ignored)


@pytest.mark.parametrize("content", [[], ["notes.txt"]])
def test_empty_or_unusable_directory_names_what_was_looked_for(tmp_path, content):
    for name in content:
        (tmp_path / name).write_text("x")
    with pytest.raises(UserError) as info:
        resolve_source(str(tmp_path))
    msg = str(info.value)
    assert "holds no data files (.jsonl, .json, .parquet, .csv, .tsv, .arrow)" in msg
    assert "not a save_to_disk data set (no dataset_dict.json or state.json)" in msg and "\n" not in msg


def test_saved_dataset_and_dataset_dict(tmp_path):
    from datasets import Dataset, DatasetDict

    one = Dataset.from_dict({"text": ["a", "b"]})
    one.save_to_disk(str(tmp_path / "one"))
    DatasetDict({"train": one, "test": one}).save_to_disk(str(tmp_path / "dict"))
    assert resolve_source(str(tmp_path / "one")).kind == "saved"
    with pytest.raises(UserError, match=r"is one saved split \(a Dataset, not a DatasetDict\)"):
        resolve_source(str(tmp_path / "one"), split="test")
    assert resolve_source(str(tmp_path / "dict"), split="test").label == f"{tmp_path / 'dict'} [test]"
    with pytest.raises(UserError, match=r"data\.split='dev': the saved data set .* has the splits train, test"):
        resolve_source(str(tmp_path / "dict"), split="dev")


def test_columns_must_name_our_fields():
    with pytest.raises(UserError, match=r"data\.columns maps 'question', which no format reads; map our field names"):
        resolve_source(fixture("text.jsonl"), columns={"question": "prompt"})
    source = resolve_source(fixture("text.jsonl"), columns={"text": "body"})
    assert source.column_map == {"text": "body"}


def test_sources_of_path_or_mix():
    with pytest.raises(UserError, match=r"no training data given; pass --data"):
        sources_of(recipe())
    text = fixture("text.jsonl")
    with pytest.raises(UserError, match=r"data\.path .* and data\.mix are both set"):
        sources_of(recipe(f"data.path={text}", f"data.mix=[{{path: {text}}}]"))
    mix = sources_of(
        recipe(
            "data.format=text",
            f"data.mix=[{{path: {text}, weight: 3}}, {{path: {fixture('alpaca.jsonl')}, format: alpaca}}]",
        )
    )
    assert [(s.weight, s.format, s.key) for s in mix] == [(3, "text", "data.mix[0]"), (1.0, "alpaca", "data.mix[1]")]


def test_every_mix_entry_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        sources_of(recipe("data.mix=[{path: a.jsonl, wieght: 2}, {weight: -1}, {path: b.csv, format: csv}]"))
    msg = str(info.value)
    assert msg.startswith("data.mix: 4 problems:")
    for part in (
        "data.mix[0]: unknown key 'wieght'",
        "data.mix[1].path must name a data set",
        "data.mix[1].weight must be a positive number, got -1",
        "data.mix[2].format must be one of",
    ):
        assert part in msg


def test_streaming_needs_max_steps_and_no_eval_fraction():
    text = fixture("text.jsonl")
    with pytest.raises(UserError, match=r"data\.streaming: .* set training\.max_steps"):
        check_source(recipe(f"data.path={text}", "data.streaming=true"))
    with pytest.raises(UserError, match=r"data\.eval_fraction holds out part of the data"):
        check_source(
            recipe(f"data.path={text}", "data.streaming=true", "training.max_steps=5", "data.eval_fraction=0.1")
        )
    assert check_source(recipe(f"data.path={text}", "data.streaming=true", "training.max_steps=5"))[0].streaming


def test_eval_fraction_and_an_eval_source_are_not_both_taken():
    text = fixture("text.jsonl")
    with pytest.raises(UserError, match=r"data\.eval_fraction=0\.1 and data\.eval_path both name evaluation data"):
        check_source(recipe(f"data.path={text}", f"data.eval_path={text}", "data.eval_fraction=0.1"))


def test_eval_source(tmp_path):
    text = fixture("text.jsonl")
    assert eval_source_of(recipe(f"data.path={text}")) is None
    ev = eval_source_of(recipe(f"data.path={text}", f"data.eval_path={fixture('alpaca.jsonl')}"))
    assert ev.path.endswith("alpaca.jsonl") and not ev.streaming
    (tmp_path / "train.jsonl").write_text("x")
    (tmp_path / "test.jsonl").write_text("x")
    ev = eval_source_of(recipe(f"data.path={tmp_path}", "data.eval_split=test"))
    assert ev.files == (str(tmp_path / "test.jsonl"),)
    with pytest.raises(UserError, match=r"data\.eval_split='dev': .* has the splits train, test"):
        eval_source_of(recipe(f"data.path={tmp_path}", "data.eval_split=dev"))
    with pytest.raises(UserError, match=r"with data\.mix name the evaluation data set in data\.eval_path"):
        eval_source_of(recipe(f"data.mix=[{{path: {text}}}]", "data.eval_split=test"))


def test_recipe_type_checks_for_the_new_keys():
    with pytest.raises(ConfigError, match=r"'data\.columns' must be a mapping"):
        recipe("data.columns=[prompt]")
    with pytest.raises(ConfigError, match=r"'data\.columns' must map str to str"):
        recipe("data.columns={prompt: [a, b]}")
    with pytest.raises(ConfigError, match=r"'data\.mix' must be a list of dict"):
        recipe("data.mix=a.jsonl")
    with pytest.raises(ConfigError, match=r"'data\.mix_strategy' must be one of undersample, oversample"):
        recipe("data.mix_strategy=sometimes")
    assert recipe("data.columns={prompt: question, completion: 7}").data.columns == {
        "prompt": "question",
        "completion": "7",
    }
