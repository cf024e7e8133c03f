"""The model zoo: tiny random-initialized replicas of the model families users bring, for tests and benchmarks.

Each `Family` keeps what makes its family different where lowmem-ft can trip over it — in the config (tied or untied
embeddings, qkv bias, q/k norms, fused qkv / gate_up projections, sliding windows, attention and final-logit
softcapping, logit and embedding multipliers, head_dim ≠ hidden / heads, a vocabulary large against the width,
embedding rows beyond the tokenizer) and in the tokenizer (the family's chat template as it ships — TRL's installed
copy where TRL has one, else a faithful copy citing where the real one is published —, its special tokens, no pad
token where the family has none, BOS added by the tokenizer *and* the template, an end-of-turn token distinct from
EOS, SentencePiece-style `▁` pre-tokenization or GPT-2 byte-level BPE). Widths are tiny (hidden 64, 2 layers) so
that every family builds in well under a second and trains in a few seconds on a CPU.

    path = build("gemma2", tmp_dir)          # config.json + safetensors + tokenizer, loadable with from_pretrained
    FAMILIES["gemma2"].reply("Hi.", last=True)  # the text the loss tokens of that assistant turn must cover
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from devkit.tiny import corpus
from lowmem_ft.data import templates
from lowmem_ft.native import qwen_v1 as native_qwen_v1


def _trl(name: str) -> str:
    import trl.chat_template_utils as ctu

    return getattr(ctu, f"{name}_chat_template")


# Zephyr's template (HuggingFaceH4/zephyr-7b-beta tokenizer_config.json, also TinyLlama-1.1B-Chat): a plain Jinja loop,
# no generation markers, unknown to TRL — the "small Llama-shaped model of their own".
ZEPHYR = (
    "{% for message in messages %}\n"
    "{% if message['role'] == 'user' %}\n"
    "{{ '<|user|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'system' %}\n"
    "{{ '<|system|>\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'assistant' %}\n"
    "{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n"
    "{% endif %}\n"
    "{% if loop.last and add_generation_prompt %}\n"
    "{{ '<|assistant|>' }}\n"
    "{% endif %}\n"
    "{% endfor %}"
)

# Mistral-7B-Instruct-v0.3's rule (mistralai/Mistral-7B-Instruct-v0.3 tokenizer_config.json, tool blocks left out):
# the system message is prepended to a user turn only when that turn is the last message, so a conversation that
# ends with the assistant renders without it. Training must refuse it rather than lose the system prompt.
MISTRAL_V3 = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content'] %}\n"
    "    {%- set loop_messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set loop_messages = messages %}\n"
    "{%- endif %}\n"
    "{{- bos_token }}\n"
    "{%- for message in loop_messages %}\n"
    "    {%- if message['role'] == 'user' %}\n"
    "        {%- if loop.last and system_message is defined %}\n"
    "            {{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}\n"
    "        {%- else %}\n"
    "            {{- '[INST] ' + message['content'] + '[/INST]' }}\n"
    "        {%- endif %}\n"
    "    {%- elif message['role'] == 'assistant' %}\n"
    "        {{- ' ' + message['content']|trim + eos_token}}\n"
    "    {%- else %}\n"
    "        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial "
    "optional system message!') }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
)


def _qwen3_finetune() -> str:
    """Qwen3's template as a community fine-tune ships it: one comment line added, so TRL no longer recognises it,
    with Qwen3's rewrite of earlier turns intact (reasoning and the `<think>` block only after the last user query)."""
    return "{#- fine-tuned from Qwen3: same template -#}\n" + _trl("qwen3")


@dataclass(frozen=True)
class Tokens:
    """A family's special tokens and how its tokenizer uses them."""

    eos: str
    bos: str | None = None
    pad: str | None = None  # None: the family ships no pad token
    unk: str | None = None
    eot: str | None = None  # end of an assistant turn when it is not EOS
    extra: tuple[str, ...] = ()  # role markers and other special tokens of the template
    reserved: str | None = None  # format of the family's reserved/unused special tokens, e.g. "<unused{}>"
    n_reserved: int = 0
    add_bos: bool = False  # the tokenizer's post-processor puts BOS in front of every text
    sentencepiece: bool = False  # `▁` for spaces (Llama-2, Mistral, Gemma, Phi-3) rather than GPT-2 byte-level BPE
    dummy_prefix: bool = True  # SentencePiece: a `▁` before the first word (Gemma: no)

    @property
    def specials(self) -> list[str]:
        named = [self.bos, self.eos, self.pad, self.unk, self.eot, *self.extra]
        reserved = [self.reserved.format(i) for i in range(self.n_reserved)] if self.reserved else []
        return list(dict.fromkeys([t for t in named if t] + reserved))


@dataclass(frozen=True)
class Family:
    name: str
    config: dict[str, Any]  # transformers config kwargs; vocab_size is at least the tokenizer's length
    tokens: Tokens
    template: Callable[[], str]
    template_source: str
    reply: Callable[[str, bool], str]  # (assistant content, last turn?) → the text its loss tokens must cover
    notes: str = ""
    tags: tuple[str, ...] = field(default_factory=tuple)  # "rewrites": the template rewrites earlier turns
    # a checkpoint the Hub ships in a layout of its own (Qwen v1): the native model is written that way instead
    hub_layout: str = ""
    # a multimodal checkpoint: config key → the special token it names (Gemma3Config's boi_token_index, ...)
    image_tokens: dict[str, str] = field(default_factory=dict)
    # preprocessor_config.json as the Hub ships it beside the weights; None: a text checkpoint
    preprocessor: dict[str, Any] | None = None
    processor: dict[str, Any] | None = None  # processor_config.json (Idefics3: image_seq_len)


