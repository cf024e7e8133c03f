"""Preference data as the Hub holds it, validated, tokenized and fitted to the length budget before any padding.

Two record shapes, named by the method that trains on them:
- `preference` (DPO, ORPO, SimPO): a prompt, a chosen and a rejected answer. Strings (`prompt` / `chosen` /
  `rejected`), or conversations: TRL's explicit form (`prompt` a list of turns, `chosen` / `rejected` the answer's
  turns), UltraFeedback-binarized and Argilla's dpo-mix (`chosen` / `rejected` whole conversations with the shared
  prompt inside each, `prompt` a copy of the question or absent), Anthropic HH (strings, no `prompt` column: the
  shared prefix is the prompt, found as TRL's `extract_prompt` finds it). Other column names (`instruction`,
  `chosen_response`, ...) are mapped with `data.columns`.
- `kto` (KTO): unpaired `prompt` / `completion` / `label`, the label a boolean (True: a good completion); strings or
  conversations.

The one idea: a pair is turned into token ids exactly as SFT turns a conversation into ids and labels, then cut to
`memory.max_seq_len` *before* it meets other rows in a batch. Chat data goes through `lowmem_ft.data.chat` (the same
template, the same assistant-only span — what the model must produce at inference —, the same checks that nothing is
dropped); the prompt is what both answers share before their first learned token. Truncation follows the prompt
rule (`PairFit.prompt_rule`: keep the prompt's end, its start, or drop the pair) and then cuts the answers at their
end, so a long pair costs one row of `max_seq_len`, never a batch padded to its length.

A bad record (a missing or empty side, identical chosen and rejected, a KTO label that is not a boolean, a
conversation the template cannot render) is a `BadLine` naming the field; the reader names the row and stops, or with
`--skip-bad-lines` skips and counts it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Literal

from lowmem_ft.data.formats import BadLine, _messages, _string, _system, _tools, content_text

log = logging.getLogger(__name__)

PREFERENCE_FORMATS = ("preference", "kto")  # their fields: lowmem_ft.data.sources.FORMAT_FIELDS
PromptRule = Literal["keep_end", "keep_start", "drop"]


# ---- records ------------------------------------------------------------------------------------------------------
def convert(record: dict[str, Any], fmt: str, unread: dict | None = None) -> dict[str, Any]:
    """One raw record → {"prompt", "chosen", "rejected"} (or KTO's {"prompt", "completion", "label"}), each a string
    or a list of turns, with an explicit prompt. Raises BadLine."""
    if fmt == "kto":
        return _kto(record, unread)
    if fmt != "preference":
        raise BadLine(f"unknown preference format {fmt!r}")
    for key in ("chosen", "rejected"):
        if key not in record:
            raise BadLine(f"missing field '{key}' (a preference pair needs a chosen and a rejected answer)")
    chosen, rejected = record["chosen"], record["rejected"]
    if isinstance(chosen, str) != isinstance(rejected, str):
        raise BadLine("'chosen' and 'rejected' must both be strings or both be lists of turns")
    out = _text_pair(record) if isinstance(chosen, str) else _chat_pair(record, unread)
    if _same(out["chosen"], out["rejected"]):
        raise BadLine("'chosen' and 'rejected' are identical: the pair prefers nothing")
    return out


def _text_pair(record: dict[str, Any]) -> dict[str, Any]:
    chosen, rejected = _string(record, "chosen"), _string(record, "rejected")
    if "prompt" in record:
        prompt = record["prompt"]
        if not isinstance(prompt, str):
            raise BadLine(f"field 'prompt' must be a string when the answers are strings, got {type(prompt).__name__}")
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    # Anthropic HH: the prompt is the text both answers share (trl.data_utils.extract_prompt's rule)
    from trl.data_utils import extract_prompt

    split = extract_prompt({"chosen": chosen, "rejected": rejected})
    if not split["chosen"].strip() or not split["rejected"].strip():
        raise BadLine("one answer is the other's prefix: nothing is left of it after the shared prompt")
    if not split["prompt"].strip():  # TRL would train the pair on an empty prompt: answers to no question
        raise BadLine(
            "'chosen' and 'rejected' share no prompt text and there is no 'prompt' column: map the question with "
            "data.columns={prompt: COLUMN}"
        )
    return {"prompt": split["prompt"], "chosen": split["chosen"], "rejected": split["rejected"]}


def _chat_pair(record: dict[str, Any], unread: dict | None) -> dict[str, Any]:
    chosen = _messages(record["chosen"], "chosen", "role", unread)
    rejected = _messages(record["rejected"], "rejected", "role", unread)
    prompt = record.get("prompt")
    if isinstance(prompt, list):  # TRL's explicit form: the answers are the assistant's turns only
        turns = _messages(prompt, "prompt", "role", unread, learn=False)
    else:
        # the conversations hold the prompt (UltraFeedback-binarized, Argilla dpo-mix, TRL's implicit form): the
        # turns both share; a string `prompt` column is then a copy of the question, or the question itself
        shared = 0
        while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
            shared += 1
        turns, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
        if not turns:
            if not isinstance(prompt, str) or not prompt.strip():
                raise BadLine(
                    "'chosen' and 'rejected' share no prompt turn and there is no 'prompt' column: map the question "
                    "with data.columns={prompt: COLUMN}"
                )
            turns = [{"role": "user", "content": prompt}]
    for side, answer in (("chosen", chosen), ("rejected", rejected)):
        if answer[0]["role"] != "assistant":
            raise BadLine(f"'{side}' continues the prompt with a {answer[0]['role']} turn, not the assistant's answer")
        if not any(content_text(m.get("content")).strip() or m.get("tool_calls") for m in answer):
            raise BadLine(f"field '{side}' is empty")
    return {"prompt": _system(record, turns), "chosen": chosen, "rejected": rejected, **_tools(record)}


def _kto(record: dict[str, Any], unread: dict | None) -> dict[str, Any]:
    label = record.get("label", record.get("kto_tag"))
    if "label" not in record and "kto_tag" not in record:
        raise BadLine("missing field 'label' (True for a good completion, False for a bad one)")
    if not isinstance(label, bool):
        raise BadLine(f"field 'label' must be a boolean (true / false), got {label!r}")
    if "completion" not in record:
        raise BadLine("missing field 'completion'")
    completion, prompt = record["completion"], record.get("prompt")
    if isinstance(completion, str):
        if prompt is None:
            raise BadLine("missing field 'prompt'")
        return {"prompt": _string(record, "prompt", allow_empty=True), "completion": _string(record, "completion"),
                "label": label}  # fmt: skip
    answer = _messages(completion, "completion", "role", unread)
    turns = (
        _messages(prompt, "prompt", "role", unread, learn=False)
        if isinstance(prompt, list)
        else [{"role": "user", "content": _string(record, "prompt")}]
    )
    return {"prompt": _system(record, turns), "completion": answer, "label": label, **_tools(record)}


def _same(a: str | list[dict], b: str | list[dict]) -> bool:
    if isinstance(a, str):
        return a.strip() == b.strip()
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


# ---- tokens -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PairFit:
    """How a pair (or a KTO sample) is fitted into `max_len` tokens before batching.

    `prompt_rule`: keep_end (the prompt's last tokens, nearest the answer), keep_start, or drop (a pair that does not
    fit is left out and counted); `max_prompt_len`: the prompt's share when the pair does not fit (0: half)."""

    max_len: int
    prompt_rule: PromptRule = "keep_end"
    max_prompt_len: int = 0

    def prompt_budget(self) -> int:
        return min(self.max_prompt_len or self.max_len // 2, self.max_len - 1)


@dataclass
class FitReport:
    """What fitting did to the data: pairs in, kept whole, with the prompt or the answers cut, dropped."""

    samples_in: int = 0
    whole: int = 0
    prompt_cut: int = 0
    answers_cut: int = 0
    dropped: int = 0
    identical_after_cut: int = 0
    tokens_longest: int = 0
    why_dropped: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k != "why_dropped"}


def fit_pair(prompt: list[int], answers: list[list[int]], fit: PairFit) -> tuple[list[int], list[list[int]], str]:
    """(prompt, answers, what was done) with len(prompt) + len(each answer) ≤ max_len; what was done is "whole",
    "prompt_cut", "answers_cut" or "drop" (the caller leaves the pair out). The prompt is cut first, by its rule, to
    its budget; then each answer at its end."""
    longest = max(len(a) for a in answers)
    if len(prompt) + longest <= fit.max_len:
        return prompt, answers, "whole"
    if fit.prompt_rule == "drop":
        return prompt, answers, "drop"
    done = "answers_cut"
    budget = max(fit.prompt_budget(), fit.max_len - longest)
    if len(prompt) > budget:
        prompt = prompt[-budget:] if fit.prompt_rule == "keep_end" else prompt[:budget]
        done = "prompt_cut"
    room = fit.max_len - len(prompt)
    return prompt, [a[:room] for a in answers], done


def _text_ids(tokenizer, prompt: str, answer: str, eos: str) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids) of a string pair side: TRL's rule (dpo_trainer `_prepare_dataset`): EOS appended to
    the answer, the answer starts where the tokenized prompt and prompt+answer diverge."""
    from trl.data_utils import common_prefix_length

    answer = answer if answer.endswith(eos) else answer + eos
    p = tokenizer(prompt)["input_ids"]
    full = tokenizer(prompt + answer)["input_ids"]
    n = common_prefix_length(p, full)
    return full[:n], full[n:]


def _chat_ids(tokenizer, render, prompt: list[dict], answer: list[dict], tools) -> tuple[list[int], list[int]]:
    """(ids before the first learned token, ids up to the last learned one) of prompt + answer, the learned tokens
    found as SFT finds them (`lowmem_ft.data.chat.samples`: the template's markers, TRL's training version, or turn
    by turn), so the answer is exactly what the model says at inference, its end-of-turn token included."""
    from lowmem_ft.data.chat import encode_with_offsets, labels_for, samples

    record = {"messages": prompt + answer, "completion_from": len(prompt)}
    if tools:
        record["tools"] = tools
    out = samples(record, render)
    text, spans = out[-1]
    if len(out) > 1 and len(answer) > 1:
        from lowmem_ft.data.chat import SampleError

        raise SampleError("the template renders earlier answer turns differently once later ones follow", masking=True)
    enc = encode_with_offsets(tokenizer, text)
    ids = enc["input_ids"]
    labels = labels_for(ids, enc["offset_mapping"], text, spans, render.template.masking)
    learned = [k for k, label in enumerate(labels) if label != -100]
    if not learned:
        from lowmem_ft.data.chat import SampleError

        raise SampleError("the answer renders to no token")
    return ids[: learned[0]], ids[learned[0] : learned[-1] + 1]


def _shared_prompt(sides: list[tuple[list[int], list[int]]]) -> tuple[list[int], list[list[int]]]:
    """One prompt for both answers: their common prefix (BPE can merge across the prompt's end differently for
    each answer); what lies beyond it goes to the answer, as TRL's `common_prefix_length` rule does."""
    from trl.data_utils import common_prefix_length

    (p0, a0), (p1, a1) = sides
    n = common_prefix_length(p0, p1)
    return p0[:n], [p0[n:] + a0, p1[n:] + a1]


