"""Assistant-only loss on every zoo template: the loss tokens are exactly what the assistant says, nothing else."""

from __future__ import annotations

import json

import pytest

from devkit.zoo import FAMILIES, MISTRAL_V3, NAMES
from lowmem_ft.data import tokenize as tk
from lowmem_ft.data.formats import convert
from lowmem_ft.data.readers import load_file
from lowmem_ft.errors import UserError
from tests.data.conftest import fixture

CHAT_FILES = {"messages": "messages.jsonl", "sharegpt": "sharegpt.jsonl", "alpaca": "alpaca.jsonl"}
NO_SYSTEM_ROLE = {"gemma2"}  # Gemma's template raises "System role not supported"


def _records(fmt: str, family: str) -> list[dict]:
    records = load_file(fixture(CHAT_FILES[fmt])).records
    if family in NO_SYSTEM_ROLE:
        records = [r for r in records if r["messages"][0]["role"] != "system"]
    return records


def _loss_runs(tokenizer, row) -> list[str]:
    """Each contiguous run of loss tokens, decoded."""
    runs, current = [], []
    for token, label in zip(row["input_ids"], row["labels"], strict=True):
        if label == -100:
            if current:
                runs.append(current)
            current = []
        else:
            assert label == token
            current.append(token)
    if current:
        runs.append(current)
    return [tokenizer.decode(run) for run in runs]


def _expected(family: str, turns: list[dict], ends: bool, strip: bool = False) -> str:
    """What the loss must cover: each assistant turn as the family's template renders what the model generates
    (`strip`: without the leading space a SentencePiece decoder drops)."""
    reply = FAMILIES[family].reply
    texts = [reply(m["content"], ends and i == len(turns) - 1) for i, m in enumerate(turns)]
    return "".join(t.lstrip(" ") if strip else t for t in texts)


@pytest.mark.parametrize("fmt", sorted(CHAT_FILES))
@pytest.mark.parametrize("family", NAMES)
def test_loss_tokens_are_the_assistant_turns_exactly(zoo_models, family, fmt):
    tokenizer = tk.load_tokenizer(zoo_models[family])
    records = _records(fmt, family)
    ds = tk.tokenize_records(records, fmt, tokenizer, train_on_prompt=False)
    split = "source" in ds.column_names
    assert split == ("rewrites" in FAMILIES[family].tags and fmt == "sharegpt")  # multi-turn data only
    rows = list(ds)
    sources = ds["source"] if split else list(range(len(records)))
    turn_of = {}  # row → the assistant turns it trains
    for row_index, source in enumerate(sources):
        assistants = [m for m in records[source]["messages"] if m["role"] == "assistant"]
        if split:
            k = sources[:row_index].count(source)
            turn_of[row_index] = ([assistants[k]], True)
        else:
            turn_of[row_index] = (assistants, records[source]["messages"][-1]["role"] == "assistant")
    bos = tokenizer.bos_token_id
    for row_index, row in enumerate(rows):
        turns, ends = turn_of[row_index]
        decoded = "".join(run.lstrip(" ") for run in _loss_runs(tokenizer, row))
        assert decoded == _expected(family, turns, ends, strip=True)
        assert row["labels"][0] == -100  # the prompt starts every sample
        if bos is not None and FAMILIES[family].tokens.add_bos and family != "granite":
            assert row["input_ids"].count(bos) <= 1  # BOS from the template only, not again from the tokenizer


@pytest.mark.parametrize("family", NAMES)
def test_loss_text_is_exact_in_the_rendered_text(zoo_models, family):
    """The same check by character offsets (no decoder involved): spaces included, e.g. Mistral's ` answer</s>`."""
    from lowmem_ft.data.chat import Renderer, chat_template_for, samples, set_template

    tokenizer = tk.load_tokenizer(zoo_models[family])
    template = chat_template_for(tokenizer, False, set_template(tokenizer, None))
    record = _records("alpaca", family)[1]
    ((text, spans),) = samples(record, Renderer(tokenizer, template))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    from lowmem_ft.data.chat import labels_for

    labels = labels_for(enc["input_ids"], enc["offset_mapping"], text, spans, template.masking)
    covered = "".join(text[a:b] for (a, b), label in zip(enc["offset_mapping"], labels, strict=True) if label != -100)
    assert covered == _expected(family, [record["messages"][-1]], True)


