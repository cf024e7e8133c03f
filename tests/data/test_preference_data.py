"""Preference data (lowmem_ft/data/preference.py): the Hub's shapes, every zoo template, bad pairs, fitting."""

from __future__ import annotations

import pytest

from lowmem_ft.data.formats import BadLine
from lowmem_ft.data.preference import PairFit, convert, fit_pair, tokenize_pairs
from lowmem_ft.errors import UserError

USER = [{"role": "user", "content": "What colour is the sky?"}]
ANSWERS = ("Blue, mostly.", "Green, surely.")
SHAPES = {
    "strings": {"prompt": "What colour is the sky?", "chosen": " Blue, mostly.", "rejected": " Green, surely."},
    "anthropic_hh": {
        "chosen": "\n\nHuman: What colour is the sky?\n\nAssistant: Blue, mostly.",
        "rejected": "\n\nHuman: What colour is the sky?\n\nAssistant: Green, surely.",
    },
    "ultrafeedback_binarized": {
        "prompt": "What colour is the sky?",
        "chosen": [*USER, {"role": "assistant", "content": ANSWERS[0]}],
        "rejected": [*USER, {"role": "assistant", "content": ANSWERS[1]}],
    },
    "trl_explicit": {
        "prompt": USER,
        "chosen": [{"role": "assistant", "content": ANSWERS[0]}],
        "rejected": [{"role": "assistant", "content": ANSWERS[1]}],
    },
    "system_column": {
        "system": "Be brief.",
        "chosen": [*USER, {"role": "assistant", "content": ANSWERS[0]}],
        "rejected": [*USER, {"role": "assistant", "content": ANSWERS[1]}],
    },
}


def test_implicit_prompt_is_the_shared_turns():
    out = convert(SHAPES["ultrafeedback_binarized"], "preference")
    assert out["prompt"] == USER
    assert out["chosen"] == [{"role": "assistant", "content": ANSWERS[0]}]
    hh = convert(SHAPES["anthropic_hh"], "preference")
    assert hh["prompt"].endswith("Assistant:") and hh["chosen"].strip() == ANSWERS[0]
    with_system = convert(SHAPES["system_column"], "preference")
    assert with_system["prompt"][0] == {"role": "system", "content": "Be brief."}


@pytest.mark.parametrize(
    ("record", "says"),
    [
        ({"prompt": "Hi?", "chosen": "Hello."}, "missing field 'rejected'"),
        ({"prompt": "Hi?", "chosen": "Hello.", "rejected": " "}, "'rejected' is empty"),
        ({"prompt": "Hi?", "chosen": "Hello.", "rejected": "Hello."}, "identical"),
        ({"prompt": "Hi?", "chosen": "Hello.", "rejected": [{"role": "assistant", "content": "x"}]}, "both"),
        ({"chosen": [{"role": "assistant", "content": "a"}], "rejected": [{"role": "assistant", "content": "b"}]},
         "share no prompt turn"),
        # issue 32: string pairs that share no text and have no prompt column trained on an empty prompt
        ({"chosen": "Yes, gladly.", "rejected": "No."}, "share no prompt text and there is no 'prompt' column"),
    ],
)  # fmt: skip
def test_bad_pairs_are_one_line(record, says):
    with pytest.raises(BadLine, match=says):
        convert(record, "preference")


@pytest.mark.parametrize("label", ["yes", 1, None])
def test_kto_label_must_be_a_boolean(label):
    with pytest.raises(BadLine, match="boolean"):
        convert({"prompt": "Hi?", "completion": "Hello.", "label": label}, "kto")


def test_every_zoo_template_and_shape_gives_the_answers_as_sft_masks_them(zoo_models):
    """The answer tokens decode to what the assistant said (and its end of turn); the prompt is shared; the
    conversational shapes agree with each other token for token."""
    from lowmem_ft.data.tokenize import load_tokenizer

    for name, path in zoo_models.items():
        tokenizer = load_tokenizer(path)
        rows = {}
        for shape, record in SHAPES.items():
            try:
                ds, report, skipped = tokenize_pairs([convert(record, "preference")], "preference", tokenizer,
                                                     PairFit(128), where=shape)  # fmt: skip
            except UserError as exc:  # Gemma's templates refuse a system turn, as they do for SFT: one line
                assert shape == "system_column" and "sample 1: the chat template rejects it" in str(exc)
                continue
            assert report.whole == 1 and not skipped
            row = rows[shape] = ds[0]
            for ids, said in zip((row["chosen_ids"], row["rejected_ids"]), ANSWERS, strict=True):
                text = tokenizer.decode(ids)
                assert said in text, (name, shape, text)
                assert "colour" not in text, (name, shape, text)  # the prompt is not in the answer
        assert rows["ultrafeedback_binarized"] == rows["trl_explicit"], name


def test_fitting_cuts_the_prompt_first_then_the_answers():
    prompt, answers = list(range(100)), [list(range(1000, 1030)), list(range(2000, 2010))]
    p, (c, r), done = fit_pair(prompt, answers, PairFit(64))
    assert done == "prompt_cut" and p == prompt[-34:] and c == answers[0] and r == answers[1]
    p, (c, r), done = fit_pair(prompt, answers, PairFit(64, "keep_start", max_prompt_len=16))
    assert p == prompt[:34] and len(c) == 30  # the answers fit beside a prompt cut to max_len - longest answer
    p, (c, _), done = fit_pair(list(range(10)), [list(range(200)), [1]], PairFit(64))
    assert done == "answers_cut" and len(p) == 10 and len(c) == 54
    assert fit_pair(prompt, answers, PairFit(64, "drop"))[2] == "drop"
    assert fit_pair(prompt[:10], answers, PairFit(64))[2] == "whole"
