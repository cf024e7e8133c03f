"""Reading JSONL: format detection and one clear `file:line` error per kind of bad input."""

from __future__ import annotations

import json

import pytest

from lowmem_ft.data.readers import load_file
from lowmem_ft.errors import UserError
from tests.data.conftest import FORMAT_FILES, fixture

GOOD = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})


@pytest.mark.parametrize("fmt", sorted(FORMAT_FILES))
def test_each_format_is_detected(fmt):
    data = load_file(fixture(FORMAT_FILES[fmt]))
    assert data.format == fmt
    assert data.records and not data.skipped
    if fmt in ("messages", "sharegpt", "alpaca"):
        assert all({m["role"] for m in r["messages"]} <= {"system", "user", "assistant"} for r in data.records)


def test_forced_format_applies_to_every_line():
    with pytest.raises(UserError, match=r"text.jsonl:1: missing field 'prompt'"):
        load_file(fixture("text.jsonl"), fmt="prompt_completion")


BAD_LINES = {
    "invalid JSON": ('{"messages": [', r":2: invalid JSON"),
    "missing field": ('{"messages": [{"role": "user"}]}', r":2: missing field 'messages\[0\]\.content'"),
    "empty field": (
        '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]}',
        r":2: field 'messages\[1\]\.content' is empty",
    ),
    "unknown role": (
        '{"messages": [{"role": "robot", "content": "q"}, {"role": "assistant", "content": "a"}]}',
        r":2: 'messages\[0\]\.role' is 'robot'; expected one of assistant, system, user",
    ),
    "wrong type": ('{"messages": "hello"}', r":2: field 'messages' must be a list of turns, got str"),
    "wrong content type": (
        '{"messages": [{"role": "user", "content": 7}, {"role": "assistant", "content": "a"}]}',
        r":2: 'messages\[0\]\.content' must be a string, got int",
    ),
    "no assistant": ('{"messages": [{"role": "user", "content": "q"}]}', r":2: field 'messages' has no assistant"),
    "not an object": ("[1, 2]", r":2: each line must be a JSON object, got list"),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_line_names_file_line_and_field(tmp_path, case):
    line, expected = BAD_LINES[case]
    path = tmp_path / "d.jsonl"
    path.write_text(f"{GOOD}\n{line}\n{GOOD}\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"d\.jsonl" + expected) as info:
        load_file(path)
    assert "\n" not in str(info.value)
    data = load_file(path, skip_bad_lines=True)
    assert len(data.records) == 2
    assert len(data.skipped) == 1 and data.skipped[0].startswith(f"{path}:2: ")


def test_non_utf8_bytes(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(GOOD.encode() + b"\n" + b'{"text": "caf\xe9"}\n')
    with pytest.raises(UserError, match=r"d\.jsonl:2: not UTF-8 \(byte 13\)"):
        load_file(path)


def test_empty_file(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"")
    with pytest.raises(UserError, match=r"d\.jsonl:1: the file is empty"):
        load_file(path)


def test_only_bad_lines_is_an_error_even_when_skipping(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("{oops\n\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"no usable records \(1 bad lines skipped\)"):
        load_file(path, skip_bad_lines=True)
