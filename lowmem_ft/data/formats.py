"""Training records in the common shapes, validated and turned into the records TRL's SFTTrainer takes.

Each data set is one format (auto-detected from its first record, or forced with `data.format`):
text → {"text"}; prompt/completion → {"prompt", "completion"}; messages / ShareGPT conversations / alpaca →
{"messages"} (chat data goes through the tokenizer's chat template). `convert` is the one place a record is
validated: a bad record is a `BadLine` naming the field, which the reader (`lowmem_ft.data.readers`) turns into a
`UserError` naming `file:line` (or the row); with skip_bad_lines it is skipped and reported instead. Nothing is
dropped silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FORMATS = ("auto", "text", "prompt_completion", "messages", "sharegpt", "alpaca")
CHAT_FORMATS = ("messages", "sharegpt", "alpaca")  # go through the chat template
ROLES = {"system", "user", "assistant"}
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


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


def _messages(turns: Any, key: str, role_key: str, content_key: str, roles: dict[str, str]) -> list[dict]:
    if not isinstance(turns, list):
        raise BadLine(f"field '{key}' must be a list of turns, got {type(turns).__name__}")
    if not turns:
        raise BadLine(f"field '{key}' is empty")
    out = []
    for i, turn in enumerate(turns):
        where = f"{key}[{i}]"
        if not isinstance(turn, dict):
            raise BadLine(f"'{where}' must be an object, got {type(turn).__name__}")
        if role_key not in turn:
            raise BadLine(f"missing field '{where}.{role_key}'")
        role = turn[role_key]
        if not isinstance(role, str) or role not in roles:
            raise BadLine(f"'{where}.{role_key}' is {role!r}; expected one of {', '.join(sorted(roles))}")
        if content_key not in turn:
            raise BadLine(f"missing field '{where}.{content_key}'")
        content = turn[content_key]
        if not isinstance(content, str):
            raise BadLine(f"'{where}.{content_key}' must be a string, got {type(content).__name__}")
        if not content.strip():
            raise BadLine(f"field '{where}.{content_key}' is empty")
        out.append({"role": roles[role], "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise BadLine(f"field '{key}' has no assistant turn to learn from")
    return out


def convert(record: dict[str, Any], fmt: str) -> dict[str, Any]:
    """One raw record in format `fmt` → the TRL record (raises BadLine)."""
    if fmt == "text":
        return {"text": _string(record, "text")}
    if fmt == "prompt_completion":
        return {"prompt": _string(record, "prompt"), "completion": _string(record, "completion")}
    if fmt == "messages":
        return {"messages": _messages(record.get("messages"), "messages", "role", "content", {r: r for r in ROLES})}
    if fmt == "sharegpt":
        if "conversations" not in record:
            raise BadLine("missing field 'conversations'")
        return {"messages": _messages(record["conversations"], "conversations", "from", "value", SHAREGPT_ROLES)}
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