def test_train_on_prompt_keeps_every_token(zoo_models):
    tokenizer = tk.load_tokenizer(zoo_models["mistral"])
    row = tk.tokenize_records(_records("alpaca", "mistral"), "alpaca", tokenizer, train_on_prompt=True)[0]
    assert row["labels"] == row["input_ids"]


def test_template_that_drops_the_system_message_is_refused(zoo_models):
    """Mistral v0.3's rule keeps the system message only when a user turn is last: training text would lose it."""
    tokenizer = tk.load_tokenizer(zoo_models["mistral"])
    tokenizer.chat_template = MISTRAL_V3
    records = load_file(fixture("messages.jsonl")).records
    with pytest.raises(UserError, match=r"^d: sample 2: message 3 \(assistant\).*data.train_on_prompt=true$") as info:
        tk.tokenize_records(records, "messages", tokenizer, train_on_prompt=False, where="d")
    assert "\n" not in str(info.value)
    no_system = [r for r in records if r["messages"][0]["role"] != "system"]  # without one it is prefix-stable
    assert len(tk.tokenize_records(no_system, "messages", tokenizer, train_on_prompt=False)) == len(no_system)


def test_template_refusing_a_role_names_the_sample(zoo_models):
    tokenizer = tk.load_tokenizer(zoo_models["gemma2"])
    records = load_file(fixture("messages.jsonl")).records
    with pytest.raises(UserError, match=r"sample 2: the chat template rejects it \(System role not supported\)"):
        tk.tokenize_records(records, "messages", tokenizer, train_on_prompt=False)


def test_template_failing_in_python_names_the_sample(zoo_models):
    """A Python error inside the template's own expressions (`tojson` of an undefined field, adding a number to a
    string) is the sample's one-line error, not a traceback."""
    tokenizer = tk.load_tokenizer(zoo_models["qwen2.5"])
    tokenizer.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}{{ m.meta | tojson }}\n{% endfor %}"
    records = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    with pytest.raises(UserError, match=r"sample 1: the chat template fails on it \(TypeError: .*JSON serializable\)"):
        tk.tokenize_records(records, "messages", tokenizer, train_on_prompt=False)


def test_reasoning_rewrite_trains_each_turn_as_seen_at_inference(zoo_models):
    """Qwen3's template (unknown to TRL after a one-line edit) drops the reasoning of turns before the last user
    query: each assistant turn becomes its own sample, its reasoning kept, the earlier turn as context only."""
    tokenizer = tk.load_tokenizer(zoo_models["qwen3-finetune"])
    messages = [
        {"role": "user", "content": "What is 2 plus 3?"},
        {"role": "assistant", "content": "<think>two and three</think>2 plus 3 is 5."},
        {"role": "user", "content": "And the colour?"},
        {"role": "assistant", "content": "<think>any</think>red."},
    ]
    ds = tk.tokenize_records([{"messages": messages}], "messages", tokenizer, train_on_prompt=False)
    assert len(ds) == 2 and ds["source"] == [0, 0]
    first, second = (_loss_runs(tokenizer, row) for row in ds)
    assert first == ["<think>\ntwo and three\n</think>\n\n2 plus 3 is 5.<|im_end|>"]
    assert second == ["<think>\nany\n</think>\n\nred.<|im_end|>"]
    assert "two and three" not in tokenizer.decode(ds[1]["input_ids"])  # dropped from the context, as at inference
    assert "2 plus 3 is 5." in tokenizer.decode(ds[1]["input_ids"])


TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]  # fmt: skip
TOOL_RECORD = {
    "tools": TOOLS,
    "messages": [
        {"role": "user", "content": "What is 2 plus 3?"},
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2}}}]},
        {"role": "tool", "content": "five", "name": "add"},
        {"role": "assistant", "content": "2 plus 3 is 5."},
    ],
}


