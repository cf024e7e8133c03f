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


TOOL_TURNS = [
    {"role": "user", "content": "2 plus 3?"},
    {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
    {"role": "tool", "content": "5", "name": "add", "tool_call_id": "c1"},
    {"role": "assistant", "content": "5."},
]


def test_tool_role_and_tool_calls_are_kept(tmp_path):
    path = tmp_path / "d.jsonl"
    schema = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    path.write_text(json.dumps({"messages": TOOL_TURNS, "tools": [schema]}) + "\n", encoding="utf-8")
    (record,) = load_file(path).records
    assert record["tools"] == [schema]
    call = record["messages"][1]
    assert call["content"] == "" and call["tool_calls"] == [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    ]
    assert record["messages"][2] == {"role": "tool", "content": "5", "name": "add", "tool_call_id": "c1"}


def test_sharegpt_function_call_and_observation(tmp_path):
    path = tmp_path / "d.jsonl"
    turns = [
        {"from": "human", "value": "2 plus 3?"},
        {"from": "function_call", "value": json.dumps({"name": "add", "arguments": {"a": 2}})},
        {"from": "observation", "value": "5"},
        {"from": "gpt", "value": "5."},
    ]
    path.write_text(json.dumps({"conversations": turns}) + "\n", encoding="utf-8")
    (record,) = load_file(path).records
    assert [m["role"] for m in record["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert record["messages"][1]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2}}


def test_tool_call_without_a_name_is_a_bad_line(tmp_path):
    path = tmp_path / "d.jsonl"
    turns = [TOOL_TURNS[0], {"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}]
    path.write_text(json.dumps({"messages": turns}) + "\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"d\.jsonl:1: 'messages\[1\]\.tool_calls\[0\]' needs a function name"):
        load_file(path)


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
        r":2: 'messages\[0\]\.role' is 'robot'; expected one of assistant, system, tool, user",
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


def test_turn_keys_of_the_other_chat_shape_are_read(tmp_path):
    """`conversations` holding role/content turns (lmsys-chat-1m, many Hub exports) and `messages` holding
    from/value turns are read by their turns' own keys, each with its own role names."""
    path = tmp_path / "d.jsonl"
    rows = [
        {"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
        {"messages": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
    ]
    for row in rows:
        path.write_text(json.dumps(row) + "\n", encoding="utf-8")
        (record,) = load_file(path).records
        assert record["messages"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    path.write_text(json.dumps({"conversations": [{"speaker": "user", "text": "hi"}]}) + "\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"d\.jsonl:1: missing field 'conversations\[0\]\.from'"):
        load_file(path)
