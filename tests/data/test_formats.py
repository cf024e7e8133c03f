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
        r":2: 'messages\[0\]\.content' must be a string or a list of text parts, got int",
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


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return str(path)


def test_turn_keys_no_format_reads_are_reported_not_dropped(tmp_path):
    """OpenAI's `name` on a user turn, a `loss` flag from another trainer: not read, so reported with the unused
    columns (as `messages[].KEY`); the keys that are read (weight, reasoning, tool fields) are not."""
    turns = [
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "assistant", "content": "yo", "loss": True, "weight": 1, "reasoning_content": "greet"},
        {"role": "tool", "content": "5", "name": "add", "tool_call_id": "c1"},
        {"role": "assistant", "content": "5."},
    ]
    data = load_file(_write(tmp_path / "d.jsonl", [{"messages": turns, "id": 1}]))
    assert data.unused_columns == ["id", "messages[].name", "messages[].loss"]
    assert data.records[0]["messages"][0] == {"role": "user", "content": "hi"}
    sharegpt = [{"from": "human", "value": "hi", "markdown": "x"}, {"from": "gpt", "value": "yo"}]
    data = load_file(_write(tmp_path / "s.jsonl", [{"conversations": sharegpt}]))
    assert data.unused_columns == ["conversations[].markdown"]


def test_openhermes_sharegpt_with_null_weights_reads(tmp_path):
    """teknium/OpenHermes-2.5 rows: every turn has `"weight": null` (unset), plus source columns."""
    row = {
        "conversations": [
            {"from": "system", "value": "Be brief.", "weight": None},
            {"from": "human", "value": "2 plus 2?", "weight": None},
            {"from": "gpt", "value": "4.", "weight": None},
        ],
        "source": "airoboros2.2",
    }
    data = load_file(_write(tmp_path / "d.jsonl", [row]))
    assert [m.get("weight", 1) for m in data.records[0]["messages"]] == [1, 1, 1]
    assert data.unused_columns == ["source"]


WEIGHT_LINES = {
    "half": (
        {"from": "gpt", "value": "a", "weight": 0.5},
        r"'conversations\[1\]\.weight' is 0\.5; a turn's weight is 0",
    ),
    "bool": ({"from": "gpt", "value": "a", "weight": True}, r"'conversations\[1\]\.weight' is True"),
    "user": ({"from": "human", "value": "q", "weight": 1}, r"'conversations\[1\]\.weight' is 1 on a user turn"),
}


@pytest.mark.parametrize("case", sorted(WEIGHT_LINES))
def test_a_weight_other_than_0_or_1_is_a_bad_line(tmp_path, case):
    turn, expected = WEIGHT_LINES[case]
    turns = [{"from": "human", "value": "q"}, turn, {"from": "gpt", "value": "b"}]
    with pytest.raises(UserError, match=r"d\.jsonl:1: " + expected):
        load_file(_write(tmp_path / "d.jsonl", [{"conversations": turns}]))


def test_axolotl_weights_are_kept_on_assistant_turns(tmp_path):
    turns = [
        {"from": "human", "value": "q1", "weight": 0},
        {"from": "gpt", "value": "a1", "weight": 0},
        {"from": "human", "value": "q2"},
        {"from": "gpt", "value": "a2", "weight": 1},
    ]
    (record,) = load_file(_write(tmp_path / "d.jsonl", [{"conversations": turns}])).records
    assert [m.get("weight") for m in record["messages"]] == [None, 0, None, None]
    turns[3]["weight"] = 0
    with pytest.raises(UserError, match=r"every assistant turn of 'conversations' has weight 0"):
        load_file(_write(tmp_path / "d.jsonl", [{"conversations": turns}]))


