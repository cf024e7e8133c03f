"""Named chat templates: what `data.chat_template` accepts, for models that ship none or a wrong one.

The one idea: a chat template is data a model family publishes, so the names here are the families' own forms —
ChatML (Qwen), TRL's installed copies of the templates it ships (`trl/chat_templates/*.jinja`: llama3, qwen2_5,
qwen3, gemma, gemma3, phi3, deepseek_r1_distill, ...), and faithful copies of common ones TRL does not ship
(Mistral's `[INST]` form, Llama-2-chat, Granite 3.0), each with a comment saying where the real one is published.
`data.chat_template` also takes the path of a `.jinja` file.

Only ChatML here carries `{% generation %}` markers; the others are the families' templates as they ship. Assistant
tokens of a template without markers are found by `lowmem_ft.data.tokenize` (TRL's training version, else turn by
turn).
"""

from __future__ import annotations

from pathlib import Path

from lowmem_ft.errors import UserError

# ChatML, as Qwen2 uses it, with {% generation %} markers around the assistant content and its end-of-turn token.
CHATML = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Mistral-7B-Instruct-v0.2 / Mixtral-8x7B-Instruct-v0.1 (tokenizer v1), the `chat_template` of their
# tokenizer_config.json on the Hub (mistralai/Mistral-7B-Instruct-v0.2): the system message folded into the first
# user turn, roles must alternate, no generation prompt (the model answers after ` [/INST]`).
MISTRAL = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content'] %}\n"
    "    {%- set loop_messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set loop_messages = messages %}\n"
    "{%- endif %}\n"
    "\n"
    "{{- bos_token }}\n"
    "{%- for message in loop_messages %}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
    "        {{- raise_exception('After the optional system message, conversation roles must alternate "
    "user/assistant/user/assistant/...') }}\n"
    "    {%- endif %}\n"
    "    {%- if message['role'] == 'user' %}\n"
    "        {%- if loop.first and system_message is defined %}\n"
    "            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}\n"
    "        {%- else %}\n"
    "            {{- ' [INST] ' + message['content'] + ' [/INST]' }}\n"
    "        {%- endif %}\n"
    "    {%- elif message['role'] == 'assistant' %}\n"
    "        {{- ' ' + message['content'] + eos_token}}\n"
    "    {%- else %}\n"
    "        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial "
    "optional system message!') }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
)

# Llama-2-chat (meta-llama/Llama-2-7b-chat-hf tokenizer_config.json): `<<SYS>>` inside the first `[INST]`, a BOS
# before every user turn, the answer wrapped in spaces and closed by EOS.
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)

# Granite 3.0 instruct (ibm-granite/granite-3.0-8b-instruct tokenizer_config.json): role headers
# `<|start_of_role|>ROLE<|end_of_role|>`, every turn closed by EOS `<|end_of_text|>` and a newline, tool schemas in an
# `available_tools` turn, tool calls as an `assistant_tool_call` turn and results as `tool_response`. Later Granite
# releases (3.1+) add a dated default system prompt (`strftime_now`), left out here so renderings are reproducible.
GRANITE = (
    "{%- if tools %}\n"
    "    {{- '<|start_of_role|>available_tools<|end_of_role|>\\n' }}\n"
    "    {%- for tool in tools %}\n"
    "    {{- tool | tojson(indent=4) }}\n"
    "    {%- if not loop.last %}\n"
    "        {{- '\\n\\n' }}\n"
    "    {%- endif %}\n"
    "    {%- endfor %}\n"
    "    {{- '<|end_of_text|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] == 'system' %}\n"
    "    {{- '<|start_of_role|>system<|end_of_role|>' + message['content'] + '<|end_of_text|>\\n' }}\n"
    "    {%- elif message['role'] == 'user' %}\n"
    "    {{- '<|start_of_role|>user<|end_of_role|>' + message['content'] + '<|end_of_text|>\\n' }}\n"
    "    {%- elif message['role'] == 'assistant' %}\n"
    "    {{- '<|start_of_role|>assistant<|end_of_role|>' + message['content'] + '<|end_of_text|>\\n' }}\n"
    "    {%- elif message['role'] == 'assistant_tool_call' %}\n"
    "    {{- '<|start_of_role|>assistant<|end_of_role|><|tool_call|>' + message['content'] + '<|end_of_text|>\\n' }}\n"
    "    {%- elif message['role'] == 'tool_response' %}\n"
    "    {{- '<|start_of_role|>tool_response<|end_of_role|>' + message['content'] + '<|end_of_text|>\\n' }}\n"
    "    {%- endif %}\n"
    "    {%- if loop.last and add_generation_prompt %}\n"
    "    {{- '<|start_of_role|>assistant<|end_of_role|>' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}"
)

OWN = {"chatml": CHATML, "mistral": MISTRAL, "llama2": LLAMA2, "granite": GRANITE}
_TRL_SUFFIX = "_chat_template"


def trl_templates() -> dict[str, str]:
    """TRL's installed copies of the families' original templates, by name (`trl.chat_template_utils`)."""
    import trl.chat_template_utils as ctu

    return {
        name.removesuffix(_TRL_SUFFIX): value
        for name, value in vars(ctu).items()
        if name.endswith(_TRL_SUFFIX) and "training" not in name and isinstance(value, str)
    }


def names() -> list[str]:
    return sorted({*OWN, *trl_templates()})


def resolve_template(spec: str) -> tuple[str, str]:
    """(template text, description) for a `data.chat_template` value: a name above, or a `.jinja` file."""
    if spec in OWN:
        return OWN[spec], f"{spec} (lowmem-ft)"
    trl = trl_templates()
    if spec in trl:
        return trl[spec], f"{spec} (TRL's copy)"
    path = Path(spec).expanduser()
    if path.suffix == ".jinja" or path.is_file():
        if not path.is_file():
            raise UserError(f"data.chat_template: {path} does not exist; pass a .jinja file or one of: {_list()}")
        text = path.read_text(encoding="utf-8")
        if not text.strip():
            raise UserError(f"data.chat_template: {path} is empty")
        return text, f"file {path}"
    raise UserError(f"data.chat_template={spec!r} is neither a known template nor a .jinja file; use one of: {_list()}")


def _list() -> str:
    return ", ".join(names())