def _pair_ids(record: dict[str, Any], tokenizer, render, eos: str, keys: tuple[str, ...]) -> tuple[list, list]:
    """(prompt ids, [answer ids per key]) of one converted record."""
    prompt = record["prompt"]
    if isinstance(prompt, str):
        sides = [_text_ids(tokenizer, prompt, record[k], eos) for k in keys]
    else:
        sides = [_chat_ids(tokenizer, render, prompt, record[k], record.get("tools")) for k in keys]
    if len(sides) == 1:
        return sides[0][0], [sides[0][1]]
    return _shared_prompt(sides)


def tokenize_pairs(records: list[dict], fmt: str, tokenizer, fit: PairFit, *, where: str, skip_bad: bool = False):
    """Converted records → (datasets.Dataset of TRL's pre-tokenized columns, FitReport, skipped lines).

    Paired: `prompt_ids`, `chosen_ids`, `rejected_ids` (what `DataCollatorForPreference` reads); KTO: `prompt_ids`,
    `completion_ids`, `label`. Every row already fits `fit.max_len`: the collator never meets a longer one."""
    from datasets import Dataset

    from lowmem_ft.data.chat import Renderer, SampleError, chat_template_for, set_template
    from lowmem_ft.errors import UserError

    keys = ("completion",) if fmt == "kto" else ("chosen", "rejected")
    chat = any(not isinstance(r["prompt"], str) for r in records)
    render = Renderer(tokenizer, chat_template_for(tokenizer, False, set_template(tokenizer, None))) if chat else None
    eos = tokenizer.eos_token or ""
    rows, report, skipped = [], FitReport(samples_in=len(records)), []
    for index, record in enumerate(records):
        try:
            prompt, answers = _pair_ids(record, tokenizer, render, eos, keys)
        except SampleError as exc:
            line = f"{where}: sample {index + 1}: {exc}"
            if not skip_bad:
                fix = exc.fix or "set data.chat_template to a template that renders it"
                raise UserError(f"{line}; {fix} (or pass --skip-bad-lines)") from None
            skipped.append(line)
            continue
        if not all(answers):
            line = f"{where}: sample {index + 1}: an answer renders to no token beyond the shared prompt"
            if not skip_bad:
                raise UserError(f"{line} (or pass --skip-bad-lines)")
            skipped.append(line)
            continue
        report.tokens_longest = max(report.tokens_longest, len(prompt) + max(map(len, answers)))
        prompt, answers, done = fit_pair(prompt, answers, fit)
        if done == "drop":
            report.dropped += 1
            continue
        if len(answers) == 2 and answers[0] == answers[1]:  # cut to the same tokens: nothing left to prefer
            report.identical_after_cut += 1
            report.dropped += 1
            continue
        setattr(report, done, getattr(report, done) + 1)
        row = {"prompt_ids": prompt, **{f"{k}_ids": a for k, a in zip(keys, answers, strict=True)}}
        if fmt == "kto":
            row["label"] = record["label"]
        rows.append(row)
    if not rows:
        raise UserError(
            f"{where}: no pair fits memory.max_seq_len={fit.max_len} ({report.dropped} dropped, {len(skipped)} "
            "skipped); raise --seq-len or --set preference.prompt_truncation=keep_end"
        )
    if fmt == "kto":
        check_labels([row["label"] for row in rows], where)
    return Dataset.from_list(rows), report, skipped


def check_labels(labels: list[bool], where: str) -> None:
    """KTO data holds good and bad completions: with one label only, KTO's loss has one of its two terms, and the
    run says nothing of it — refused in one line (good completions alone are SFT data)."""
    from lowmem_ft.errors import UserError

    if len(set(labels)) > 1:
        return
    if labels[0]:
        raise UserError(
            f"{where}: every label is true ({len(labels)} completions): KTO learns from good and bad completions; "
            "to learn from good ones only, drop the label column and train SFT on the prompt / completion rows"
        )
    raise UserError(
        f"{where}: every label is false ({len(labels)} completions): KTO needs good completions too (label true)"
    )


def describe_fit(report: FitReport, max_len: int) -> str:
    """One line for the log: what fitting the pairs into max_len did."""
    parts = [f"{report.whole} of {report.samples_in} whole"]
    if report.prompt_cut:
        parts.append(f"{report.prompt_cut} with the prompt cut")
    if report.answers_cut:
        parts.append(f"{report.answers_cut} with the answers cut")
    if report.dropped:
        parts.append(f"{report.dropped} dropped")
    return f"fitted to {max_len} tokens before padding: " + ", ".join(parts) + f" (longest {report.tokens_longest})"
