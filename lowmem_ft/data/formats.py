"""Training records in the common shapes, validated and turned into the records TRL's SFTTrainer takes.

Each data set is one format (auto-detected from its first record, or forced with `data.format`):
text → {"text"}; prompt/completion → {"prompt", "completion"}; messages / ShareGPT conversations / alpaca →
{"messages"} (chat data goes through the tokenizer's chat template). Chat turns may be tool results (`tool` role;
ShareGPT `observation`) and assistant turns may carry `tool_calls` (ShareGPT `function_call`); a record's `tools`
(function schemas) go to the template too. `convert` is the one place a record is validated: a bad record is a
`BadLine` naming the field, which the reader (`lowmem_ft.data.readers`) turns into a `UserError` naming `file:line`
(or the row); with skip_bad_lines it is skipped and reported instead. Nothing is dropped silently.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

FORMATS = ("auto", "text", "prompt_completion", "messages", "sharegpt", "alpaca")
CHAT_FORMATS = ("messages", "sharegpt", "alpaca")  # go through the chat template
ROLES = {"system", "user", "assistant", "tool"}
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "function_call": "assistant",  # LLaMA-Factory's ShareGPT: the value is the JSON tool call(s)
    "observation": "tool",
    "tool": "tool",
}


class BadLine(ValueError):
    """One malformed record: the message names the field."""


@dataclass
class LoadedData:
    records: list[dict[str, Any]]
    format: str
    skipped: list[str] = field(default_factory=list)  # "file:line: why" for each skipped line
    unused_columns: list[str] = field(default_factory=list)  # columns of the data that the format does not read


def detect_format(record: dict[str, Any]) -> str:
    if "messages" in record:
        return "messages"
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record and "output" in record:
        return "alpaca"
    if "prompt" in record and "completion" in record:
        return "prompt_completion"
    if "text" in record:
        return "text"
    raise BadLine(
        f"cannot tell the format from keys {sorted(record)}; expected 'text', 'prompt'+'completion', "
        "'messages', 'conversations' or 'instruction'+'output' (or set --format)"
    )


def _string(record: dict, key: str, allow_empty: bool = False) -> str:
    if key not in record:
        raise BadLine(f"missing field '{key}'")
    value = record[key]
    if not isinstance(value, str):
        raise BadLine(f"field '{key}' must be a string, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise BadLine(f"field '{key}' is empty")
    return value


def _tool_calls(value: Any, where: str) -> list[dict]:
    """Assistant tool calls in the OpenAI / transformers form: [{"type": "function", "function": {"name", "arguments"}}]."""
    calls = value if isinstance(value, list) else [value]
    out = []
    for k, call in enumerate(calls):
        at = f"{where}[{k}]"
        if not isinstance(call, dict):
            raise BadLine(f"'{at}' must be an object, got {type(call).__name__}")
        function = call.get("function", call)  # {"name", "arguments"} alone is accepted too
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise BadLine(f'\'{at}\' needs a function name ("function": {{"name": ..., "arguments": ...}})')
        arguments = function.get("arguments", {})
        if not isinstance(arguments, dict | str):
            raise BadLine(f"'{at}.arguments' must be an object or a JSON string, got {type(arguments).__name__}")
        arguments = _arguments_object(arguments)
        entry = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def _arguments_object(arguments: dict | str) -> dict | str:
    """A call's arguments as the object transformers' templates expect: OpenAI's format gives them as a JSON
    string, which templates that write `arguments | tojson` (Qwen2.5, Llama 3) would render as a quoted, escaped
    string — the model would learn to call tools that way. A string that is not a JSON object is kept as given."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return arguments