@pytest.mark.parametrize("family", ["qwen2.5", "qwen3", "llama3"])
def test_tool_calls_and_results_go_through_the_template(zoo_models, family):
    record = convert(TOOL_RECORD, "messages")
    assert record["messages"][2]["role"] == "tool" and record["tools"] == TOOLS
    tokenizer = tk.load_tokenizer(zoo_models[family])
    (row,) = tk.tokenize_records([record], "messages", tokenizer, train_on_prompt=False)
    text = tokenizer.decode(row["input_ids"])
    loss = "".join(_loss_runs(tokenizer, row))
    assert "five" in text and "five" not in loss  # the tool's result is context, not learned
    assert '"add"' in loss and '"a": 2' in loss  # the call is what the assistant says
    assert loss.endswith(FAMILIES[family].reply("2 plus 3 is 5.", True))
    assert "Add two numbers." in text and "Add two numbers." not in loss  # the schema reaches the template


@pytest.mark.parametrize("family", ["granite", "llama-zephyr"])
def test_template_that_drops_tool_messages_is_refused(zoo_models, family):
    """Granite 3.0 and Zephyr render no `tool` role: the result would vanish from the training text. Nor do they
    render tool calls (content only) — found first, though the call's name "add" is in Granite's tool schemas."""
    tokenizer = tk.load_tokenizer(zoo_models[family])
    with pytest.raises(UserError, match=r"sample 1: the chat template drops the tool calls of message 2 \(assistant"):
        tk.tokenize_records([convert(TOOL_RECORD, "messages")], "messages", tokenizer, train_on_prompt=False)
    record = json.loads(json.dumps(TOOL_RECORD))
    record["messages"][1] = {"role": "assistant", "content": "Adding."}
    with pytest.raises(UserError, match=r"sample 1: the chat template drops message 3 \(tool\)"):
        tk.tokenize_records([convert(record, "messages")], "messages", tokenizer, train_on_prompt=False)


def test_chat_template_key_names_a_template(zoo_models, tmp_path):
    tokenizer = tk.load_tokenizer(zoo_models["llama-zephyr"], chat_template="llama2")
    ds = tk.tokenize_records(_records("alpaca", "llama-zephyr"), "alpaca", tokenizer, train_on_prompt=False)
    assert tokenizer.decode(ds[0]["input_ids"]).startswith("<s>[INST] Spell the word. [/INST]")
    assert _loss_runs(tokenizer, ds[0]) == ["R E D </s>"]  # Llama-2-chat: ' ' + answer + ' ' + EOS
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}")
    tokenizer = tk.load_tokenizer(zoo_models["llama-zephyr"], chat_template=str(jinja))
    assert tokenizer.lowmem_template_source == f"data.chat_template: file {jinja}"
    with pytest.raises(UserError, match=r"data.chat_template='nope' is neither a known template.*mistral"):
        tk.load_tokenizer(zoo_models["llama-zephyr"], chat_template="nope")


def test_tool_calls_survive_the_dataset_unchanged(zoo_models):
    """Arguments with different keys per row must not gain each other's keys (Arrow unifies nested structs)."""
    tokenizer = tk.load_tokenizer(zoo_models["qwen2.5"])
    records = [convert(TOOL_RECORD, "messages"), json.loads(json.dumps(convert(TOOL_RECORD, "messages")))]
    records[1]["messages"][1]["tool_calls"][0]["function"]["arguments"] = {"b": 3}
    rows = tk.tokenize_records(records, "messages", tokenizer, train_on_prompt=False)
    assert '"arguments": {"a": 2}}' in tokenizer.decode(rows[0]["input_ids"])
    assert '"arguments": {"b": 3}}' in tokenizer.decode(rows[1]["input_ids"])


