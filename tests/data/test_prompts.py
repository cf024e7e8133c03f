"""GRPO's prompt data (data/prompts.py): strings and conversations, extra columns kept, long prompts fitted."""

from __future__ import annotations

import pytest

from devkit import zoo
from lowmem_ft.data.formats import BadLine
from lowmem_ft.data.prompts import convert, fit_prompts, prompt_ids
from lowmem_ft.data.readers import rename

GSM8K_ROW = {
    "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72",
}


@pytest.fixture(scope="module", params=zoo.NAMES)  # every zoo family's tokenizer and chat template
def tokenizer(request):
    return zoo.build_tokenizer(zoo.FAMILIES[request.param])


def test_gsm8k_columns_mapped_and_the_answer_kept():
    record = convert(rename(GSM8K_ROW, {"prompt": "question"}, "data"))
    assert record == {"prompt": GSM8K_ROW["question"], "answer": GSM8K_ROW["answer"]}


def test_conversations_keep_the_user_turn_last():
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    assert convert({"prompt": turns, "level": 3}) == {"prompt": turns, "level": 3}
    # a messages conversation with its reference answer: the answer is not part of the prompt
    chat = {"messages": [*turns, {"role": "assistant", "content": "4"}], "answer": "4"}
    assert convert(chat) == {"prompt": turns, "answer": "4"}


@pytest.mark.parametrize(
    "record, message",
    [
        ({"question": "x"}, "missing field 'prompt'.*data.columns=\\{prompt: question\\}"),
        ({"prompt": "  "}, "'prompt' is empty"),
        ({"prompt": 3}, "'prompt' must be a string or a list of turns, not int"),
        ({"prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, "end with a user"),
    ],
)
def test_bad_records_name_the_field(record, message):
    with pytest.raises(BadLine, match=message):
        convert(record)


def test_prompt_ids_as_trl_makes_them(tokenizer):
    """Strings with the tokenizer's special tokens; conversations through the template with the generation prompt
    (TRL 1.16 GRPOTrainer._tokenize_prompts)."""
    assert prompt_ids(tokenizer, "2+2?") == tokenizer(text="2+2?")["input_ids"]
    turns = [{"role": "user", "content": "2+2?"}]
    text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    assert prompt_ids(tokenizer, turns) == tokenizer(text=text, add_special_tokens=False)["input_ids"]


def test_long_prompts_cut_or_dropped_and_counted(tokenizer):
    long = " ".join(["the cat sat on the mat"] * 20)
    rows = [{"prompt": "2+2?", "answer": "4"}, {"prompt": long, "answer": "x"}]
    n_long = len(prompt_ids(tokenizer, long))
    kept, fit = fit_prompts(rows, tokenizer, 16, "keep_end")
    assert (fit.kept, fit.cut, fit.dropped) == (2, 1, 0) and n_long > 16
    assert all(len(prompt_ids(tokenizer, r["prompt"])) <= 16 for r in kept)
    assert kept[1]["answer"] == "x" and long.endswith(kept[1]["prompt"].strip()[-10:])
    start, _ = fit_prompts(rows, tokenizer, 16, "keep_start")
    assert long.startswith(start[1]["prompt"].strip()[:10])
    dropped, fit = fit_prompts(rows, tokenizer, 16, "drop")
    assert [r["answer"] for r in dropped] == ["4"] and (fit.kept, fit.dropped) == (1, 1)
    assert "1 longer than 16 left out" in fit.describe(16)
    _, unlimited = fit_prompts(rows, tokenizer, 0)
    assert unlimited.longest == n_long and unlimited.cut == unlimited.dropped == 0


def test_long_conversations_lose_their_oldest_turns(tokenizer):
    old = [{"role": "user", "content": "tell me a long story " * 10}, {"role": "assistant", "content": "ok " * 30}]
    last = [{"role": "user", "content": "2+2?"}]
    limit = len(prompt_ids(tokenizer, last)) + 2
    [kept], fit = fit_prompts([{"prompt": old + last}], tokenizer, limit)
    assert kept["prompt"] == last and fit.cut == 1
    _, fit = fit_prompts([{"prompt": old + last}], tokenizer, 3)  # not even the last turn fits
    assert fit.dropped == 1