def test_reasoning_keys_are_kept_on_assistant_turns(tmp_path):
    turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "thinking": "because"}]
    (record,) = load_file(_write(tmp_path / "d.jsonl", [{"messages": turns}])).records
    assert record["messages"][1] == {"role": "assistant", "content": "a", "thinking": "because"}
    turns[1]["reasoning_content"] = "also"
    with pytest.raises(UserError, match=r"'messages\[1\]' has reasoning under both 'reasoning_content' and 'thinking'"):
        load_file(_write(tmp_path / "d.jsonl", [{"messages": turns}]))
    turns = [{"role": "user", "content": "q", "reasoning_content": "r"}, {"role": "assistant", "content": "a"}]
    with pytest.raises(UserError, match=r"'messages\[0\]\.reasoning_content' is reasoning on a user turn"):
        load_file(_write(tmp_path / "d.jsonl", [{"messages": turns}]))


def test_content_parts_from_a_parquet_export(tmp_path):
    """The transformers / OpenAI multimodal form as a Hub Parquet export holds it: Arrow gives every part every
    field (`image` null on a text part). Text parts are kept as parts; an image part is refused, naming it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def part(text=None, image=None):
        return {"type": "text" if text is not None else "image", "text": text, "image": image}

    text_only = {
        "messages": [
            {"role": "user", "content": [part("Spell"), part("red.")]},
            {"role": "assistant", "content": [part("R E D")]},
        ]
    }
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([text_only]), path)
    (record,) = load_file(path).records
    assert record["messages"][0]["content"] == [{"type": "text", "text": "Spell"}, {"type": "text", "text": "red."}]
    with_image = json.loads(json.dumps(text_only))
    with_image["messages"][0]["content"].insert(0, part(image="cat.png"))
    pq.write_table(pa.Table.from_pylist([text_only, with_image]), path)
    with pytest.raises(
        UserError, match=r"row 1: 'messages\[0\]\.content\[0\]' is an 'image' part; lowmem-ft trains"
    ) as e:
        load_file(path)
    assert "\n" not in str(e.value)


def test_trl_conversational_prompt_completion_is_read_as_chat(tmp_path):
    """trl-lib's conversational prompt/completion shape: both fields lists of turns."""
    row = {
        "prompt": [{"role": "user", "content": "What colour is the sky?"}],
        "completion": [{"role": "assistant", "content": "It is blue."}],
    }
    data = load_file(_write(tmp_path / "d.jsonl", [row]))
    assert data.format == "chat_prompt_completion" and data.unused_columns == []
    assert data.records[0] == {"messages": row["prompt"] + row["completion"], "completion_from": 1}
    with pytest.raises(UserError, match=r"d\.jsonl:1: 'prompt' / 'completion' hold lists of turns .*chat_prompt_compl"):
        load_file(tmp_path / "d.jsonl", fmt="prompt_completion")
    with pytest.raises(UserError, match=r"d\.jsonl:2: field 'prompt' is a string, where this data set's prompt/comp"):
        load_file(_write(tmp_path / "d.jsonl", [row, {"prompt": "q", "completion": "a"}]))
    no_answer = {"prompt": row["prompt"], "completion": [{"role": "user", "content": "more"}]}
    with pytest.raises(UserError, match=r"d\.jsonl:1: field 'completion' has no assistant turn"):
        load_file(_write(tmp_path / "d.jsonl", [no_answer]))


def test_llama_factory_alpaca_system_and_history(tmp_path):
    row = {
        "instruction": "And blue?",
        "input": "",
        "output": "B L U E",
        "system": "Spell words.",
        "history": [["Spell red.", "R E D"]],
    }
    data = load_file(_write(tmp_path / "d.jsonl", [row]))
    assert data.format == "alpaca" and data.unused_columns == []
    assert data.records[0]["messages"] == [
        {"role": "system", "content": "Spell words."},
        {"role": "user", "content": "Spell red."},
        {"role": "assistant", "content": "R E D"},
        {"role": "user", "content": "And blue?"},
        {"role": "assistant", "content": "B L U E"},
    ]
    row["history"] = [["Spell red."]]
    with pytest.raises(UserError, match=r"'history\[0\]' must be an \[instruction, answer\] pair of strings"):
        load_file(_write(tmp_path / "d.jsonl", [row]))