LLAMA_TOKENS = Tokens(bos="<s>", eos="</s>", unk="<unk>", add_bos=True, sentencepiece=True)
GEMMA_TOKENS = Tokens(
    bos="<bos>",
    eos="<eos>",
    pad="<pad>",
    unk="<unk>",
    eot="<end_of_turn>",
    extra=("<start_of_turn>",),
    reserved="<unused{}>",
    n_reserved=99,
    add_bos=True,
    sentencepiece=True,
    dummy_prefix=False,
)
# Gemma-3's image tokens (begin / end of image, the soft token its features replace): Gemma3Config's
# boi_token_index, eoi_token_index and image_token_index point at them
GEMMA3_IMAGE_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")
GEMMA3_IMAGE_KEYS = ("boi_token_index", "eoi_token_index", "image_token_index")
QWEN_TOKENS = Tokens(eos="<|endoftext|>", pad="<|endoftext|>", eot="<|im_end|>", extra=("<|im_start|>",))
# Qwen-7B-Chat (v1): its tokenizer has no pad, BOS or chat template; lowmem_ft.native rebuilds it with these
QWEN_V1_TOKENS = Tokens(eos="<|im_end|>", pad="<|endoftext|>", extra=("<|im_start|>",))
QWEN3_TOKENS = Tokens(
    eos="<|im_end|>",
    pad="<|endoftext|>",
    extra=("<|im_start|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
)
# Qwen2-VL / Qwen2.5-VL's vision tokens (Qwen/Qwen2.5-VL-7B-Instruct tokenizer_config.json, ids 151652-151656):
# an image renders as <|vision_start|><|image_pad|><|vision_end|>, the processor repeats <|image_pad|> once per
# merged patch, and the config's image_token_id / video_token_id / vision_*_token_id name them
QWEN_VL_IMAGE_TOKENS = {
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
    "vision_token_id": "<|vision_pad|>",
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
}
# Qwen2.5-VL-7B-Instruct's chat_template.json (identical in Qwen2-VL-7B-Instruct): a default system turn, list
# contents rendered part by part, an image as <|vision_start|><|image_pad|><|vision_end|>
QWEN_VL = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt "
    "%}<|im_start|>assistant\n{% endif %}"
)
# Qwen2.5-VL-7B-Instruct's preprocessor_config.json (min_pixels 56², max_pixels 12,845,056 = 16,384 merged tokens)
QWEN_VL_PREPROCESSOR = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2_5_VLProcessor",
}
# Qwen3-VL-8B-Instruct's preprocessor_config.json: 16×16 patches, 2×2 merged, 65,536 to 16,777,216 pixels (64 to
# 16,384 tokens)
QWEN3_VL_PREPROCESSOR = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}
# google/gemma-3-4b-it's preprocessor_config.json (the same in gemma-3-12b-it / -27b-it): 896×896 per image, the
# pan-and-scan keys null (Gemma3Processor's defaults: off). The zoo's copy resizes to its tiny tower's 28×28.
GEMMA3_PREPROCESSOR = {
    "do_convert_rgb": None,
    "do_normalize": True,
    "do_pan_and_scan": None,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "Gemma3ImageProcessor",
    "image_seq_length": 256,
    "image_std": [0.5, 0.5, 0.5],
    "pan_and_scan_max_num_crops": None,
    "pan_and_scan_min_crop_size": None,
    "pan_and_scan_min_ratio_to_activate": None,
    "processor_class": "Gemma3Processor",
    "resample": 2,
    "rescale_factor": 0.00392156862745098,
    "size": {"height": 896, "width": 896},
}
# Idefics3 / SmolVLM's image tokens (HuggingFaceTB/SmolVLM-Instruct tokenizer: added special tokens; the processor,
# processing_idefics3.py, writes an image as <fake_token_around_image>, <row_r_col_c> / <global-img> and <image>
# repeated image_seq_len times per tile) and the config key of <image>
IDEFICS3_IMAGE_TOKENS = {"image_token_id": "<image>"}
IDEFICS3_TOKENS = Tokens(
    bos="<|im_start|>", eos="<end_of_utterance>", pad="<|im_end|>", unk="<|endoftext|>",
    extra=("<fake_token_around_image>", "<image>", "<global-img>",
           *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))),
)  # fmt: skip
# SmolVLM's chat template as transformers 5.24 ships it (processing_smolvlm.py DEFAULT_CHAT_TEMPLATE, "the correct
# chat template to be used ... after #38105"): SmolVLM-Instruct's own chat_template.json is the same for list contents
# but cannot render a string content, which this one can
SMOLVLM = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}{% if message['content'] is string %}"
    "{{': ' + message['content']}}{% else %}{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}"
    "{{': '}}{% endif %}{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}{% elif "
    "line['type'] == 'image' %}{{ '<image>' }}{% elif line['type'] == 'video' %}{{ '<video>' }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}"
    "{% endif %}"
)
# SmolVLM-Instruct's preprocessor_config.json with the tile and the longest edge scaled to the tiny tower (Hub: tile
# 384, longest edge 1536 = 4 tiles a side): tile 56 = the tiny tower's image_size, longest edge 4 tiles
IDEFICS3_PREPROCESSOR = {
    "do_convert_rgb": True, "do_image_splitting": True, "do_normalize": True, "do_pad": True, "do_rescale": True,
    "do_resize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "max_image_size": {"longest_edge": 56}, "resample": 1, "rescale_factor": 0.00392156862745098,
    "size": {"longest_edge": 224}, "image_processor_type": "Idefics3ImageProcessor",
    "processor_class": "Idefics3Processor",
}  # fmt: skip
# its tiny tower: 56 / 14 = 4 × 4 patches a tile, pixel-shuffled 2 × 2 into image_seq_len 4 tokens
IDEFICS3_VISION = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                   "image_size": 56, "patch_size": 14}  # fmt: skip
# llava-hf/llava-1.5-7b-hf's chat_template.json: images first in a turn, "USER: " / "ASSISTANT: ", list contents only
# (lowmem-ft renders string contents as text parts, as TRL's prepare_multimodal_messages does), no EOS after an answer
LLAVA = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{# Render all images first #}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}{# Render all text next #}{% if message['role'] != 'assistant' %}{% for content in "
    "message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}{% endfor %}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{% generation %}"
    "{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ 'ASSISTANT:' }}{% endif %}"
)
# llava-1.5-7b-hf's preprocessor_config.json (CLIPImageProcessor: shortest edge to 336, center crop 336 × 336) with
# the crop scaled to the tiny tower's image_size 56: 4 × 4 patches of 14, 16 tokens per image
LLAVA_PREPROCESSOR = {
    "crop_size": {"height": 56, "width": 56}, "do_center_crop": True, "do_convert_rgb": True, "do_normalize": True,
    "do_rescale": True, "do_resize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_processor_type": "CLIPImageProcessor", "image_std": [0.26862954, 0.26130258, 0.27577711],
    "processor_class": "LlavaProcessor", "resample": 3, "rescale_factor": 0.00392156862745098,
    "size": {"shortest_edge": 56},
}  # fmt: skip
# LLaVA-OneVision (llava-onevision-qwen2-*-ov-hf): ChatML turns, a turn's images first, then "\n" + each text part.
# Modelled on the published template's output ("<|im_start|>user\n<image>\nWhat is shown?<|im_end|>\n..."), not a
# copy of its file
LLAVA_ONEVISION = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}{% for content in message['content'] "
    "| selectattr('type', 'equalto', 'image') %}{{ '<image>' }}{% endfor %}{% for content in message['content'] | "
    "selectattr('type', 'equalto', 'text') %}{{ '\n' + content['text'] }}{% endfor %}{{ '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# its tiny tower: crops of 28 px, 2 × 2 features each; grids up to 3 × 3 crops, pooled past anyres_max_2
LLAVA_ONEVISION_PINPOINTS = [[28 * r, 28 * c] for r in (1, 2, 3) for c in (1, 2, 3)]
LLAVA_ONEVISION_PREPROCESSOR = {
    "do_convert_rgb": True, "do_normalize": True, "do_pad": True, "do_rescale": True, "do_resize": True,
    "image_grid_pinpoints": LLAVA_ONEVISION_PINPOINTS, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "image_processor_type": "LlavaOnevisionImageProcessor", "processor_class": "LlavaOnevisionProcessor",
    "resample": 3, "rescale_factor": 0.00392156862745098, "size": {"height": 28, "width": 28},
}  # fmt: skip
# every linear dimension a multiple of 64: bitsandbytes' CPU inference path repacks NF4 weights per 64-block
TINY = {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4}

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        Family(
            "llama3",  # Llama-3.2-1B-Instruct: tied embeddings, llama3 RoPE scaling, 256 reserved specials, no pad
            {
                "model_type": "llama",
                **TINY,
                "num_key_value_heads": 2,
                "vocab_size": 2048,
                "tie_word_embeddings": True,
                "rope_theta": 500000.0,
                "max_position_embeddings": 131072,
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 32.0,
                    "high_freq_factor": 4.0,
                    "low_freq_factor": 1.0,
                    "original_max_position_embeddings": 8192,
                },
            },  # fmt: skip
            Tokens(
                bos="<|begin_of_text|>",
                eos="<|end_of_text|>",
                eot="<|eot_id|>",
                extra=("<|start_header_id|>", "<|end_header_id|>", "<|python_tag|>", "<|eom_id|>"),
                reserved="<|reserved_special_token_{}|>",
                n_reserved=248,
                add_bos=True,
            ),
            lambda: _trl("llama3_2"),
            "TRL's copy of Llama-3.2 (no TRL training version: assistant tokens turn by turn)",
            lambda c, last: c.strip() + "<|eot_id|>",
        ),
        Family(
            "qwen2.5",  # Qwen2.5-7B: qkv bias, untied, embedding rows beyond the tokenizer (151936 vs 151665)
            {
                "model_type": "qwen2",
                **TINY,
                "num_key_value_heads": 2,
                "vocab_size": 2688,
                "rope_theta": 1e6,
                "tie_word_embeddings": False,
            },  # fmt: skip
            QWEN_TOKENS,
            lambda: _trl("qwen2_5"),
            "TRL's copy of Qwen2.5 (TRL's training version adds the markers)",
            lambda c, last: c + "<|im_end|>",
        ),
        Family(
            "qwen-v1",  # Qwen-7B-Chat (v1) as the Hub ships it: remote code, qwen.tiktoken, fused c_attn, no template
            {
                "model_type": "qwen2",  # written with v1's names and config (devkit/qwen_v1.py)
                **TINY,
                "num_key_value_heads": 4,
                "vocab_size": 896,  # rows beyond the 640 + 208 specials, as Qwen-7B's 151,936 beyond 151,851
                "rope_theta": 10000.0,
                "max_position_embeddings": 8192,
                "tie_word_embeddings": False,
            },  # fmt: skip
            QWEN_V1_TOKENS,
            lambda: native_qwen_v1.CHAT_TEMPLATE,
            "ChatML with Qwen-Chat's default system prompt (lowmem_ft.native.qwen_v1: the checkpoint ships none)",
            lambda c, last: c + "<|im_end|>",
            hub_layout="qwen_v1",
        ),
        Family(
            "qwen3",  # Qwen3-0.6B: q/k RMSNorm, head_dim 128 ≠ 1024 / 16, tied
            {
                "model_type": "qwen3",
                **TINY,
                "num_key_value_heads": 2,
                "head_dim": 32,
                "vocab_size": 2304,
                "tie_word_embeddings": True,
                "rope_theta": 1e6,
            },  # fmt: skip
            QWEN3_TOKENS,
            lambda: _trl("qwen3"),
            "TRL's copy of Qwen3 (TRL's training version: think block on every turn, markers)",
            lambda c, last: "<think>\n\n</think>\n\n" + c + "<|im_end|>",
        ),
        Family(
            "mistral",  # Mistral-7B-v0.1: sliding window 4096, GQA (32/8 there), SentencePiece, no pad
            {
                "model_type": "mistral",
                **TINY,
                "num_key_value_heads": 2,  # k/v rows a multiple of 32: bitsandbytes CPU NF4 packing
                "vocab_size": 768,
                "sliding_window": 4096,
                "tie_word_embeddings": False,
            },  # fmt: skip
            LLAMA_TOKENS,
            lambda: templates.MISTRAL,
            "Mistral-7B-Instruct-v0.2 [INST] form (lowmem-ft's copy, `mistral`)",
            lambda c, last: " " + c + "</s>",
        ),
        Family(
            "gemma2",  # gemma-2-9b: attention softcap 50, final-logit softcap 30, head_dim 256 ≠ 3584 / 16,
            # query_pre_attn_scalar, alternating sliding/global layers, 4 norms per layer, GeGLU, tied, 256k vocab
            {
                "model_type": "gemma2",
                **TINY,
                "num_key_value_heads": 2,
                "head_dim": 32,
                "vocab_size": 4096,
                "query_pre_attn_scalar": 32,
                "attn_logit_softcapping": 50.0,
                "final_logit_softcapping": 30.0,
                "sliding_window": 16,
                "hidden_activation": "gelu_pytorch_tanh",
            },  # fmt: skip
            GEMMA_TOKENS,
            lambda: _trl("gemma"),
            "TRL's copy of Gemma / Gemma-2 (TRL's training version adds the markers); refuses a system role",
            lambda c, last: c.strip() + "<end_of_turn>",
        ),
        Family(
            "gemma3",  # gemma-3-1b-it text: q/k norm, sliding window 512 with one global layer in six, tied
            {
                "model_type": "gemma3_text",
                **TINY,
                "num_key_value_heads": 1,
                "head_dim": 32,
                "vocab_size": 4096,
                "query_pre_attn_scalar": 32,
                "sliding_window": 16,
                "layer_types": ["sliding_attention", "full_attention"],
            },  # fmt: skip
            GEMMA_TOKENS,
            lambda: _trl("gemma3"),
            "TRL's copy of Gemma-3 (TRL's training version adds the markers)",
            lambda c, last: c.strip() + "<end_of_turn>",
        ),
        Family(
            # gemma-3-4b-it and up: a `gemma3` config that AutoModelForCausalLM loads as Gemma3ForConditionalGeneration,
            # the gemma3 text model under model.language_model beside a SigLIP vision tower (vision_use_head false, as
            # the Hub's) and the multimodal projector; the tokenizer has the image tokens. Tower widths tiny (image 28,
            # patch 14: 4 patches pooled to mm_tokens_per_image 4).
            "gemma3-vision",
            {
                "model_type": "gemma3",
                "text_config": {
                    "model_type": "gemma3_text",
                    **TINY,
                    "num_key_value_heads": 1,
                    "head_dim": 32,
                    "vocab_size": 4096,
                    "query_pre_attn_scalar": 32,
                    "sliding_window": 16,
                    "layer_types": ["sliding_attention", "full_attention"],
                },
                "vision_config": {
                    "model_type": "siglip_vision_model",
                    "hidden_size": 64,
                    "intermediate_size": 128,
                    "num_hidden_layers": 1,
                    "num_attention_heads": 2,
                    "image_size": 28,
                    "patch_size": 14,
                    "vision_use_head": False,
                },
                "mm_tokens_per_image": 4,
            },  # fmt: skip
            replace(GEMMA_TOKENS, extra=(*GEMMA_TOKENS.extra, *GEMMA3_IMAGE_TOKENS)),
            lambda: _trl("gemma3"),
            "TRL's copy of Gemma-3 (the Hub's gemma-3-4b-it template renders images as <start_of_image>)",
            lambda c, last: c.strip() + "<end_of_turn>",
            image_tokens=dict(zip(GEMMA3_IMAGE_KEYS, GEMMA3_IMAGE_TOKENS, strict=True)),
            preprocessor={**GEMMA3_PREPROCESSOR, "image_seq_length": 4, "size": {"height": 28, "width": 28}},
        ),
        Family(
            # Qwen2.5-VL-7B-Instruct: the qwen2 decoder (qkv bias, untied, M-RoPE over 3 sections) under
            # model.language_model, beside model.visual: a windowed-attention ViT (Conv3d patches of 2×14×14, RMSNorm,
            # gated MLP with biases, full attention only at fullatt_block_indexes) and the 2×2 patch merger; loaded by
            # AutoModelForImageTextToText (AutoModelForCausalLM refuses the config). Widths tiny; the processor's
            # preprocessor_config.json as the Hub's.
            "qwen2.5-vl",
            {
                "model_type": "qwen2_5_vl",
                "text_config": {
                    "model_type": "qwen2_5_vl_text",
                    **TINY,
                    "num_key_value_heads": 2,
                    "vocab_size": 2688,
                    "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},  # head_dim 16: 8 frequencies
                },
                "vision_config": {
                    "model_type": "qwen2_5_vl_vision",
                    "depth": 2,
                    "hidden_size": 64,
                    "intermediate_size": 128,
                    "num_heads": 2,
                    "out_hidden_size": 64,
                    "window_size": 56,
                    "fullatt_block_indexes": [1],
                    "tokens_per_second": 2,
                },
                "tie_word_embeddings": False,
            },  # fmt: skip
            replace(QWEN_TOKENS, extra=(*QWEN_TOKENS.extra, *QWEN_VL_IMAGE_TOKENS.values())),
            lambda: QWEN_VL,
            "Qwen2.5-VL-7B-Instruct's chat_template.json (lowmem-ft's copy, devkit/zoo.py QWEN_VL)",
            lambda c, last: c + "<|im_end|>",
            image_tokens=QWEN_VL_IMAGE_TOKENS,
            preprocessor=QWEN_VL_PREPROCESSOR,
            tags=("vision",),
        ),
        Family(
            # Qwen2-VL-7B-Instruct: the same decoder and processor as Qwen2.5-VL's; its tower has LayerNorms, a plain
            # fc1/fc2 MLP (embed_dim × mlp_ratio) and no window attention, and names its width `embed_dim`.
            "qwen2-vl",
            {
                "model_type": "qwen2_vl",
                "text_config": {
                    "model_type": "qwen2_vl_text",
                    **TINY,
                    "num_key_value_heads": 2,
                    "vocab_size": 2688,
                    "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
                },
                "vision_config": {
                    "model_type": "qwen2_vl_vision",
                    "depth": 2,
                    "embed_dim": 64,
                    "mlp_ratio": 2,
                    "num_heads": 2,
                    "hidden_size": 64,
                },
                "tie_word_embeddings": False,
            },  # fmt: skip
            replace(QWEN_TOKENS, extra=(*QWEN_TOKENS.extra, *QWEN_VL_IMAGE_TOKENS.values())),
            lambda: QWEN_VL,
            "Qwen2-VL-7B-Instruct's chat_template.json (the same as Qwen2.5-VL's: devkit/zoo.py QWEN_VL)",
            lambda c, last: c + "<|im_end|>",
            image_tokens=QWEN_VL_IMAGE_TOKENS,
            preprocessor={**QWEN_VL_PREPROCESSOR, "processor_class": "Qwen2VLProcessor"},
            tags=("vision",),
        ),
        Family(
            # Qwen3-VL-8B-Instruct: the qwen3 decoder (q/k norms, interleaved M-RoPE, deepstack features added to its
            # first layers) beside a tower of 16×16 patches with learned position embeddings and deepstack mergers;
            # its processor is Qwen2-VL's at patch 16 (32-pixel merged tokens, min 65,536 pixels). The zoo uses
            # Qwen2.5-VL's template copy, which renders an image as the Hub's Qwen3-VL template does
            # (<|vision_start|><|image_pad|><|vision_end|>) but lacks its tool and reasoning branches.
            "qwen3-vl",
            {
                "model_type": "qwen3_vl",
                "text_config": {
                    "model_type": "qwen3_vl_text",
                    **TINY,
                    "num_key_value_heads": 2,
                    "head_dim": 16,
                    "vocab_size": 2688,
                    "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True},
                },
                "vision_config": {
                    "model_type": "qwen3_vl",
                    "depth": 2,
                    "hidden_size": 64,
                    "intermediate_size": 128,
                    "num_heads": 2,
                    "out_hidden_size": 64,
                    "num_position_embeddings": 16,
                    "deepstack_visual_indexes": [0, 1],
                },
                "tie_word_embeddings": False,
            },  # fmt: skip
            replace(QWEN_TOKENS, extra=(*QWEN_TOKENS.extra, *QWEN_VL_IMAGE_TOKENS.values())),
            lambda: QWEN_VL,
            "Qwen2.5-VL-7B-Instruct's chat_template.json (lowmem-ft's copy, devkit/zoo.py QWEN_VL)",
            lambda c, last: c + "<|im_end|>",
            image_tokens=QWEN_VL_IMAGE_TOKENS,
            preprocessor=QWEN3_VL_PREPROCESSOR,
            tags=("vision",),
        ),
        Family(
            # SmolVLM-Instruct (model_type idefics3): a Llama decoder under model.text_model beside model.vision_model
            # (the SigLIP-style Idefics3VisionTransformer) and model.connector (pixel shuffle + one Linear); loaded by
            # AutoModelForImageTextToText. Widths tiny; the processor's files as the Hub ships them, tile scaled.
            "smolvlm",
            {
                "model_type": "idefics3",
                "text_config": {"model_type": "llama", **TINY, "num_key_value_heads": 2, "tie_word_embeddings": False},
                "vision_config": {"model_type": "idefics3_vision", **IDEFICS3_VISION},
                "scale_factor": 2,
                "tie_word_embeddings": False,
            },
            IDEFICS3_TOKENS,
            lambda: SMOLVLM,
            "transformers' SmolVLM chat template (processing_smolvlm.py DEFAULT_CHAT_TEMPLATE)",
            lambda c, last: " " + c + "<end_of_utterance>",
            image_tokens=IDEFICS3_IMAGE_TOKENS,
            preprocessor=IDEFICS3_PREPROCESSOR,
            processor={"image_seq_len": 4, "processor_class": "Idefics3Processor"},
            tags=("vision",),
        ),
        Family(
            # SmolVLM2 (model_type smolvlm): the same layout and processor arithmetic under SmolVLM's own classes
            "smolvlm2",
            {
                "model_type": "smolvlm",
                "text_config": {"model_type": "llama", **TINY, "num_key_value_heads": 2, "tie_word_embeddings": False},
                "vision_config": {"model_type": "smolvlm_vision", **IDEFICS3_VISION},
                "scale_factor": 2,
                "tie_word_embeddings": False,
            },
            IDEFICS3_TOKENS,
            lambda: SMOLVLM,
            "transformers' SmolVLM chat template (processing_smolvlm.py DEFAULT_CHAT_TEMPLATE)",
            lambda c, last: " " + c + "<end_of_utterance>",
            image_tokens=IDEFICS3_IMAGE_TOKENS,
            preprocessor={
                **IDEFICS3_PREPROCESSOR,
                "image_processor_type": "SmolVLMImageProcessor",
                "processor_class": "SmolVLMProcessor",
            },
            processor={"image_seq_len": 4, "processor_class": "SmolVLMProcessor"},
            tags=("vision",),
        ),
        Family(
            # llava-1.5-7b-hf: a Llama-2 decoder under model.language_model beside model.vision_tower (CLIPVisionModel,
            # features at layer -2 without the class token) and model.multi_modal_projector (Linear, GELU, Linear);
            # the tokenizer's <image> (image_token_index) and <pad> added to Llama's. Widths tiny.
            "llava",
            {
                "model_type": "llava",
                "text_config": {"model_type": "llama", **TINY, "num_key_value_heads": 4},
                "vision_config": {
                    "model_type": "clip_vision_model",
                    "hidden_size": 64,
                    "intermediate_size": 128,
                    "num_hidden_layers": 2,
                    "num_attention_heads": 2,
                    "image_size": 56,
                    "patch_size": 14,
                    "projection_dim": 64,
                },
                "vision_feature_layer": -2,
                "vision_feature_select_strategy": "default",
                "image_seq_length": 16,
                "tie_word_embeddings": False,
            },  # fmt: skip
            replace(LLAMA_TOKENS, pad="<pad>", extra=("<image>",)),
            lambda: LLAVA,
            "llava-hf/llava-1.5-7b-hf's chat_template.json (lowmem-ft's copy, devkit/zoo.py LLAVA)",
            lambda c, last: c + " ",
            image_tokens={"image_token_index": "<image>"},
            preprocessor=LLAVA_PREPROCESSOR,
            processor={
                "image_token": "<image>",
                "num_additional_image_tokens": 1,
                "patch_size": 14,
                "processor_class": "LlavaProcessor",
                "vision_feature_select_strategy": "default",
            },
            tags=("vision",),
        ),
        Family(
            # llava-onevision-qwen2-*-ov-hf: a Qwen2 decoder under model.language_model beside model.vision_tower
            # (SiglipVisionModel without its head) and model.multi_modal_projector, plus model.image_newline
            "llava-onevision",
            {
                "model_type": "llava_onevision",
                "text_config": {"model_type": "qwen2", **TINY, "num_key_value_heads": 2},
                "vision_config": {
                    "model_type": "siglip_vision_model",
                    "hidden_size": 64,
                    "intermediate_size": 128,
                    "num_hidden_layers": 2,
                    "num_attention_heads": 2,
                    "image_size": 28,
                    "patch_size": 14,
                    "vision_use_head": False,
                },
                "image_grid_pinpoints": LLAVA_ONEVISION_PINPOINTS,
                "vision_aspect_ratio": "anyres_max_2",
                "tie_word_embeddings": False,
            },  # fmt: skip
            replace(QWEN_TOKENS, extra=(*QWEN_TOKENS.extra, "<image>", "<video>")),
            lambda: LLAVA_ONEVISION,
            "modelled on llava-onevision-qwen2-7b-ov-hf's template (devkit/zoo.py LLAVA_ONEVISION)",
            lambda c, last: "\n" + c + "<|im_end|>",
            image_tokens={"image_token_index": "<image>", "video_token_index": "<video>"},
            preprocessor=LLAVA_ONEVISION_PREPROCESSOR,
            processor={
                "num_image_tokens": 4,
                "processor_class": "LlavaOnevisionProcessor",
                "vision_aspect_ratio": "anyres_max_2",
                "vision_feature_select_strategy": "full",
            },
            tags=("vision",),
        ),
        Family(
            "phi3",  # Phi-3-mini-4k: fused qkv_proj and gate_up_proj, sliding window 2047, pad id 32000, untied
            {
                "model_type": "phi3",
                **TINY,
                "num_key_value_heads": 4,
                "vocab_size": 640,
                "sliding_window": 2047,
                "tie_word_embeddings": False,
            },  # fmt: skip
            Tokens(
                bos="<s>",
                eos="<|endoftext|>",
                pad="<|endoftext|>",
                unk="<unk>",
                eot="<|end|>",
                extra=("<|system|>", "<|user|>", "<|assistant|>"),
                add_bos=True,
                sentencepiece=True,
            ),
            lambda: _trl("phi3"),
            "TRL's copy of Phi-3 (TRL's training version adds the markers); no BOS in the template",
            # TRL's training version marks the EOS after the last turn too (the newline before it is whitespace)
            lambda c, last: c + "<|end|>" + ("<|endoftext|>" if last else ""),
        ),
        Family(
            "granite",  # granite-3.0-8b: embedding ×12, residual ×0.22, attention ×1/128, logits ÷16, tied
            {
                "model_type": "granite",
                **TINY,
                "num_key_value_heads": 2,
                "vocab_size": 896,
                "embedding_multiplier": 12.0,
                "residual_multiplier": 0.22,
                "attention_multiplier": 0.0078125,
                "logits_scaling": 16.0,
                "tie_word_embeddings": True,
            },  # fmt: skip
            Tokens(
                bos="<|end_of_text|>",
                eos="<|end_of_text|>",
                pad="<|end_of_text|>",
                unk="<|end_of_text|>",
                extra=("<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"),
            ),
            lambda: templates.GRANITE,
            "Granite 3.0 instruct (lowmem-ft's copy, `granite`)",
            lambda c, last: c + "<|end_of_text|>",
        ),
        Family(
            "llama-zephyr",  # a Llama-2-shaped community fine-tune with Zephyr's plain-loop template
            {
                "model_type": "llama",
                **TINY,
                "num_key_value_heads": 4,
                "vocab_size": 1024,
                "tie_word_embeddings": False,
            },  # fmt: skip
            Tokens(
                bos="<s>",
                eos="</s>",
                unk="<unk>",
                extra=("<|user|>", "<|assistant|>", "<|system|>"),
                add_bos=True,
                sentencepiece=True,
            ),  # fmt: skip
            lambda: ZEPHYR,
            "Zephyr's plain Jinja loop: no markers, unknown to TRL",
            lambda c, last: c + "</s>",
        ),
        Family(
            "qwen3-finetune",  # Qwen3 shapes with Qwen3's template edited by one line: TRL does not recognise it
            {
                "model_type": "qwen3",
                **TINY,
                "num_key_value_heads": 2,
                "head_dim": 32,
                "vocab_size": 2304,
                "tie_word_embeddings": True,
            },  # fmt: skip
            QWEN3_TOKENS,
            _qwen3_finetune,
            "Qwen3's template + one comment line: rewrites earlier turns (reasoning, <think> block)",
            lambda c, last: "<think>\n\n</think>\n\n" + c + "<|im_end|>",
            tags=("rewrites",),
        ),
    ]
}
# The families whose config transformers builds natively (all of them) and that the memory model describes, trained
# on text; VISION: the vision-language checkpoints trained on images (lowmem_ft.vision), beside them.
VISION = tuple(n for n, f in FAMILIES.items() if "vision" in f.tags)
NAMES = tuple(n for n in FAMILIES if n not in VISION)