def test_template_that_drops_tool_calls_is_refused(zoo_models):
    """ChatML (and Granite 3.0, Phi-3, DeepSeek-R1's template with a content of "") renders an assistant turn's
    content only: a tool-call turn would become an empty turn, and the model would learn to answer nothing."""
    tokenizer = tk.load_tokenizer(zoo_models["qwen2.5"], chat_template="chatml")
    with pytest.raises(UserError, match=r"sample 1: the chat template drops the tool calls of message 2 \(assistant"):
        tk.tokenize_records([convert(TOOL_RECORD, "messages")], "messages", tokenizer, train_on_prompt=False)
    with pytest.raises(UserError, match=r"drops the tool calls of message 2"):  # training on every token loses it too
        tk.tokenize_records([convert(TOOL_RECORD, "messages")], "messages", tokenizer, train_on_prompt=True)


def test_tool_call_arguments_given_as_a_json_string_are_learned_as_an_object(zoo_models):
    """OpenAI's format (and most tool-use data sets) gives `arguments` as a JSON string; templates that write
    `arguments | tojson` (Qwen2.5, Llama 3) would teach the model a quoted, escaped string instead of the object."""
    record = json.loads(json.dumps(TOOL_RECORD))
    record["messages"][1]["tool_calls"][0]["function"]["arguments"] = '{"a": 2}'
    tokenizer = tk.load_tokenizer(zoo_models["qwen2.5"])
    (row,) = tk.tokenize_records([convert(record, "messages")], "messages", tokenizer, train_on_prompt=False)
    assert '"arguments": {"a": 2}}' in "".join(_loss_runs(tokenizer, row))


def _r1_finetune() -> str:
    """DeepSeek-R1-Distill's template as community fine-tunes ship it (one comment added: TRL no longer knows it):
    it strips everything up to `</think>` from every assistant message, and its generation prompt opens `<think>`."""
    import trl.chat_template_utils as ctu

    return "{#- fine-tuned from R1-Distill -#}" + ctu.deepseek_r1_distill_chat_template


R1_RECORD = {
    "messages": [
        {"role": "user", "content": "What is 2 plus 3?"},
        {"role": "assistant", "content": "<think>\ntwo and three\n</think>\n\n2 plus 3 is 5."},
    ]
}


def test_template_whose_prompt_the_turn_does_not_continue_says_where(zoo_models):
    """The refusal shows where the inference prompt and the training text part (here R1's `<think>` opening),
    rather than only naming the system-message case."""
    tokenizer = tk.load_tokenizer(zoo_models["qwen2.5"])
    tokenizer.chat_template = _r1_finetune()
    with pytest.raises(UserError, match=r"sample 1: message 2 \(assistant\).*<think>\\n.*2 plus 3 is 5") as info:
        tk.tokenize_records([R1_RECORD], "messages", tokenizer, train_on_prompt=False)
    assert "\n" not in str(info.value)


def test_template_that_strips_the_assistants_reasoning_is_refused(zoo_models):
    """Training on every token with R1's template would learn the answers without the reasoning the data has."""
    tokenizer = tk.load_tokenizer(zoo_models["qwen2.5"])
    tokenizer.chat_template = _r1_finetune()
    with pytest.raises(UserError, match=r"sample 1: the chat template drops part of message 2 \(assistant\)"):
        tk.tokenize_records([R1_RECORD], "messages", tokenizer, train_on_prompt=True)
    tokenizer = tk.load_tokenizer(zoo_models["qwen2.5"], chat_template="deepseek_r1_distill")  # TRL's: it keeps it
    (row,) = tk.tokenize_records([R1_RECORD], "messages", tokenizer, train_on_prompt=False)
    assert "two and three" in "".join(_loss_runs(tokenizer, row))


