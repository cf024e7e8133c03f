"""Training records in the common shapes, validated and turned into the records TRL's SFTTrainer takes.

Each data set is one format (auto-detected from its first record, or forced with `data.format`):
text → {"text"}; prompt/completion (strings) → {"prompt", "completion"}; messages / ShareGPT conversations / alpaca /
TRL's conversational prompt/completion (`prompt` and `completion` lists of turns: `chat_prompt_completion`) →
{"messages"} (chat data goes through the tokenizer's chat template). Chat turns may be tool results (`tool` role;
ShareGPT `observation`) and assistant turns may carry `tool_calls` (ShareGPT `function_call`); a record's `tools`
(function schemas) and `system` prompt go to the template too. `convert` is the one place a record is validated: a
bad record is a `BadLine` naming the field, which the reader (`lowmem_ft.data.readers`) turns into a `UserError`
naming `file:line` (or the row); with skip_bad_lines it is skipped and reported instead. Nothing is dropped silently.

What a turn may carry besides its role and content, and what becomes of it:
- `content` as a list of parts (the OpenAI / transformers multimodal form, `[{"type": "text", "text": ...}]`): text
  parts are kept as parts, and `lowmem_ft.data.chat` hands them to the template as the model gets them at inference;
  an image / audio / video part is refused (lowmem-ft trains text models).
- the assistant's reasoning (`reasoning_content`, `thinking` or `reasoning`): passed to the template, which must
  render it (Qwen3's puts `reasoning_content` inside `<think>`); a template that does not is refused per sample by
  `lowmem_ft.data.chat`, never trained on the answer alone.
- `weight` (Axolotl's per-turn flag): 0 = no loss on that assistant turn, 1 = loss (the default); nothing else.
- any other key (`name` on a user turn, `loss`, `markdown`, ...) is not read: it is reported with the data's unused
  columns as `messages[].KEY`, like a column no format reads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

FORMATS = ("auto", "text", "prompt_completion", "chat_prompt_completion", "messages", "sharegpt", "alpaca")
CHAT_FORMATS = ("messages", "sharegpt", "alpaca", "chat_prompt_completion")  # go through the chat template
# An assistant turn's reasoning, under the names chat templates read it by: Qwen3 / QwQ / DeepSeek exports
# `reasoning_content`, gpt-oss `thinking`, some exports `reasoning`.
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
# Content part types that hold text: the OpenAI chat form's `text`, the Responses API's `input_text` / `output_text`.
TEXT_PARTS = ("text", "input_text", "output_text")
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


def detect_format(record: dict[str, Any], key: str = "data") -> str:
    """The format of a record by its keys (`key`: the recipe key that describes the data, for messages)."""
    if "chosen" in record and "rejected" in record:
        raise BadLine(_preference(record, key))
    if "messages" in record:
        return "messages"
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record and "output" in record:
        return "alpaca"
    if "prompt" in record and "completion" in record:
        tag = next((k for k in ("label", "kto_tag") if isinstance(record.get(k), bool)), None)
        if tag:  # trl-lib's unpaired preference sets (kto-mix-14k), LLaMA-Factory's KTO data
            raise BadLine(
                f"this is unpaired preference (KTO) data: '{tag}' marks each completion good or bad, and SFT would "
                f"learn the bad ones too; keep the rows where {tag} is true (e.g. datasets' .filter) and train on "
                "those, or train it with --method kto"
            )
        if isinstance(record["prompt"], list) or isinstance(record["completion"], list):
            return "chat_prompt_completion"
        return "prompt_completion"
    if "text" in record:
        return "text"
    raise BadLine(
        f"cannot tell the format from keys {sorted(record)}; expected 'text', 'prompt'+'completion', "
        "'messages', 'conversations' or 'instruction'+'output' (or set --format)"
    )


def _preference(record: dict[str, Any], key: str) -> str:
    """The one line that says preference data is not SFT data, and how to train on its chosen answers."""
    what = (
        f"this is preference data (keys {sorted(record)}: a chosen and a rejected answer, for DPO / ORPO / reward "
        "training) and lowmem-ft trains SFT unless --method says otherwise: train the pairs with --method dpo (or orpo, "
        "simpo)"
    )
    if isinstance(record["chosen"], dict):  # LLaMA-Factory's ranking ShareGPT: the conversation, then one turn each
        return f"{what}; to fine-tune on the chosen answers, append each 'chosen' turn to its conversation in the data"
    if "prompt" in record:
        how = f"{key}.columns={{completion: chosen}}"
    elif "instruction" in record:  # LLaMA-Factory's ranking alpaca
        how = f"{key}.columns={{prompt: instruction, completion: chosen}}"
    elif isinstance(record["chosen"], list):
        how = f"{key}.columns={{messages: chosen}} (the chosen conversation, prompt included)"
    else:
        how = f"{key}.columns={{prompt: QUESTION_COLUMN, completion: chosen}}"
    return f"{what}; to fine-tune on the chosen answers, map them with {how}"


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


def _content(value: Any, where: str, allow_empty: bool) -> str | list[dict]:
    """A turn's content: a string, or a list of text parts kept as `[{"type": "text", "text": ...}]` (how they
    reach the template is `lowmem_ft.data.chat`'s); a non-text part is refused, naming its type and the turn."""
    if value is None and allow_empty:
        return ""
    if isinstance(value, list):
        parts = []
        for k, part in enumerate(value):
            at = f"{where}[{k}]"
            if not isinstance(part, dict):
                raise BadLine(
                    f'\'{at}\' must be a content part object ({{"type": "text", ...}}), got {type(part).__name__}'
                )
            kind = part.get("type")
            if kind not in TEXT_PARTS:
                raise BadLine(
                    f"'{at}' is {'an' if str(kind)[:1] in 'aeiou' else 'a'} {kind!r} part; lowmem-ft trains text "
                    "models on text only: drop the non-text parts (or the samples that have them)"
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise BadLine(f"'{at}.text' must be a string, got {type(text).__name__}")
            parts.append({"type": "text", "text": text})
        if not allow_empty and not "".join(p["text"] for p in parts).strip():
            raise BadLine(f"field '{where}' is empty")
        return parts
    if not isinstance(value, str):
        raise BadLine(f"'{where}' must be a string or a list of text parts, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise BadLine(f"field '{where}' is empty")
    return value


def content_text(content: str | list[dict] | None) -> str:
    """A turn's content as one string (its text parts joined by newlines; image parts have none), for checks and
    messages."""
    if isinstance(content, list):
        return "\n".join(part["text"] for part in content if "text" in part)
    return content or ""


def _turn(
    turn: Any, where: str, role_key: str, content_key: str, roles: dict[str, str], unread: dict | None = None
) -> dict:
    if not isinstance(turn, dict):
        raise BadLine(f"'{where}' must be an object, got {type(turn).__name__}")
    if role_key not in turn:
        raise BadLine(f"missing field '{where}.{role_key}'")
    raw_role = turn[role_key]
    if not isinstance(raw_role, str) or raw_role not in roles:
        raise BadLine(f"'{where}.{role_key}' is {raw_role!r}; expected one of {', '.join(sorted(roles))}")
    role = roles[raw_role]
    read = {role_key, content_key, "weight", *REASONING_KEYS}
    if raw_role == "function_call":  # ShareGPT: the value is the call itself
        try:
            calls = json.loads(turn.get(content_key, ""))
        except (TypeError, json.JSONDecodeError):
            raise BadLine(f"'{where}.{content_key}' of a function_call turn must be a JSON tool call") from None
        out: dict[str, Any] = {"role": role, "content": "", "tool_calls": _tool_calls(calls, f"{where}.{content_key}")}
    else:
        calls = turn.get("tool_calls") if role == "assistant" else None
        if content_key not in turn and not calls:
            raise BadLine(f"missing field '{where}.{content_key}'")
        out = {"role": role, "content": _content(turn.get(content_key), f"{where}.{content_key}", bool(calls))}
        if calls:
            out["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
        if role == "assistant":
            read.add("tool_calls")
    if role == "tool":
        out.update({k: turn[k] for k in ("name", "tool_call_id") if isinstance(turn.get(k), str)})
        read.update(("name", "tool_call_id"))
    out.update(_reasoning(turn, where, role))
    out.update(_weight(turn, where, role))
    if unread is not None:
        shape = where.split("[", 1)[0]
        unread.update(dict.fromkeys(f"{shape}[].{k}" for k in turn if k not in read))
    return out


def _reasoning(turn: dict, where: str, role: str) -> dict:
    """The assistant's reasoning under the key the data gives it (the template must render it: see chat.py)."""
    given = [k for k in REASONING_KEYS if turn.get(k) not in (None, "")]
    if not given:
        return {}
    if role != "assistant":
        raise BadLine(f"'{where}.{given[0]}' is reasoning on a {role} turn; only assistant turns carry reasoning")
    if len(given) > 1:
        raise BadLine(f"'{where}' has reasoning under both '{given[0]}' and '{given[1]}'; keep one")
    value = turn[given[0]]
    if not isinstance(value, str):
        raise BadLine(f"'{where}.{given[0]}' must be a string, got {type(value).__name__}")
    return {given[0]: value} if value.strip() else {}


def _weight(turn: dict, where: str, role: str) -> dict:
    """Axolotl's per-turn `weight`: 0 = no loss on this assistant turn, 1 = loss (the default; null means unset)."""
    weight = turn.get("weight")
    if weight is None:
        return {}
    if isinstance(weight, bool) or not isinstance(weight, int | float) or weight not in (0, 1):
        raise BadLine(f"'{where}.weight' is {weight!r}; a turn's weight is 0 (no loss on it) or 1 (loss on it)")
    if weight == 1 and role != "assistant":
        raise BadLine(
            f"'{where}.weight' is 1 on a {role} turn; lowmem-ft puts the loss on assistant turns only "
            "(data.train_on_prompt=true trains on every token)"
        )
    return {"weight": 0} if weight == 0 and role == "assistant" else {}


# The two shapes of a chat turn, each with its role names: a turn is read by its own keys, so `conversations` holding
# role/content turns (lmsys-chat-1m, many Hub exports) or `messages` holding from/value turns read as they are.
TURN_SHAPES = {"role": ("role", "content", {r: r for r in ROLES}), "from": ("from", "value", SHAREGPT_ROLES)}


def _messages(turns: Any, key: str, role_key: str, unread: dict | None = None, learn: bool = True) -> list[dict]:
    """The turns of `key`; `learn`: they must hold an assistant turn to learn from."""
    if not isinstance(turns, list):
        raise BadLine(f"field '{key}' must be a list of turns, got {type(turns).__name__}")
    if not turns:
        raise BadLine(f"field '{key}' is empty")
    other = "from" if role_key == "role" else "role"
    out = []
    for i, turn in enumerate(turns):
        shape = TURN_SHAPES[other if isinstance(turn, dict) and role_key not in turn and other in turn else role_key]
        out.append(_turn(turn, f"{key}[{i}]", *shape, unread))
    assistants = [m for m in out if m["role"] == "assistant"]
    if learn and not assistants:
        raise BadLine(f"field '{key}' has no assistant turn to learn from")
    if learn and all(m.get("weight") == 0 for m in assistants):
        raise BadLine(f"every assistant turn of '{key}' has weight 0: nothing to learn from")
    return out


def _system(record: dict[str, Any], messages: list[dict]) -> list[dict]:
    """A record's `system` column (LLaMA-Factory's alpaca and ShareGPT) as the conversation's system turn."""
    system = record.get("system")
    if system is None or system == "":
        return messages
    if not isinstance(system, str):
        raise BadLine(f"field 'system' must be a string, got {type(system).__name__}")
    if messages and messages[0]["role"] == "system":
        if content_text(messages[0]["content"]).strip() == system.strip():
            return messages
        raise BadLine("the record has a 'system' field and a different system turn; keep one")
    return [{"role": "system", "content": system}, *messages] if system.strip() else messages


def _history(record: dict[str, Any]) -> list[dict]:
    """LLaMA-Factory's alpaca `history`: [[instruction, answer], ...] before this record's own instruction."""
    history = record.get("history")
    if history is None:
        return []
    if not isinstance(history, list):
        raise BadLine(f"field 'history' must be a list of [instruction, answer] pairs, got {type(history).__name__}")
    out = []
    for k, pair in enumerate(history):
        if not (isinstance(pair, list | tuple) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            raise BadLine(f"'history[{k}]' must be an [instruction, answer] pair of strings")
        if not pair[0].strip() or not pair[1].strip():
            raise BadLine(f"'history[{k}]' has an empty instruction or answer")
        out += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
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


def convert(record: dict[str, Any], fmt: str, unread: dict | None = None) -> dict[str, Any]:
    """One raw record in format `fmt` → the TRL record (raises BadLine). Turn keys it does not read are added to
    `unread` (as `messages[].KEY`), for the reader to report. Preference shapes (`preference`, `kto`) are
    `lowmem_ft.data.preference`'s."""
    if fmt == "text":
        return {"text": _string(record, "text")}
    if fmt == "prompt_completion":
        if isinstance(record.get("prompt"), list) or isinstance(record.get("completion"), list):
            raise BadLine(
                "'prompt' / 'completion' hold lists of turns (TRL's conversational prompt/completion); set "
                "data.format to chat_prompt_completion or auto"
            )
        return {"prompt": _string(record, "prompt"), "completion": _string(record, "completion")}
    if fmt == "chat_prompt_completion":
        # TRL's conversational prompt/completion (trl-lib data sets): loss on the completion's assistant turns only
        for key in ("prompt", "completion"):
            if key not in record:
                raise BadLine(f"missing field '{key}'")
            if isinstance(record[key], str):
                raise BadLine(
                    f"field '{key}' is a string, where this data set's prompt/completion are lists of turns (TRL's "
                    "conversational form, as in its first record); give both as lists of turns or both as strings"
                )
        prompt = _system(record, _messages(record["prompt"], "prompt", "role", unread, learn=False))
        completion = _messages(record["completion"], "completion", "role", unread)
        return {"messages": prompt + completion, "completion_from": len(prompt), **_tools(record)}
    if fmt == "messages":
        messages = _messages(record.get("messages"), "messages", "role", unread)
        return {"messages": _system(record, messages), **_tools(record)}
    if fmt == "sharegpt":
        if "conversations" not in record:
            raise BadLine("missing field 'conversations'")
        messages = _messages(record["conversations"], "conversations", "from", unread)
        return {"messages": _system(record, messages), **_tools(record)}
    if fmt == "alpaca":
        # LLaMA-Factory's alpaca adds `system` and `history`; like LLaMA-Factory (data/README.md: "the responses in
        # the history will also be learned by the model"; its mask_history defaults to false), the history's
        # answers carry loss too.
        instruction = _string(record, "instruction")
        extra = record.get("input", "")
        if not isinstance(extra, str):
            raise BadLine(f"field 'input' must be a string, got {type(extra).__name__}")
        user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        turns = [{"role": "user", "content": user}, {"role": "assistant", "content": _string(record, "output")}]
        return {"messages": _system(record, _history(record) + turns)}
    raise BadLine(f"unknown format {fmt!r}")