def build_tokenizer(family: Family, vocab_size: int = 640):
    """A BPE tokenizer trained on the shared small corpus with the family's special tokens, pre-tokenization,
    BOS rule and chat template (a few hundred ms)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if family.hub_layout == "qwen_v1":  # the tokenizer lowmem-ft rebuilds from the checkpoint's qwen.tiktoken
        from devkit.qwen_v1 import train_ranks

        ranks = train_ranks(vocab_size)
        fast = native_qwen_v1.tokenizer_from_ranks(ranks, chat=True)
        fast.ranks = ranks
        return fast
    t = family.tokens
    specials = t.specials
    if t.sentencepiece:  # Llama-2 / Mistral / Gemma style: spaces become ▁, unknown bytes fall back to <0xNN>
        tok = Tokenizer(models.BPE(unk_token=t.unk, byte_fallback=True, fuse_unk=True))
        tok.normalizer = normalizers.Replace(" ", "▁")
        scheme = "first" if t.dummy_prefix else "never"
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
            + ([decoders.Strip(" ", 1, 0)] if t.dummy_prefix else [])
        )
        alphabet = [
            "▁",
            *"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'\"()[]{}<>-_/\\|@#$%^&*+=~`",
        ]
        byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=specials + byte_tokens, initial_alphabet=alphabet,
            show_progress=False,
        )  # fmt: skip
    else:  # GPT-2 byte-level BPE (Llama-3, Qwen, Granite)
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )  # fmt: skip
    tok.train_from_iterator(corpus(), trainer=trainer)
    if t.add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{t.bos} $A", pair=f"{t.bos} $A {t.bos} $B", special_tokens=[(t.bos, tok.token_to_id(t.bos))]
        )
    elif not t.sentencepiece:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    kwargs = {k: v for k, v in (("bos_token", t.bos), ("pad_token", t.pad), ("unk_token", t.unk)) if v}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=t.eos, model_max_length=8192, **kwargs)
    extra = [s for s in specials if s not in (t.bos, t.eos, t.pad, t.unk)]
    fast.add_special_tokens({"additional_special_tokens": extra}, replace_extra_special_tokens=False)
    fast.chat_template = family.template()
    return fast


def config_for(family: Family, tokenizer) -> Any:
    from transformers import AutoConfig

    kwargs = dict(family.config)
    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if "text_config" in kwargs:  # a multimodal wrapper (Gemma3Config): the vocabulary is the text model's
        text = {**kwargs["text_config"], **ids}
        text["vocab_size"] = max(text.get("vocab_size", 0), len(tokenizer))
        image = {key: tokenizer.convert_tokens_to_ids(token) for key, token in family.image_tokens.items()}
        return AutoConfig.for_model(**{**kwargs, "text_config": text}, **image, **ids)
    kwargs["vocab_size"] = max(kwargs.get("vocab_size", 0), len(tokenizer))
    return AutoConfig.for_model(**kwargs, **ids)


def build(name: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write zoo model `name` (config, bf16-free fp32 safetensors, tokenizer) to `out_dir`; returns the path."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    family = FAMILIES[name]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(family)
    config = config_for(family, tokenizer)
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if family.preprocessor else AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    eos = [tokenizer.eos_token_id]
    if family.tokens.eot and family.tokens.eot != family.tokens.eos:  # instruct models stop at either
        eos.append(tokenizer.convert_tokens_to_ids(family.tokens.eot))
    model.generation_config.eos_token_id = eos if len(eos) > 1 else eos[0]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    if family.hub_layout == "qwen_v1":
        from devkit.qwen_v1 import write_checkpoint

        write_checkpoint(out, model, tokenizer.ranks)
        return out
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if family.preprocessor:
        (out / "preprocessor_config.json").write_text(json.dumps(family.preprocessor, indent=2) + "\n")
        if "image_seq_length" in family.preprocessor:  # Gemma-3's processor_config.json: the tokens per image
            processor = {
                "image_seq_length": family.preprocessor["image_seq_length"],
                "processor_class": "Gemma3Processor",
            }
            (out / "processor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    if family.processor:
        (out / "processor_config.json").write_text(json.dumps(family.processor, indent=2) + "\n")
    return out


def from_pretrained(path: str | Path, **kwargs):
    """A zoo model loaded as lowmem-ft loads it: `AutoModelForCausalLM.from_pretrained`, or for a checkpoint of its
    own layout (qwen-v1) the native model through `lowmem_ft.native` — what a test compares a run against."""
    from transformers import AutoModelForCausalLM

    from lowmem_ft import native

    conversion = native.checkpoint_conversion(str(path))
    if conversion is None:
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)
    return native.load_model(str(path), conversion, native.transformers_config(str(path), conversion), **kwargs)


def tokenizer(path: str | Path):
    """A zoo model's tokenizer as lowmem-ft loads it (`lowmem_ft.data.tokenize.load_tokenizer`)."""
    from lowmem_ft.data.tokenize import load_tokenizer

    return load_tokenizer(str(path))


