"""Tokenization: labels mask prompts as TRL would, ChatML without a template, and the content-keyed cache."""

from __future__ import annotations

import logging
import os
import shutil

import pytest

from lowmem_ft.data import tokenize as tk
from lowmem_ft.data.readers import load_file
from tests.data.conftest import FORMAT_FILES, fixture


def trl_prepare(records, tokenizer, tmp_path, *, completion_only: bool, assistant_only: bool):
    """TRL's own preprocessing (SFTTrainer._prepare_dataset) of the same records, without building a trainer."""
    from types import SimpleNamespace

    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(
        output_dir=str(tmp_path / "trl"),
        max_length=None,
        assistant_only_loss=assistant_only,
        completion_only_loss=completion_only,
        report_to=[],
        use_cpu=True,
    )
    owner = SimpleNamespace(_tokenizer=tokenizer, chat_template=None, completion_only_loss=completion_only)
    return SFTTrainer._prepare_dataset(owner, Dataset.from_list(records), tokenizer, args, False, None, "train")


@pytest.mark.parametrize("fmt", sorted(FORMAT_FILES))
@pytest.mark.parametrize("train_on_prompt", [False, True])
def test_labels_match_trl_preprocessing(fmt, train_on_prompt, tokenizer, tmp_path):
    records = load_file(fixture(FORMAT_FILES[fmt])).records
    ours = tk.tokenize_records(records, fmt, tokenizer, train_on_prompt)
    chat = fmt in ("messages", "sharegpt", "alpaca")
    theirs = trl_prepare(
        records,
        tokenizer,
        tmp_path,
        completion_only=fmt == "prompt_completion" and not train_on_prompt,
        assistant_only=chat and not train_on_prompt,
    )
    assert ours["input_ids"] == theirs["input_ids"]
    assert ours["labels"] == theirs["labels"]


def test_prompt_tokens_have_label_minus_100(tokenizer):
    records = [{"prompt": "What is 2 plus 3?", "completion": " 2 plus 3 is 5."}]
    row = tk.tokenize_records(records, "prompt_completion", tokenizer, train_on_prompt=False)[0]
    n_prompt = len(tokenizer("What is 2 plus 3?")["input_ids"])
    assert row["labels"][:n_prompt] == [-100] * n_prompt
    assert row["labels"][n_prompt:] == row["input_ids"][n_prompt:]
    assert tokenizer.decode(row["input_ids"][n_prompt:]) == " 2 plus 3 is 5.<|im_end|>"


def test_chat_loss_only_on_assistant_turns(tokenizer):
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Spell red."},
        {"role": "assistant", "content": "R E D."},
        {"role": "user", "content": "And blue?"},
        {"role": "assistant", "content": "B L U E."},
    ]
    row = tk.tokenize_records([{"messages": msgs}], "messages", tokenizer, train_on_prompt=False)[0]
    trained = [t for t in row["labels"] if t != -100]
    assert tokenizer.decode(trained) == "R E D.<|im_end|>B L U E.<|im_end|>"
    assert row["labels"][0] == -100


def test_tokenizer_without_template_gets_chatml(tokenizer):
    tokenizer.chat_template = None
    from lowmem_ft.data.chat import chat_template_for, set_template

    template = chat_template_for(tokenizer, False, set_template(tokenizer, None))
    assert template.source.startswith("ChatML (default)") and template.masking == "markers"  # ChatML has markers
    assert set_template(tokenizer, None) == "ChatML (default)"  # a second source, the eval file: still the default
    row = tk.tokenize_records(load_file(fixture("alpaca.jsonl")).records[:1], "alpaca", tokenizer, False)[0]
    assert tokenizer.decode(row["input_ids"]).startswith("<|im_start|>user\nSpell the word.<|im_end|>")


def test_template_without_markers_unknown_to_trl_is_masked_turn_by_turn(tokenizer):
    """The issue's user: a plain Jinja loop TRL does not know trains on the assistant turns, not an error."""
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    row = tk.tokenize_records(load_file(fixture("alpaca.jsonl")).records[:1], "alpaca", tokenizer, False)[0]
    trained = [t for t in row["labels"] if t != -100]
    assert tokenizer.decode(trained) == "assistant: R E D"  # no generation prompt: the role tag is generated too
    everything = tk.tokenize_records(load_file(fixture("alpaca.jsonl")).records[:1], "alpaca", tokenizer, True)[0]
    assert everything["labels"] == everything["input_ids"]


def test_second_run_loads_from_cache(tokenizer, tmp_path, monkeypatch):
    data = tmp_path / "d.jsonl"
    shutil.copy(fixture("messages.jsonl"), data)
    first = tk.tokenize_file(data, tokenizer)
    assert not first.from_cache

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(tk, "tokenize_records", no_tokenizing)
    second = tk.tokenize_file(data, tokenizer)
    assert second.from_cache and second.format == "messages"
    assert second.dataset["input_ids"] == first.dataset["input_ids"]
    assert second.dataset["labels"] == first.dataset["labels"]
    # Different content or different masking → a different key, so tokenized again.
    with pytest.raises(AssertionError, match="tokenized again"):
        tk.tokenize_file(data, tokenizer, train_on_prompt=True)
    data.write_text(data.read_text() + data.read_text().splitlines()[0] + "\n")
    with pytest.raises(AssertionError, match="tokenized again"):
        tk.tokenize_file(data, tokenizer)


