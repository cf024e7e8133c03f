"""Chat data through any chat template, with the loss on exactly what the assistant says.

The one idea: the tokens to learn are the ones the model must produce at inference — everything a template renders
after the prompt it is given there (`add_generation_prompt=True`) up to and including the end of the assistant's
turn. Three ways to find them, in order:

1. the template's own `{% generation %}` markers (transformers' generation indices);
2. TRL's training version of a template it recognises (`trl.chat_template_utils.get_training_chat_template`, which
   adds markers; it only knows templates character for character);
3. otherwise, turn by turn: for each assistant turn *i*, render the conversation up to the user's last word with the
   generation prompt (P) and up to the end of turn *i* (Q); the turn is Q minus P. When P and Q are prefixes of the
   whole rendering, the turns are spans of one sample. A template that renders earlier turns differently once later
   ones follow (Qwen3 drops reasoning and the `<think>` block of turns before the last user query) is not
   prefix-stable: then each assistant turn becomes its own sample, rendered exactly as the model sees it at
   inference. A template whose training text does not even start with its inference prompt (Mistral v0.3 drops the
   system message unless the user turn is last) is refused for that sample, with `data.chat_template` /
   `data.train_on_prompt` as the ways out.

Not every assistant turn is learned: one of `weight` 0 (Axolotl's per-turn flag) and, in TRL's conversational
prompt/completion, the prompt's turns are context only; their spans are left out (by markers, each span goes to the
assistant turn whose inference prompt ends before it), and one sample per turn is made only for the learned ones.
What each learned turn says, its reasoning included, must be in its sample's text: a template that does not render
the data's `reasoning_content` is refused for that sample rather than trained on the answers alone.

Whichever way, trailing whitespace after the end-of-turn token (the newline between turns) carries no loss: the model
stops at the end-of-turn token and never generates it. Every system / user / tool message must appear in the rendered
text: a template that drops one (a role it does not know) is an error naming the sample, never a silent loss.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Literal

from lowmem_ft.console import first_time
from lowmem_ft.data.formats import REASONING_KEYS, content_text
from lowmem_ft.errors import UserError

log = logging.getLogger(__name__)

Masking = Literal["markers", "turns", "all"]
IGNORE = -100


@dataclass(frozen=True)
class ChatTemplate:
    """The template chat data is rendered with and how its assistant tokens are found."""

    text: str
    source: str  # for run.json: where the template came from and how assistant tokens are found
    masking: Masking


class SampleError(ValueError):
    """A conversation the template cannot render for training (the message says why). `masking`: the problem is
    only in finding the assistant tokens, so training on every token (`data.train_on_prompt`) would avoid it;
    `fix`: the way out, where it is neither that nor another template."""

    def __init__(self, message: str, masking: bool = False, fix: str | None = None):
        super().__init__(message)
        self.masking = masking
        self.fix = fix


def set_template(tokenizer, spec: str | None) -> str:
    """Give the tokenizer the chat template `data.chat_template` names (so it is saved with the adapter and used by
    `generate`), or ChatML when it has none; returns where the template came from."""
    from lowmem_ft.data.templates import CHATML, resolve_template

    if spec:
        text, what = resolve_template(spec)
        tokenizer.chat_template = text
        tokenizer.lowmem_template_source = f"data.chat_template: {what}"
        return tokenizer.lowmem_template_source
    if getattr(tokenizer, "lowmem_template_source", None):  # set from data.chat_template, or ChatML given before
        return tokenizer.lowmem_template_source
    if isinstance(tokenizer.chat_template, dict):  # named variants: "default" is the chat one
        tokenizer.chat_template = tokenizer.chat_template.get("default") or next(iter(tokenizer.chat_template.values()))
    if tokenizer.chat_template:
        return "tokenizer"
    tokenizer.chat_template = CHATML
    tokenizer.lowmem_template_source = "ChatML (default)"  # a later call (another source, the cache) says the same
    if first_time("no chat template", getattr(tokenizer, "name_or_path", "")):  # the plan and the run load it each
        log.warning(
            "the tokenizer has no chat template; formatting chat data as ChatML (set data.chat_template to choose)"
        )
    return tokenizer.lowmem_template_source


def chat_template_for(tokenizer, train_on_prompt: bool, source: str = "tokenizer") -> ChatTemplate:
    """How this tokenizer's chat template (already set by `set_template`) is trained on."""
    template = _chat_template_for(tokenizer, train_on_prompt, source)
    _warn_without_end_token(tokenizer, template)
    return template