def build_all(root: str | Path, names: tuple[str, ...] = NAMES + VISION) -> dict[str, Path]:
    """Every zoo model under `root/<name>` (built once: an existing config.json is reused)."""
    root = Path(root)
    out = {}
    for name in names:
        path = root / name
        out[name] = path if (path / "config.json").is_file() else build(name, path)
    return out


# Wider replicas for the memory model's accuracy grid (`devkit/bench/estimator.py --zoo`): each family's config
# quirks at hidden 256 × 3 layers, with the family's vocabulary-to-width ratio and head_dim ≠ hidden / heads where
# the family has it — shapes the estimator's constants were not fitted on (those were Qwen2 h512 and Llama h384).
ESTIMATOR_SHAPES: dict[str, dict[str, Any]] = {
    "llama3": {"vocab_size": 8192, "num_key_value_heads": 2, "intermediate_size": 704},
    "qwen2.5": {"vocab_size": 10752, "num_key_value_heads": 2, "intermediate_size": 1216},
    "qwen3": {"vocab_size": 9728, "num_key_value_heads": 2, "head_dim": 96, "intermediate_size": 768},
    "mistral": {"vocab_size": 2048, "num_key_value_heads": 1, "intermediate_size": 896},
    "gemma2": {"vocab_size": 16384, "num_key_value_heads": 2, "head_dim": 96, "query_pre_attn_scalar": 96,
               "intermediate_size": 1024},
    "gemma3": {"vocab_size": 16384, "num_key_value_heads": 1, "head_dim": 96, "query_pre_attn_scalar": 96,
               "intermediate_size": 1024, "sliding_window": 64,
               "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]},
    "phi3": {"vocab_size": 2560, "num_key_value_heads": 4, "intermediate_size": 704, "pad_token_id": 0},
    "granite": {"vocab_size": 3072, "num_key_value_heads": 2, "intermediate_size": 640},
}  # fmt: skip


def estimator_config(name: str) -> dict[str, Any]:
    """The config dict of family `name` at the accuracy grid's width (see ESTIMATOR_SHAPES)."""
    config = {**FAMILIES[name].config, "hidden_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4}
    config.update(ESTIMATOR_SHAPES[name])
    return config