def test_template_whose_turns_have_no_end_token_is_warned_about(zoo_models, caplog):
    """A template that closes an assistant turn with plain text only (`### Assistant: ...\\n`) gives the model no
    token to learn to stop on: generation would run to max_new_tokens. Every zoo family's template has one."""
    plain = (
        "{% for m in messages %}{% if m['role'] == 'user' %}### User: {{ m['content'] }}\n{% else %}"
        "### Assistant: {{ m['content'] }}\n{% endif %}{% endfor %}{% if add_generation_prompt %}### Assistant:{% endif %}"
    )
    for family in NAMES:
        tokenizer = tk.load_tokenizer(zoo_models[family])
        with caplog.at_level("WARNING", logger="lowmem_ft.data.chat"):
            tk.tokenize_records(_records("alpaca", family), "alpaca", tokenizer, train_on_prompt=False)
    assert "end-of-turn" not in caplog.text
    tokenizer = tk.load_tokenizer(zoo_models["qwen2.5"])
    tokenizer.chat_template = plain
    with caplog.at_level("WARNING", logger="lowmem_ft.data.chat"):
        ds = tk.tokenize_records(_records("alpaca", "qwen2.5"), "alpaca", tokenizer, train_on_prompt=False)
    assert _loss_runs(tokenizer, ds[0]) == [" R E D"]  # trained as it is rendered, nothing appended
    assert "ends an assistant turn with no special token ('\\n')" in caplog.text
    assert "the model will not learn to stop" in caplog.text


GREETING = {
    "messages": [
        {"role": "assistant", "content": "Hello, how can I help?"},
        {"role": "user", "content": "Spell red."},
        {"role": "assistant", "content": "R E D"},
    ]
}


def test_an_opening_assistant_turn_is_learned_without_its_generation_prompt(zoo_models):
    """An assistant turn with nothing before it (a greeting) is cut at the end of the generation prompt too: TRL's
    Qwen2.5 training version opens its markers before the `\\n` of `<|im_start|>assistant\\n`."""
    tokenizer = tk.load_tokenizer(zoo_models["qwen2.5"])
    (row,) = tk.tokenize_records([GREETING], "messages", tokenizer, train_on_prompt=False)
    assert _loss_runs(tokenizer, row) == ["Hello, how can I help?<|im_end|>", "R E D<|im_end|>"]


def test_an_opening_assistant_turn_is_found_where_the_template_cannot_render_an_empty_conversation(zoo_models):
    """Llama 3.2's template (turn by turn: TRL has no training version) reads messages[0]: the opening turn's prompt
    is its own rendering up to the end of the generation prompt — not a jinja index error for the whole sample."""
    tokenizer = tk.load_tokenizer(zoo_models["llama3"])
    (row,) = tk.tokenize_records([GREETING], "messages", tokenizer, train_on_prompt=False)
    assert _loss_runs(tokenizer, row) == ["Hello, how can I help?<|eot_id|>", "R E D<|eot_id|>"]
    tokenizer.chat_template = (  # no generation prompt at all: nothing says where the opening turn starts
        "{{ messages[0]['content'] }}{% for m in messages[1:] %}\n{{ m['role'] }}: {{ m['content'] }}{% endfor %}"
    )
    with pytest.raises(UserError, match=r"sample 1: message 1 \(assistant\) opens the conversation.*no element 0"):
        tk.tokenize_records([GREETING], "messages", tokenizer, train_on_prompt=False)


# ---- data shapes from the Hub: reasoning, per-turn weights, content parts, conversational prompt/completion ------

RENDERS_REASONING = {"qwen3", "qwen3-finetune"}  # Qwen3's template puts reasoning_content inside <think>


def _think(family: str, reasoning: str, content: str, last: bool) -> str:
    """What the loss must cover for an assistant turn with reasoning, on a template that renders it."""
    return FAMILIES[family].reply(content, last).replace("<think>\n\n</think>", f"<think>\n{reasoning}\n</think>")