def _turn(turn: Any, where: str, role_key: str, content_key: str, roles: dict[str, str]) -> dict:
    if not isinstance(turn, dict):
        raise BadLine(f"'{where}' must be an object, got {type(turn).__name__}")
    if role_key not in turn:
        raise BadLine(f"missing field '{where}.{role_key}'")
    raw_role = turn[role_key]
    if not isinstance(raw_role, str) or raw_role not in roles:
        raise BadLine(f"'{where}.{role_key}' is {raw_role!r}; expected one of {', '.join(sorted(roles))}")
    role = roles[raw_role]
    if raw_role == "function_call":  # ShareGPT: the value is the call itself
        try:
            calls = json.loads(turn.get(content_key, ""))
        except (TypeError, json.JSONDecodeError):
            raise BadLine(f"'{where}.{content_key}' of a function_call turn must be a JSON tool call") from None
        return {"role": role, "content": "", "tool_calls": _tool_calls(calls, f"{where}.{content_key}")}
    calls = turn.get("tool_calls") if role == "assistant" else None
    if content_key not in turn and not calls:
        raise BadLine(f"missing field '{where}.{content_key}'")
    content = turn.get(content_key) or ("" if calls else turn.get(content_key))
    if not isinstance(content, str):
        raise BadLine(f"'{where}.{content_key}' must be a string, got {type(content).__name__}")
    if not content.strip() and not calls:
        raise BadLine(f"field '{where}.{content_key}' is empty")
    out: dict[str, Any] = {"role": role, "content": content}
    if calls:
        out["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
    if role == "tool":
        out.update({k: turn[k] for k in ("name", "tool_call_id") if isinstance(turn.get(k), str)})
    return out


# The two shapes of a chat turn, each with its role names: a turn is read by its own keys, so `conversations` holding
# role/content turns (lmsys-chat-1m, many Hub exports) or `messages` holding from/value turns read as they are.
TURN_SHAPES = {"role": ("role", "content", {r: r for r in ROLES}), "from": ("from", "value", SHAREGPT_ROLES)}


def _messages(turns: Any, key: str, role_key: str) -> list[dict]:
    if not isinstance(turns, list):
        raise BadLine(f"field '{key}' must be a list of turns, got {type(turns).__name__}")
    if not turns:
        raise BadLine(f"field '{key}' is empty")
    other = "from" if role_key == "role" else "role"
    out = []
    for i, turn in enumerate(turns):
        shape = TURN_SHAPES[other if isinstance(turn, dict) and role_key not in turn and other in turn else role_key]
        out.append(_turn(turn, f"{key}[{i}]", *shape))
    if not any(m["role"] == "assistant" for m in out):
        raise BadLine(f"field '{key}' has no assistant turn to learn from")
    return out


def _tools(record: dict[str, Any]) -> dict[str, Any]:
    """A record's function schemas for the template (`tools`), when it has any."""
    tools = record.get("tools")
    if tools is None:
        return {}
    if isinstance(tools, str):  # some datasets store the schemas as a JSON string
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            raise BadLine("field 'tools' is a string that is not JSON") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadLine("field 'tools' must be a list of function schemas (objects)")
    return {"tools": tools} if tools else {}


def convert(record: dict[str, Any], fmt: str) -> dict[str, Any]:
    """One raw record in format `fmt` → the TRL record (raises BadLine)."""
    if fmt == "text":
        return {"text": _string(record, "text")}
    if fmt == "prompt_completion":
        return {"prompt": _string(record, "prompt"), "completion": _string(record, "completion")}
    if fmt == "messages":
        messages = _messages(record.get("messages"), "messages", "role")
        return {"messages": messages, **_tools(record)}
    if fmt == "sharegpt":
        if "conversations" not in record:
            raise BadLine("missing field 'conversations'")
        messages = _messages(record["conversations"], "conversations", "from")
        return {"messages": messages, **_tools(record)}
    if fmt == "alpaca":
        instruction = _string(record, "instruction")
        extra = record.get("input", "")
        if not isinstance(extra, str):
            raise BadLine(f"field 'input' must be a string, got {type(extra).__name__}")
        user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        return {
            "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": _string(record, "output")}]
        }
    raise BadLine(f"unknown format {fmt!r}")