def test_a_dated_template_renders_the_same_tokens_on_any_day(zoo_models, tmp_path, monkeypatch):
    """Llama 3.2's template puts `strftime_now` (today) in every system header: the cache held the day it was made,
    a fresh tokenization another day's. Training renders chat.TEMPLATE_DATE, so both agree."""
    from datetime import datetime

    import transformers.utils.chat_template_utils as ctu

    data = tmp_path / "d.jsonl"
    shutil.copy(fixture("messages.jsonl"), data)
    first = tk.tokenize_file(data, tk.load_tokenizer(zoo_models["llama3"]))
    tokenizer = tk.load_tokenizer(zoo_models["llama3"])
    assert "Today Date: 26 Jul 2024\n" in tokenizer.decode(first.dataset[0]["input_ids"])

    class OtherDay(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime(2031, 1, 2)

    monkeypatch.setattr(ctu, "datetime", OtherDay)  # what the template's strftime_now reads
    probe = [{"role": "user", "content": "Hi."}]
    assert "Today Date: 02 Jan 2031" in tokenizer.apply_chat_template(probe, tokenize=False)  # inference: the day's
    fresh = tk.tokenize_file(data, tokenizer, use_cache=False)
    cached = tk.tokenize_file(data, tokenizer)
    assert cached.from_cache and not fresh.from_cache
    assert fresh.dataset["input_ids"] == cached.dataset["input_ids"] == first.dataset["input_ids"]
    assert fresh.dataset["labels"] == cached.dataset["labels"]


def test_split_conversations_are_said_when_loaded_from_the_cache_too(zoo_models, tmp_path, caplog):
    """A template that rewrites earlier turns (the Qwen3 fine-tune's drops their reasoning) trains each assistant turn
    as its own sample: the warning saying so comes with every command that trains the data, cached or not."""
    import json

    from lowmem_ft import console

    tokenizer = tk.load_tokenizer(zoo_models["qwen3-finetune"])
    messages = [
        {"role": "user", "content": "What is 2 plus 3?"},
        {"role": "assistant", "content": "<think>two and three</think>2 plus 3 is 5."},
        {"role": "user", "content": "And the colour?"},
        {"role": "assistant", "content": "<think>any</think>red."},
    ]
    data = tmp_path / "reasoning.jsonl"
    data.write_text(json.dumps({"messages": messages}) + "\n", encoding="utf-8")
    for cached in (False, True):
        console._SAID.clear()  # a new command
        caplog.clear()
        with caplog.at_level("WARNING", logger="lowmem_ft.data.tokenize"):
            result = tk.tokenize_file(data, tokenizer)
        assert result.from_cache is cached and result.split_conversations == 1
        assert "1 conversations trained as one sample per assistant turn" in caplog.text


def _arrow(entry):
    (arrow,) = (entry / "dataset").glob("*.arrow")
    return arrow


def _flip(path):
    raw = bytearray(path.read_bytes())
    raw[len(raw) * 3 // 4] ^= 0xFF
    path.write_bytes(bytes(raw))


DAMAGES = {
    "arrow-truncated": lambda e: os.truncate(_arrow(e), _arrow(e).stat().st_size // 2),
    "arrow-byte-flipped": lambda e: _flip(_arrow(e)),
    "arrow-empty": lambda e: _arrow(e).write_bytes(b""),
    "meta-truncated": lambda e: (e / "meta.json").write_text((e / "meta.json").read_text()[:20]),
    "meta-a-list": lambda e: (e / "meta.json").write_text("[1, 2]"),
    "state-missing": lambda e: (e / "dataset" / "state.json").unlink(),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_cache_entry_is_rebuilt_not_trusted(tokenizer, tmp_path, caplog, damage):
    """Issue #24: a cache entry cut short or with changed bytes (a crash, a bad disk) is tokenized again, with one
    warning, never read as data: an arrow file with flipped bytes used to load as valid token ids."""
    data = tmp_path / "d.jsonl"
    shutil.copy(fixture("messages.jsonl"), data)
    first = tk.tokenize_file(data, tokenizer)
    entry, want = first.cache_dir, (list(first.dataset["input_ids"]), list(first.dataset["labels"]))
    del first  # its dataset maps the entry's file: damaged below
    DAMAGES[damage](entry)
    with caplog.at_level(logging.WARNING):
        again = tk.tokenize_file(data, tokenizer)
    assert not again.from_cache
    assert (list(again.dataset["input_ids"]), list(again.dataset["labels"])) == want
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert line.startswith(f"tokenization cache entry {entry} is damaged (") and "tokenizing again" in line
    assert tk.tokenize_file(data, tokenizer).from_cache  # the rebuilt entry is whole


def test_files_a_later_map_adds_beside_an_entry_do_not_damage_it(tokenizer, tmp_path):
    """datasets writes the cache-*.arrow files of maps over a loaded dataset beside its source files (training's
    budget and TRL's preparation do): the entry is still whole."""
    data = tmp_path / "d.jsonl"
    shutil.copy(fixture("messages.jsonl"), data)
    first = tk.tokenize_file(data, tokenizer)
    first.dataset.map(lambda row: {"n": len(row["input_ids"])})  # writes cache-*.arrow into the entry
    assert list((first.cache_dir / "dataset").glob("cache-*.arrow"))
    assert tk.tokenize_file(data, tokenizer).from_cache