@pytest.mark.parametrize("key", ["reasoning_content", "thinking"])
@pytest.mark.parametrize("family", NAMES)
def test_reasoning_is_learned_or_the_sample_refused(zoo_models, family, key):
    """A Qwen3 export's `reasoning_content` (or gpt-oss's `thinking`) is learned inside <think> where the template
    renders it, with every turn's reasoning; elsewhere the sample is refused, never trained on the answers alone."""
    tokenizer = tk.load_tokenizer(zoo_models[family])
    messages = [
        {"role": "user", "content": "Spell red."},
        {"role": "assistant", "content": "R E D", key: "three letters"},
        {"role": "user", "content": "Spell blue."},
        {"role": "assistant", "content": "B L U E", key: "four letters"},
    ]
    record = convert({"messages": messages}, "messages")
    if family not in RENDERS_REASONING:
        with pytest.raises(UserError, match=rf"^data: sample 1: the chat template does not render the reasoning of "
                           rf"message 2 \(assistant, '{key}'\).*data.chat_template") as info:  # fmt: skip
            tk.tokenize_records([record], "messages", tokenizer, train_on_prompt=False)
        assert "\n" not in str(info.value)
        echo = convert({"messages": [messages[0], {**messages[1], key: "R E D"}]}, "messages")
        with pytest.raises(UserError, match=r"does not render the reasoning"):  # not fooled by the answer's text
            tk.tokenize_records([echo], "messages", tokenizer, train_on_prompt=True)
        return
    rows = tk.tokenize_records([record], "messages", tokenizer, train_on_prompt=False)
    loss = ["".join(_loss_runs(tokenizer, row)) for row in rows]
    assert "".join(loss) == _think(family, "three letters", "R E D", False) + _think(
        family, "four letters", "B L U E", True
    )
    assert len(rows) == (2 if "rewrites" in FAMILIES[family].tags else 1)


def _weighted(weights: list[int | None]) -> dict:
    turns = [("Spell red.", "R E D"), ("Spell blue.", "B L U E"), ("Spell tan.", "T A N")]
    conversations = []
    for (question, answer), weight in zip(turns, weights, strict=True):
        conversations.append({"from": "human", "value": question})
        conversations.append({"from": "gpt", "value": answer, **({} if weight is None else {"weight": weight})})
    return {"conversations": conversations}


@pytest.mark.parametrize("weights", [[0, None, 1], [None, 0, 1], [1, 1, 0]])
@pytest.mark.parametrize("family", NAMES)
def test_a_turn_of_weight_0_carries_no_loss(zoo_models, family, weights):
    """Axolotl's per-turn weight on every masking path (generation markers, TRL training templates, turn by turn,
    one sample per turn): the loss is exactly the turns of weight 1 (or none given), as the family renders them."""
    tokenizer = tk.load_tokenizer(zoo_models[family])
    record = convert(_weighted(weights), "sharegpt")
    rows = tk.tokenize_records([record], "sharegpt", tokenizer, train_on_prompt=False)
    answers = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
    trained = [{"content": a} for a, w in zip(answers, weights, strict=True) if w != 0]
    loss = "".join(run.lstrip(" ") for row in rows for run in _loss_runs(tokenizer, row))
    assert loss == _expected(family, trained, weights[-1] != 0, strip=True)
    last = max(k for k, w in enumerate(weights) if w != 0)
    for answer in answers[:last]:  # a turn of weight 0 before a trained one is still there, as context
        assert answer in tokenizer.decode(rows[-1]["input_ids"])


def test_weight_0_with_train_on_prompt_is_refused(zoo_models):
    tokenizer = tk.load_tokenizer(zoo_models["qwen2.5"])
    record = convert(_weighted([0, 1, 1]), "sharegpt")
    with pytest.raises(UserError, match=r"sample 1: message 2 \(assistant\) has weight 0, but data.train_on_prompt=tr"):
        tk.tokenize_records([record], "sharegpt", tokenizer, train_on_prompt=True)


def _parts(*texts: str) -> list[dict]:
    return [{"type": "text", "text": t} for t in texts]


