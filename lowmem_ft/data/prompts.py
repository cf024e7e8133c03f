"""GRPO's prompt data: prompts as strings or conversations, the other columns kept for the rewards, long prompts
cut or left out by the recipe's rule and counted.

A record (after `data.columns` renamed the data set's columns to ours, `lowmem_ft.data.readers.rename`: GSM8K's
`{prompt: question}`) has a `prompt` — a string, or a list of turns ending with a user turn — or a `messages`
conversation whose trailing assistant turn (the reference answer some data sets carry) is left out of the prompt.
Every other column is kept as it is: TRL 1.16's `GRPOTrainer` hands each to the reward functions by name
(`_calculate_rewards`), so GSM8K's `answer` reaches `numeric_match` untouched.

Prompts are tokenized as TRL tokenizes them (`_tokenize_prompts`): a string with the tokenizer's own special tokens,
a conversation through the chat template with the generation prompt (`add_generation_prompt=True`). TRL 1.16 never
truncates a prompt, and the generation phase's memory grows with the round's longest one (it left-pads to it), so
`fit_prompts` enforces `max_prompt_len` here: `keep_end` / `keep_start` cut a string prompt to its last / first
tokens (a conversation loses its oldest turns after the system prompt, the last user turn always kept), `drop` leaves
the row out; whatever cannot be cut to fit is left out. Both are counted.

A bad record (no prompt, an empty one, a conversation that does not end with the user) is a `BadLine` naming the
field; the reader names the row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from lowmem_ft.data.formats import BadLine, _messages

PromptRule = Literal["keep_end", "keep_start", "drop"]
Prompt = str | list[dict[str, Any]]


def convert(record: dict[str, Any]) -> dict[str, Any]:
    """One renamed record → {"prompt": str | turns, **the other columns}. Raises BadLine."""
    extras = {k: v for k, v in record.items() if k not in ("prompt", "messages")}
    if "prompt" in record:
        prompt = record["prompt"]
        if isinstance(prompt, str):
            if not prompt.strip():
                raise BadLine("'prompt' is empty")
            return {"prompt": prompt, **extras}
        if not isinstance(prompt, list):
            raise BadLine(f"'prompt' must be a string or a list of turns, not {type(prompt).__name__}")
        turns = _messages(prompt, "prompt", "role", learn=False)
    elif "messages" in record:
        turns = _messages(record["messages"], "messages", "role", learn=False)
        if turns and turns[-1]["role"] == "assistant":  # a reference answer: the model must write its own
            turns = turns[:-1]
    else:
        raise BadLine(
            "missing field 'prompt' (GRPO reads a prompt per row: a string or a conversation; map yours with "
            "data.columns={prompt: question})"
        )
    turns = [{k: v for k, v in t.items() if k in ("role", "content")} for t in turns]
    if not turns or turns[-1]["role"] != "user":
        raise BadLine("the prompt conversation must end with a user turn (the model answers it)")
    return {"prompt": turns, **extras}


def prompt_ids(tokenizer: Any, prompt: Prompt) -> list[int]:
    """A prompt's token ids as TRL 1.16 makes them (`GRPOTrainer._tokenize_prompts`)."""
    if isinstance(prompt, str):
        return list(tokenizer(text=prompt)["input_ids"])
    from jinja2 import TemplateError

    try:
        out = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)
    except TemplateError as exc:  # raise_exception(...) in the template: Gemma 2 takes no system turn
        raise BadLine(f"the chat template rejects the prompt ({exc})") from None
    return list(out["input_ids"])


@dataclass
class PromptFit:
    """What `fit_prompts` did: rows kept, cut and left out, and the longest prompt kept (the plan's P)."""

    kept: int = 0
    cut: int = 0
    dropped: int = 0
    longest: int = 0

    def describe(self, max_len: int) -> str:
        if not self.cut and not self.dropped:
            return f"{self.kept} prompts, the longest {self.longest} tokens"
        return (
            f"{self.kept} prompts kept (the longest {self.longest} tokens): {self.cut} cut to {max_len} tokens, "
            f"{self.dropped} longer than {max_len} left out"
        )


def _cut_text(tokenizer: Any, prompt: str, ids: list[int], max_len: int, rule: PromptRule) -> str | None:
    """The prompt cut to at most `max_len` tokens, re-encoded until it fits (decoding and encoding again can merge
    or split tokens at the cut); None when even that fails."""
    special = len(prompt_ids(tokenizer, "x")) - len(tokenizer(text="x", add_special_tokens=False)["input_ids"])
    body = list(tokenizer(text=prompt, add_special_tokens=False)["input_ids"])
    keep = max_len - max(0, special)
    while keep > 0:
        part = body[-keep:] if rule == "keep_end" else body[:keep]
        text = tokenizer.decode(part, skip_special_tokens=True)
        if text.strip() and len(prompt_ids(tokenizer, text)) <= max_len:
            return text
        keep -= 1
    return None


def _cut_turns(tokenizer: Any, turns: list[dict[str, Any]], max_len: int) -> list[dict[str, Any]] | None:
    """The conversation without its oldest turns (after a system prompt) until it fits; the last user turn stays."""
    head = turns[:1] if turns[0]["role"] == "system" else []
    rest = turns[len(head) :]
    while len(rest) > 1:
        rest = rest[1:]
        while rest and rest[0]["role"] != "user":  # a conversation restarts with a user turn
            rest = rest[1:]
        if rest and len(prompt_ids(tokenizer, head + rest)) <= max_len:
            return head + rest
    return None


def fit_prompts(
    records: Iterable[dict[str, Any]],
    tokenizer: Any,
    max_len: int,
    rule: PromptRule = "keep_end",
    on_fit: Callable[[PromptFit], None] | None = None,
) -> tuple[list[dict[str, Any]], PromptFit]:
    """The records whose prompts fit in `max_len` tokens (0: no limit), long ones cut or left out by `rule`."""
    fit = PromptFit()
    out = []
    for record in records:
        prompt = record["prompt"]
        n = len(prompt_ids(tokenizer, prompt))
        if max_len and n > max_len:
            cut: Prompt | None = None
            if rule != "drop":
                if isinstance(prompt, str):
                    cut = _cut_text(tokenizer, prompt, prompt_ids(tokenizer, prompt), max_len, rule)
                else:
                    cut = _cut_turns(tokenizer, prompt, max_len)
            if cut is None:
                fit.dropped += 1
                continue
            fit.cut += 1
            record = {**record, "prompt": cut}
            n = len(prompt_ids(tokenizer, cut))
        fit.kept += 1
        fit.longest = max(fit.longest, n)
        out.append(record)
    if on_fit:
        on_fit(fit)
    return out, fit