def _warn_without_end_token(tokenizer, template: ChatTemplate) -> None:
    """Warn when the template closes an assistant turn with no special token: the loss ends with the turn's text,
    so the model never learns a token to stop on. Trained as rendered (appending EOS would change the format the
    template defines); the way out is a template with an end-of-turn token (`data.chat_template`)."""
    said = "Hello there."
    try:
        text = Renderer(tokenizer, template)(
            [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": said}]
        )
    except SampleError:  # a template that needs more (a system message, tools): the data will tell
        return
    if said not in text:
        return
    tail = text[text.rindex(said) + len(said) :]
    specials = [t for t in {*tokenizer.all_special_tokens, *tokenizer.get_added_vocab()} if t]
    if not any(t in tail for t in specials) and first_time("no end-of-turn token", template.text):
        log.warning(
            "the chat template (%s) ends an assistant turn with no special token (%r): the model will not learn to "
            "stop, and generation runs to max_new_tokens; set data.chat_template to a template with an end-of-turn "
            "token",
            template.source.split(";")[0],
            tail,
        )


def _chat_template_for(tokenizer, train_on_prompt: bool, source: str) -> ChatTemplate:
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    text = tokenizer.chat_template
    if train_on_prompt:
        return ChatTemplate(text, f"{source}; loss on every token", "all")
    if has_generation_markers(text):
        return ChatTemplate(text, f"{source}; assistant tokens from its generation markers", "markers")
    try:
        patched = get_training_chat_template(tokenizer)
    except (ValueError, TypeError, LookupError, AttributeError):  # TRL does not know this template, or the template
        # fails on TRL's probe messages (a Python error in its expressions: our renderer names it per sample)
        return ChatTemplate(text, f"{source}; assistant tokens found turn by turn", "turns")
    if patched is None:  # cannot happen without markers; kept for TRL versions that answer differently
        return ChatTemplate(text, f"{source}; assistant tokens found turn by turn", "turns")
    return ChatTemplate(patched, f"{source} (TRL training version); assistant tokens from its markers", "markers")


# The date a template's `strftime_now` renders for training: Llama 3.2 (and Granite 3.1+, gpt-oss) put today's date in
# every system header ("Today Date: ..."), which would make the tokens depend on the day — a cache from yesterday
# against a fresh tokenization today, a resumed run, a conversation whose prompt and turn straddle midnight. Pinned to
# the date Meta's Llama 3.x templates fall back to without `strftime_now` (and Llama 3.1's always renders). At
# inference the template renders the day's date; it sits in the system header, which carries no loss.
TEMPLATE_DATE = (2024, 7, 26)


def pin_template_date(text: str) -> str:
    """The template with `strftime_now` rendering TEMPLATE_DATE: a macro of that name, defined before the template,
    shadows transformers' Jinja global (render arguments cannot: transformers turns a callable argument into a
    string). Templates call it with literal formats; a format not found in the text is refused, never rendered
    empty. The macro's line ends in a newline that Jinja's trim_blocks removes, so the template renders unchanged."""
    import re
    from datetime import datetime

    if "strftime_now" not in text:
        return text
    calls = re.findall(r"""strftime_now\(\s*(?:'([^'\\]*)'|"([^"\\]*)")\s*\)""", text)
    dates = {fmt: datetime(*TEMPLATE_DATE).strftime(fmt) for fmt in {a or b for a, b in calls}}
    table = json.dumps(dict(sorted(dates.items())), ensure_ascii=False)  # a JSON object is a Jinja dict literal
    return (
        "{% macro strftime_now(format) %}{% set dates = " + table + " %}{% if format in dates %}{{ dates[format] }}"
        "{% else %}{{ raise_exception('strftime_now(' ~ format ~ '): lowmem-ft renders a fixed date for training "
        "and finds only literal formats') }}{% endif %}{% endmacro %}\n" + text
    )


class Renderer:
    """Renders conversations with one template and the tokenizer's special tokens, as `apply_chat_template` does.

    A turn's content given as a list of text parts reaches the template as a list where the template renders every
    part of a list for that role (Gemma-3's user and assistant turns); elsewhere as one string, the parts joined by a
    newline, which is what an OpenAI-compatible server such as vLLM gives a template that takes strings (Qwen2.5 or
    Mistral would fail on a list; Qwen3's renders a list as nothing, TRL's Llama-3.2 copy as its Python repr). Either
    way a single text part renders as its string would. The assistant's reasoning reaches the template under the
    key it renders (`reasoning_content` for Qwen3, `thinking` for gpt-oss) when it renders another than the data's.
    The template's date is pinned (`pin_template_date`).
    """

    def __init__(self, tokenizer, template: ChatTemplate):
        self.template = template
        self.text = pin_template_date(template.text)
        self.kwargs = dict(tokenizer.special_tokens_map)
        self._list_roles: set[str] | None = None
        self._reasoning_keys: list[str] | None = None

    def __call__(self, messages: list[dict], tools: Any = None, *, prompt: bool = False, indices: bool = False):
        return self._render([self._for_template(m) for m in messages], tools, prompt=prompt, indices=indices)

    def _render(self, messages: list[dict], tools: Any = None, *, prompt: bool = False, indices: bool = False):
        from jinja2 import TemplateError
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            rendered, generation = render_jinja_template(
                [messages],
                tools=tools,
                chat_template=self.text,
                return_assistant_tokens_mask=indices,
                add_generation_prompt=prompt,
                **self.kwargs,
            )
        except TemplateError as exc:  # raise_exception(...) in the template, or a template bug
            raise SampleError(f"the chat template rejects it ({exc})") from None
        except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as exc:  # Python errors inside
            # the template's own expressions: `x | tojson` of an undefined value, `content + 1`, ...
            raise SampleError(f"the chat template fails on it ({type(exc).__name__}: {exc})") from None
        return (rendered[0], generation[0]) if indices else rendered[0]

    def _for_template(self, message: dict) -> dict:
        content = message.get("content")
        if isinstance(content, list) and message["role"] not in self.list_roles():
            message = {**message, "content": content_text(content)}
        given = next((k for k in REASONING_KEYS if k in message), None)
        rendered = self.reasoning_keys() if given else []
        if given and rendered and given not in rendered:
            message = {**{k: v for k, v in message.items() if k != given}, rendered[0]: message[given]}
        return message

    def _probe(self, messages: list[dict]) -> str:
        try:
            return self._render(messages)
        except Exception:  # noqa: BLE001 (a template that cannot take the probe: jinja TypeError, SampleError, ...)
            return ""

    def list_roles(self) -> set[str]:
        """The roles whose content the template renders in full when it is a list of text parts."""
        if self._list_roles is None:
            parts = [{"type": "text", "text": "lowmem-part-one"}, {"type": "text", "text": "lowmem-part-two"}]
            user, answer = {"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}
            probes = {
                "system": [{"role": "system", "content": parts}, user, answer],
                "user": [{"role": "user", "content": parts}, answer],
                "assistant": [user, {"role": "assistant", "content": parts}],
            }
            self._list_roles = set()
            for role, messages in probes.items():
                text = self._probe(messages)
                if all(p["text"] in text for p in parts) and "'type'" not in text and '"type"' not in text:
                    self._list_roles.add(role)
        return self._list_roles

    def reasoning_keys(self) -> list[str]:
        """The reasoning keys (REASONING_KEYS) the template renders on a final assistant turn, in that order."""
        if self._reasoning_keys is None:
            said = "lowmem-probe-reasoning"
            self._reasoning_keys = [
                key
                for key in REASONING_KEYS
                if said
                in self._probe(
                    [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello.", key: said}]
                )
            ]
        return self._reasoning_keys


Sample = tuple[str, list[tuple[int, int]], list[int]]  # text, loss spans, the assistant turns they are


def trained_turns(record: dict) -> list[int]:
    """The assistant turns of a chat record that carry loss: all but those with `weight` 0, and in a conversational
    prompt/completion record only the completion's."""
    start = record.get("completion_from", 0)
    return [
        i
        for i, m in enumerate(record["messages"])
        if m["role"] == "assistant" and i >= start and m.get("weight", 1) != 0
    ]


def samples(record: dict, render: Renderer) -> list[tuple[str, list[tuple[int, int]]]]:
    """(rendered text, character spans that carry the loss) of one conversation: one sample, or one per trained
    assistant turn when the template is not prefix-stable. Raises SampleError."""
    messages, tools = record["messages"], record.get("tools")
    masking = render.template.masking
    trained = trained_turns(record)
    out: list[Sample]
    if masking == "all":
        zero = next((i for i, m in enumerate(messages) if m.get("weight") == 0), None)
        if zero is not None:
            raise SampleError(
                f"message {zero + 1} (assistant) has weight 0, but data.train_on_prompt=true puts the loss on every "
                "token",
                fix="set data.train_on_prompt=false to honour the weights, or drop them",
            )
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        out = [(render(messages, tools), [], [last])]
    elif masking == "markers":
        text, spans = render(messages, tools, indices=True)
        owned = _after_prompts(text, [tuple(s) for s in spans], messages, tools, render)
        if any(turn is None for _, turn in owned) and trained != _assistants(messages):
            raise SampleError(
                "the template's generation markers cannot be matched to the assistant turns, and some turns carry "
                "no loss (weight 0 or the prompt of a prompt/completion record)",
                masking=True,
            )
        out = [(text, [span for span, turn in owned if turn is None or turn in trained], trained)]
    else:
        out = _turns(messages, tools, render, trained)
    _check_nothing_dropped(messages, tools, out, render)
    _check_answers_kept(messages, out, render)
    return [(text, spans) for text, spans, _ in out]


def _assistants(messages: list[dict]) -> list[int]:
    return [i for i, m in enumerate(messages) if m["role"] == "assistant"]


def _after_prompts(text: str, spans: list, messages: list[dict], tools: Any, render: Renderer) -> list:
    """Marker spans cut at the end of each assistant turn's inference prompt — a training template may put part of
    the generation prompt inside its markers (TRL's Qwen2.5 version starts them before the `\\n` of
    `<|im_start|>assistant\\n`), and the model never generates that part —, each with the assistant turn it belongs
    to: the last whose prompt ends at or before it (None where a prompt cannot be placed in the text and the spans
    are not one per turn)."""
    cuts: dict[int, int | None] = {}  # assistant turn → where its inference prompt ends in `text`
    for i in _assistants(messages):
        try:
            prompt = _prompt_before(messages, i, tools, render)
        except SampleError:  # an opening turn the template cannot prompt for: its markers alone say
            cuts[i] = 0 if i == 0 else None
            continue
        cuts[i] = len(prompt) if text.startswith(prompt) else None
    cut_spans = []
    for start, end in spans:
        for cut in cuts.values():
            if cut is not None and start < cut < end:
                start = cut
        cut_spans.append((start, end))
    if all(cut is not None for cut in cuts.values()):
        owners = [max((i for i, cut in cuts.items() if cut <= start), default=min(cuts)) for start, _ in cut_spans]
    elif len(cut_spans) == len(cuts):
        owners = list(cuts)
    else:
        owners = [None] * len(cut_spans)
    return list(zip(cut_spans, owners, strict=True))


def _prompt_before(messages: list[dict], i: int, tools: Any, render: Renderer) -> str:
    """What the model is given at inference before assistant turn `i`: the conversation before it with the generation
    prompt — for a turn that opens the conversation (a greeting), the empty conversation's, or where templates cannot
    render one (Qwen2.5, Llama 3 read messages[0]) the turn's own rendering up to the end of its generation prompt."""
    try:
        return render(messages[:i], tools, prompt=True)
    except SampleError as exc:
        if i:
            raise
        why = str(exc).removeprefix("the chat template rejects it ")
    # the generation prompt is what a one-message conversation gains with add_generation_prompt; the opening turn's
    # prompt is its rendering up to the end of that text (a default system message, then the generation prompt)
    probe = [{"role": "user", "content": "Hi."}]
    bare, asked = render(probe, tools), render(probe, tools, prompt=True)
    generation = asked[len(bare) :] if asked.startswith(bare) else ""
    upto = render(messages[:1], tools)
    at = upto.find(generation) if generation.strip() else -1
    if at < 0:
        raise SampleError(
            "message 1 (assistant) opens the conversation, and the chat template cannot render the prompt before it "
            f"(an empty conversation: {why})",
            masking=True,
        )
    return upto[: at + len(generation)]


def _turns(messages: list[dict], tools: Any, render: Renderer, trained: list[int]) -> list[Sample]:
    """The trained assistant turns' spans found turn by turn (see the module docstring)."""
    full = render(messages, tools)
    turns = []  # (rendering up to the end of the turn, its span there, the turn)
    for i in trained:
        prompt = _prompt_before(messages, i, tools, render)
        upto = render(messages[: i + 1], tools)
        if not upto.startswith(prompt):
            raise SampleError(
                f"message {i + 1} (assistant): the template renders the conversation before this turn differently "
                f"once the turn is added ({_parting(prompt, upto)}; e.g. a system message kept only when a user turn "
                "is last, or a generation prompt that opens a block the rendered turn lacks)",
                masking=True,
            )
        said = upto[len(prompt) :].rstrip()
        if not said.strip():
            raise SampleError(f"message {i + 1} (assistant): the template renders nothing for this turn")
        turns.append((upto, (len(prompt), len(prompt) + len(said)), i))
    if all(full.startswith(upto) for upto, _, _ in turns):
        return [(full, [span for _, span, _ in turns], trained)]
    # Earlier turns are rewritten once later ones follow: train each turn as the model sees it at inference.
    return [(upto, [span], [i]) for upto, span, i in turns]


def _parting(prompt: str, text: str, width: int = 24) -> str:
    """Where the inference prompt and the training text part, for an error message (one line, reprs)."""
    k = len(os.path.commonprefix([prompt, text]))
    start = max(0, k - width)
    return (
        f"the prompt the model sees at inference has {prompt[start : k + width]!r} where the training text has "
        f"{text[start : k + width]!r}"
    )


def _check_nothing_dropped(messages: list[dict], tools: Any, out: list[Sample], render: Renderer) -> None:
    """Every system/user/tool message before the last trained assistant turn, what each trained assistant turn says
    and every assistant tool call must be in the text trained on. Whether the template renders each is asked with a
    probe (`_probe_drops`): a content can be in the rendering by chance ("1" in a turn number, "a" in "assistant", a
    tool's name in the schemas the system header lists). The content itself must be in the real rendering too (Llama
    3.x renders tool output | tojson)."""
    text, _, turns = out[-1]
    last = max(turns, default=len(messages) - 1)
    every = len(out) == 1 and render.template.masking != "all"
    _probe_drops(messages[: last + 1], tools, render, answers=turns if every else turns[-1:])
    for i, message in enumerate(messages[: last + 1]):
        content = message.get("content")
        if message["role"] == "assistant":
            continue
        parts = [p.get("text") for p in content] if isinstance(content, list) else [content]  # images: no text
        for part in parts:
            if not isinstance(part, str) or not part.strip():
                continue
            if part.strip() not in text and json.dumps(part) not in text:  # Llama 3.x renders tool output | tojson
                raise SampleError(
                    f"the chat template drops message {i + 1} ({message['role']}): its content is not in the rendered "
                    "text"
                )
    for i, message in enumerate(messages[: last + 1]):
        names = [call["function"]["name"] for call in message.get("tool_calls") or []]
        if any(name not in text for name in names):  # a template that renders an assistant turn's content only
            raise SampleError(
                f"the chat template drops the tool calls of message {i + 1} (assistant: {', '.join(names)}); "
                "it would learn an empty turn"
            )


def _check_answers_kept(messages: list[dict], out: list[Sample], render: Renderer) -> None:
    """What each trained assistant turn says, and its reasoning, must be in its sample's text, whitespace aside: a
    template may rewrite the assistant's content (DeepSeek-R1's strips everything up to `</think>` from every turn)
    or not render the reasoning the data gives (`reasoning_content` with Llama 3's), and the model would then learn
    the answers without it. With the loss on every token only the last turn is checked: a template may drop earlier
    turns' reasoning by design (Qwen3), as the model sees them at inference."""
    for text, _, turns in out:
        flat = "".join(text.split())
        for i in turns:
            message = messages[i]
            said = "".join(content_text(message.get("content")).split())
            if said and said not in flat:
                raise SampleError(
                    f"the chat template drops part of message {i + 1} (assistant): what it says is not in the "
                    "rendered text (e.g. reasoning before </think> removed)"
                )
            key = next((k for k in REASONING_KEYS if k in message), None)
            # a template that renders no reasoning key at all is refused even where the text happens to be there
            if key and (not render.reasoning_keys() or "".join(message[key].split()) not in flat):
                raise SampleError(
                    f"the chat template does not render the reasoning of message {i + 1} (assistant, '{key}'): the "
                    "model would learn the answer without it",
                    fix="set data.chat_template to a template that renders it (qwen3 renders reasoning_content), or "
                    "put the reasoning in the content as the model should write it",
                )


def _probe_drops(messages: list[dict], tools: Any, render: Renderer, answers: list[int]) -> None:
    """Render the conversation once more with each checked content — and each tool call's function name — replaced
    by a probe string of its own (`lowmemprobe3x`); a probe missing from that rendering is a dropped message. The assistant
    turns checked (`answers`) are those trained as they stand in this rendering: every trained one, or the last when
    each turn is its own sample or the loss is on every token (earlier turns may be rewritten by design, as
    `_check_answers_kept` says).
    A template that rejects the probe reads the contents themselves: then the content checks alone decide."""
    probe, found = [], {}  # probe string → the error its absence means

    def token() -> str:
        return f"lowmemprobe{len(found)}x"

    for i, message in enumerate(messages):
        message = dict(message)
        content = message.get("content")
        checked = message["role"] != "assistant" or i in answers
        what = "what it says" if message["role"] == "assistant" else "its content"
        error = f"the chat template drops message {i + 1} ({message['role']}): {what} is not in the rendered text"
        if checked and isinstance(content, str) and content.strip():
            message["content"] = key = token()
            found[key] = error
        elif checked and isinstance(content, list):  # text parts: each gets a probe of its own
            parts = []
            for part in content:
                if part.get("type") == "text" and str(part.get("text", "")).strip():
                    part = {**part, "text": token()}
                    found[part["text"]] = error
                parts.append(part)
            message["content"] = parts
        if message.get("tool_calls"):
            calls, names = [], [call["function"]["name"] for call in message["tool_calls"]]
            for call in message["tool_calls"]:
                key = token()
                calls.append({**call, "function": {**call["function"], "name": key}})
                found[key] = (
                    f"the chat template drops the tool calls of message {i + 1} (assistant: {', '.join(names)}); "
                    "it would learn an empty turn"
                )
            message["tool_calls"] = calls
        probe.append(message)
    try:
        rendered = render(probe, tools)
    except SampleError:
        return
    for key, error in found.items():
        if key not in rendered:
            raise SampleError(error)


def encode_with_offsets(tokenizer, texts):
    """`tokenizer(texts)` with each token's character offsets, which `labels_for` masks by; a tokenizer that has
    none (a slow, Python one: transformers computes offsets only in the `tokenizers` backend) is one line."""
    if not getattr(tokenizer, "is_fast", False):
        raise UserError(
            f"the model's tokenizer ({type(tokenizer).__name__}) is a slow Python tokenizer, which gives no character "
            "offsets, and lowmem-ft finds the tokens to train on (the assistant's) by them; use a model directory "
            "with a fast tokenizer (tokenizer.json), or text data (--format text), where no token is masked"
        )
    return tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)


def labels_for(ids: list[int], offsets: list[tuple[int, int]], text: str, spans: list[tuple[int, int]], masking):
    """Labels of one tokenized sample: the ids of tokens overlapping a span (as transformers' assistant mask), -100
    elsewhere; trailing whitespace-only tokens of each span are left out."""
    if masking == "all":
        return list(ids)
    labels = [IGNORE] * len(ids)
    k = 0
    for start, end in sorted(spans):
        while k < len(ids) and offsets[k][1] <= start:
            k += 1
        first = k
        while k < len(ids) and offsets[k][0] < end:
            k += 1
        last = k  # tokens first..last-1 overlap the span
        while last > first and text[offsets[last - 1][0] : offsets[last - 1][1]].isspace():
            last -= 1
        labels[first:last] = ids[first:last]
    return labels