@pytest.mark.parametrize("family", NAMES)
def test_content_parts_render_as_the_model_sees_them(zoo_models, family):
    """Content as a list of text parts (Hub exports of the OpenAI / transformers form): one part trains exactly as
    its string; several reach a template that renders lists (Gemma-3's user and assistant turns) as a list, and
    others as one string joined by newlines — never a Python repr, never nothing (Qwen3's renders a list as '')."""
    tokenizer = tk.load_tokenizer(zoo_models[family])
    plain = {"messages": [{"role": "user", "content": "Spell red."}, {"role": "assistant", "content": "R E D"}]}
    one = {"messages": [{"role": "user", "content": _parts("Spell red.")}, {"role": "assistant", "content": _parts("R E D")}]}  # fmt: skip
    rows = tk.tokenize_records([convert(r, "messages") for r in (plain, one)], "messages", tokenizer, False)
    assert rows[0] == rows[1]
    many = {
        "messages": [
            {"role": "user", "content": _parts("Spell", "red.")},
            {"role": "assistant", "content": _parts("R E D", "Done.")},
        ]
    }
    (row,) = tk.tokenize_records([convert(many, "messages")], "messages", tokenizer, train_on_prompt=False)
    sep = "" if family.startswith("gemma3") else "\n"  # Gemma-3 renders a list's parts trimmed, one after the other
    text = tokenizer.decode(row["input_ids"])
    assert f"Spell{sep}red." in text and "'type'" not in text
    assert "".join(run.lstrip(" ") for run in _loss_runs(tokenizer, row)) == _expected(
        family, [{"content": f"R E D{sep}Done."}], True, strip=True
    )


PROMPT_COMPLETION = {
    "prompt": [
        {"role": "user", "content": "Spell red."},
        {"role": "assistant", "content": "R E D"},
        {"role": "user", "content": "Spell blue."},
    ],
    "completion": [{"role": "assistant", "content": "B L U E"}],
}


@pytest.mark.parametrize("family", NAMES)
def test_conversational_prompt_completion_learns_the_completion_only(zoo_models, family):
    """TRL's conversational prompt/completion (trl-lib data sets): the loss is exactly the completion's assistant
    content and its end of turn; the prompt's earlier assistant turn is context."""
    tokenizer = tk.load_tokenizer(zoo_models[family])
    record = convert(PROMPT_COMPLETION, "chat_prompt_completion")
    (row,) = tk.tokenize_records([record], "chat_prompt_completion", tokenizer, train_on_prompt=False)
    assert "".join(run.lstrip(" ") for run in _loss_runs(tokenizer, row)) == _expected(
        family, PROMPT_COMPLETION["completion"], True, strip=True
    )
    assert "R E D" in tokenizer.decode(row["input_ids"])
    (every,) = tk.tokenize_records([record], "chat_prompt_completion", tokenizer, train_on_prompt=True)
    assert every["labels"] == every["input_ids"]


@pytest.mark.parametrize("family", NAMES)
def test_alpaca_history_answers_are_learned_like_llama_factory(zoo_models, family):
    """LLaMA-Factory's alpaca `history`: its answers carry loss too (LLaMA-Factory's default, mask_history off)."""
    tokenizer = tk.load_tokenizer(zoo_models[family])
    row = {"instruction": "Spell blue.", "output": "B L U E", "history": [["Spell red.", "R E D"]]}
    record = convert(row, "alpaca")
    rows = tk.tokenize_records([record], "alpaca", tokenizer, train_on_prompt=False)
    loss = "".join(run.lstrip(" ") for r in rows for run in _loss_runs(tokenizer, r))
    assert loss == _expected(family, [{"content": "R E D"}], False, True) + _expected(
        family, [{"content": "B L U E"}], True, True
    )