def test_sharegpt_system_column(tmp_path):
    """LLaMA-Factory's ShareGPT keeps the system prompt in a `system` column."""
    row = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}], "system": "Be brief."}
    (record,) = load_file(_write(tmp_path / "d.jsonl", [row])).records
    assert record["messages"][0] == {"role": "system", "content": "Be brief."}
    row["conversations"].insert(0, {"from": "system", "value": "Be long."})
    with pytest.raises(UserError, match=r"a 'system' field and a different system turn"):
        load_file(_write(tmp_path / "d.jsonl", [row]))


PREFERENCE = {
    "explicit prompt": (
        {"prompt": "2 plus 2?", "chosen": "4.", "rejected": "5."},
        "data.columns={completion: chosen}",
        {"completion": "chosen"},
        {"prompt": "2 plus 2?", "completion": "4."},
    ),
    "implicit prompt (trl-lib/hh-rlhf-helpful-base)": (
        {
            "chosen": [{"role": "user", "content": "2 plus 2?"}, {"role": "assistant", "content": "4."}],
            "rejected": [{"role": "user", "content": "2 plus 2?"}, {"role": "assistant", "content": "5."}],
        },
        "data.columns={messages: chosen}",
        {"messages": "chosen"},
        {"messages": [{"role": "user", "content": "2 plus 2?"}, {"role": "assistant", "content": "4."}]},
    ),
}


PREFERENCE["LLaMA-Factory ranking alpaca"] = (
    {"instruction": "2 plus 2?", "input": "", "chosen": "4.", "rejected": "5."},
    "data.columns={prompt: instruction, completion: chosen}",
    {"prompt": "instruction", "completion": "chosen"},
    {"prompt": "2 plus 2?", "completion": "4."},
)


@pytest.mark.parametrize("case", sorted(PREFERENCE))
def test_preference_data_is_refused_with_the_mapping_that_trains_on_chosen(tmp_path, case):
    from lowmem_ft.data.readers import read_records
    from lowmem_ft.data.sources import resolve_source

    row, hint, columns, record = PREFERENCE[case]
    path = _write(tmp_path / "d.jsonl", [row])
    with pytest.raises(
        UserError, match=r"d\.jsonl:1: this is preference data .* lowmem-ft trains SFT unless --method .* --method dpo"
    ) as info:
        load_file(path)
    message = str(info.value)
    assert hint in message and "\n" not in message and message.count(".columns") == 1
    data = read_records(resolve_source(path, columns=columns))  # the mapping the message gives works
    assert data.records == [record] and data.unused_columns[-1] == "rejected"


def test_llama_factory_ranking_sharegpt_says_to_append_the_chosen_turn(tmp_path):
    row = {
        "conversations": [{"from": "human", "value": "2 plus 2?"}],
        "chosen": {"from": "gpt", "value": "4."},
        "rejected": {"from": "gpt", "value": "5."},
    }
    with pytest.raises(UserError, match=r"preference data .* append each 'chosen' turn to its conversation in the d"):
        load_file(_write(tmp_path / "d.jsonl", [row]))


def test_kto_data_is_refused(tmp_path):
    row = {"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "assistant", "content": "a"}]}
    with pytest.raises(UserError, match=r"d\.jsonl:1: this is unpaired preference \(KTO\) data: 'label' marks"):
        load_file(_write(tmp_path / "d.jsonl", [{**row, "label": False}]))


def test_unknown_keys_still_say_what_is_expected(tmp_path):
    with pytest.raises(UserError, match=r"cannot tell the format from keys \['answer', 'question'\].*data\.columns"):
        load_file(_write(tmp_path / "d.jsonl", [{"question": "q", "answer": "a"}]))