# Numbered turns ("[1] user: ..."), one role left out: what a dropped message says ("1", "a", "add") can be found in
# the rendering by chance — in a turn number, in a role name, in the tool schemas the system header lists.
_NUMBERED = (
    "{% if tools %}[tools] {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{% if m.role != 'DROPPED' %}[{{ loop.index }}] {{ m.role }}: "
    "{{ m.content or m.tool_calls | tojson }}\n{% endif %}{% endfor %}"
)
_TOOL_CALL = [{"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]


@pytest.mark.parametrize(
    ("dropped", "messages", "error"),
    [
        ("tool_calls", [{"role": "user", "content": "Add 1."}, {"role": "assistant", "tool_calls": _TOOL_CALL},
                        {"role": "tool", "content": "1"}, {"role": "assistant", "content": "1"}],
         r"drops the tool calls of message 2 \(assistant: add\)"),
        ("system", [{"role": "system", "content": "a"}, {"role": "user", "content": "Say 2."},
                    {"role": "assistant", "content": "2"}], r"drops message 1 \(system\)"),
        ("system", [{"role": "system", "content": [{"type": "text", "text": "a"}]},
                    {"role": "user", "content": "Say 2."}, {"role": "assistant", "content": "2"}],
         r"drops message 1 \(system\)"),  # content as a list of text parts: each part probed
        ("tool", [{"role": "user", "content": "Add 1."}, {"role": "assistant", "tool_calls": _TOOL_CALL},
                  {"role": "tool", "content": "1"}, {"role": "assistant", "content": "It is 1."}],
         r"drops message 3 \(tool\)"),
        ("user", [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
         r"drops message 1 \(user\)"),
        ("answer", [{"role": "user", "content": "Say 1."}, {"role": "assistant", "content": "1"}],
         r"drops message 2 \(assistant\): what it says is not in the rendered text"),
    ],
)  # fmt: skip
def test_a_dropped_message_is_found_whatever_it_says(zoo_models, dropped, messages, error):
    """The checks render probe strings in place of the contents (and tool names): a short content no longer passes
    because the rendering holds it elsewhere."""
    template = _NUMBERED.replace("'DROPPED'", repr(dropped))
    if dropped == "tool_calls":  # every role kept, the calls left out: ChatML's way, here with the schemas shown
        template = _NUMBERED.replace("m.content or m.tool_calls | tojson", "m.content or ''")
    if dropped == "answer":  # what the assistant says left out
        template = _NUMBERED.replace("m.content or m.tool_calls | tojson", "'' if m.role == 'assistant' else m.content")
    tokenizer = tk.load_tokenizer(zoo_models["qwen2.5"])
    tokenizer.chat_template = template
    record = {"messages": messages, "tools": TOOLS}
    for train_on_prompt in (False, True):
        with pytest.raises(UserError, match=error):
            tk.tokenize_records([record], "messages", tokenizer, train_on_prompt=train_on_prompt)
    tokenizer.chat_template = _NUMBERED  # the same conversation through a template that renders everything
    assert len(tk.tokenize_records([record], "messages", tokenizer, train_on_prompt=False)) == 1


def test_a_dated_template_renders_as_it_would_on_the_pinned_day(monkeypatch):
    """The strftime_now macro changes nothing but the date: each of TRL's dated templates (Llama 3.2, gpt-oss, ...)
    renders exactly what transformers renders on TEMPLATE_DATE, whitespace included; an unknown format is refused."""
    from datetime import datetime

    import transformers.utils.chat_template_utils as ctu
    from jinja2 import TemplateError

    from lowmem_ft.data.chat import TEMPLATE_DATE, pin_template_date
    from lowmem_ft.data.templates import trl_templates

    class PinnedDay(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime(*TEMPLATE_DATE)

    monkeypatch.setattr(ctu, "datetime", PinnedDay)
    dated = {name: text for name, text in trl_templates().items() if "strftime_now" in text}
    assert {"llama3_2", "gptoss"} <= set(dated)
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello."}]  # fmt: skip
    for name, text in dated.items():
        for prompt in (False, True):
            kwargs = {"add_generation_prompt": prompt, "bos_token": "<s>", "eos_token": "</s>"}
            expected = ctu.render_jinja_template([conversation], chat_template=text, **kwargs)[0]
            assert ctu.render_jinja_template([conversation], chat_template=pin_template_date(text), **kwargs)[0] == (
                expected
            ), name
    lead = "\n  {% for m in messages %}{{ m.content }}{% endfor %} {{ strftime_now('%Y') }}"  # leading whitespace
    assert ctu.render_jinja_template([conversation], chat_template=pin_template_date(lead))[0] == [
        "\nBe brief.HiHello. 2024"
    ]
    with pytest.raises(TemplateError, match="only literal formats"):
        ctu.render_jinja_template([conversation], chat_template=pin_template_date("{{ strftime_now(f) }}"))
