"""Qwen (v1) checkpoints load natively (`lowmem_ft.native.qwen_v1`): the same function as the original code, the same
token ids as tiktoken, and none of the repository's code imported.

The zoo's `qwen-v1` directory is laid out as the Hub ships Qwen-7B-Chat (devkit/qwen_v1.py), its Python files
raising on import. The original modeling code does not import under transformers 5, so the model is checked against
an independent implementation of the v1 block written here from modeling_qwen.py (`QWenAttention`, `QWenMLP`,
`RMSNorm`, `RotaryEmbedding`, `_rotate_half`), computed over the checkpoint's own v1 tensors.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from lowmem_ft.errors import UserError
from lowmem_ft.native import qwen_v1

torch = pytest.importorskip("torch")

VARIED = [
    "Hello world! It's a test, isn't it? They'll say we've done it.",
    "你好，世界！通义千问是阿里云研发的大语言模型。",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\nprint(fib(10))",
    "Emoji: 🤗🚀👍🏽 and flags 🇨🇳🇺🇸, café naïve Ωμέγα",
    "runs of whitespace:   three, \t\ttabs,\n\n\nnewlines,    and trailing   ",
    "numbers 1234567890 3.14159 1e-6 0x1F; URLs https://example.com/a?b=c&d=e",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|><|endoftext|>",
    "".join(qwen_v1.SPECIALS),
]


def _recipe(model: str):
    from lowmem_ft.recipe.load import resolve

    return resolve(None, {"model": {"name_or_path": model, "compute_dtype": "float32", "quantization": "none"}})


@pytest.fixture(scope="module")
def v1_dir(zoo_models) -> Path:
    return Path(zoo_models["qwen-v1"])


# -- the tokenizer ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def varied_ranks():
    """A rank file trained on text of every kind the test encodes (CJK, code, emoji), so merges cover them."""
    from devkit.qwen_v1 import train_ranks

    return train_ranks(1500, extra=VARIED * 20)


def test_token_ids_equal_tiktokens(varied_ranks):
    import tiktoken  # a [dev] dependency: the reference encoder, never used by lowmem-ft itself

    n = len(varied_ranks)
    reference = tiktoken.Encoding(
        "qwen-test",
        pat_str=qwen_v1.PAT_STR,
        mergeable_ranks=varied_ranks,
        special_tokens={s: n + i for i, s in enumerate(qwen_v1.SPECIALS)},
    )
    ours = qwen_v1.tokenizer_from_ranks(varied_ranks, chat=True)
    assert len(varied_ranks) > 600  # some 450 merges, across CJK, code and emoji
    for text in VARIED + ["".join(VARIED), " " * 17 + "x", "\n" * 5]:
        expected = reference.encode(text, allowed_special="all")
        assert ours.encode(text, add_special_tokens=False) == expected, text
        assert ours.decode(expected) == text
    for i, special in enumerate(qwen_v1.SPECIALS):
        assert ours.convert_tokens_to_ids(special) == n + i


def test_published_special_ids_follow_the_151643_regular_tokens():
    """The published file's count is the code's SPECIAL_START_ID: the specials numbered after the ranks are its ids."""
    ranks = {bytes([b]): b for b in range(256)}
    assert qwen_v1.tokenizer_from_ranks(ranks, chat=False).convert_tokens_to_ids("<|endoftext|>") == 256
    assert qwen_v1.SPECIAL_START_ID == 151643 and qwen_v1.SPECIALS[:3] == (
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
    )
    assert len(qwen_v1.SPECIALS) == 208  # three, then <|extra_0|> … <|extra_204|>


def test_checkpoint_tokenizer_chatml_eos_and_offsets(v1_dir):
    from lowmem_ft.data.tokenize import load_tokenizer

    tok = load_tokenizer(str(v1_dir))
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"  # -Chat: chat_format chatml
    assert tok.chat_template == qwen_v1.CHAT_TEMPLATE
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    enc = tok("say 你好", return_offsets_mapping=True)  # the masks read offsets
    assert len(enc["offset_mapping"]) == len(enc["input_ids"])


# -- the model --------------------------------------------------------------------------------------------------
def v1_forward(state: dict, config: dict, ids):
    """Qwen (v1)'s forward as modeling_qwen.py computes it in fp32 within seq_length (logn / NTK off there)."""
    heads, head_dim, eps = config["num_attention_heads"], config["kv_channels"], config["layer_norm_epsilon"]
    batch, seq = ids.shape

    def rms(x, weight):  # RMSNorm._norm then * weight
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def rotate_half(x):  # rearrange "... (j d) -> ... j d", j=2; cat(-x2, x1)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    inv_freq = 1.0 / config["rotary_emb_base"] ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.outer(torch.arange(seq).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)[None, :, None, :]  # (1, seq, 1, head_dim): v1 keeps (b, s, h, d)
    cos, sin = emb.cos(), emb.sin()
    causal = torch.tril(torch.ones(seq, seq, dtype=torch.bool))
    h = state["transformer.wte.weight"][ids]
    for i in range(config["num_hidden_layers"]):
        p = f"transformer.h.{i}."
        x = rms(h, state[p + "ln_1.weight"])
        qkv = x @ state[p + "attn.c_attn.weight"].T + state[p + "attn.c_attn.bias"]
        q, k, v = (t.view(batch, seq, heads, head_dim) for t in qkv.split(heads * head_dim, dim=-1))
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
        scores = torch.where(causal, scores, torch.finfo(scores.dtype).min)
        attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, heads * head_dim)
        h = h + attn @ state[p + "attn.c_proj.weight"].T
        x = rms(h, state[p + "ln_2.weight"])
        a1, a2 = x @ state[p + "mlp.w1.weight"].T, x @ state[p + "mlp.w2.weight"].T
        h = h + (a1 * torch.nn.functional.silu(a2)) @ state[p + "mlp.c_proj.weight"].T
    return rms(h, state["transformer.ln_f.weight"]) @ state["lm_head.weight"].T


@pytest.fixture(scope="module")
def loaded(v1_dir):
    from lowmem_ft.train.model import load_model

    return load_model(_recipe(str(v1_dir)), device="cpu").eval()


def test_logits_and_loss_equal_the_v1_block(v1_dir, loaded):
    from safetensors.torch import load_file

    state = load_file(v1_dir / "model.safetensors")
    config = json.loads((v1_dir / "config.json").read_text())
    assert type(loaded).__name__ == "Qwen2ForCausalLM" and loaded.config.model_type == "qwen2"
    torch.manual_seed(0)
    ids = torch.randint(0, config["vocab_size"], (2, 24))
    with torch.no_grad():
        out = loaded(input_ids=ids, labels=ids)
        expected = v1_forward(state, config, ids)
    torch.testing.assert_close(out.logits, expected, atol=2e-5, rtol=1e-4)
    plain_loss = torch.nn.functional.cross_entropy(
        expected[:, :-1].reshape(-1, expected.shape[-1]), ids[:, 1:].reshape(-1)
    )
    torch.testing.assert_close(out.loss, plain_loss, atol=1e-5, rtol=1e-5)
    # every native tensor came from the checkpoint: none left at its initialisation
    native = dict(loaded.named_parameters())
    torch.testing.assert_close(
        native["model.layers.1.self_attn.v_proj.bias"], state["transformer.h.1.attn.c_attn.bias"][-64:]
    )
    torch.testing.assert_close(native["model.layers.0.mlp.gate_proj.weight"], state["transformer.h.0.mlp.w2.weight"])


def test_no_repository_code_is_imported(v1_dir, loaded):
    """The checkpoint's .py files raise on import; nothing named after them, or transformers' dynamic modules, is
    loaded — and no --trust-remote-code was needed."""
    assert (v1_dir / "modeling_qwen.py").is_file()
    names = [m for m in sys.modules if "qwen" in m.lower() and not m.startswith(("transformers.models.", "lowmem_ft"))]
    assert not [m for m in names if "modeling_qwen" in m or "tokenization_qwen" in m or "transformers_modules" in m]


def test_chat_generation_stops_where_the_original_code_stopped(v1_dir, loaded):
    """chat_format chatml: <|endoftext|>, <|im_end|>, <|im_start|> end a reply (qwen_generation_utils stop words)."""
    from lowmem_ft.data.tokenize import load_tokenizer

    tok = load_tokenizer(str(v1_dir))
    ids = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>", "<|im_start|>"])
    assert loaded.generation_config.eos_token_id == ids


def test_nf4_storage_loads(v1_dir):
    """QLoRA's path: the split q/k/v and renamed MLP go through bitsandbytes' 4-bit loading."""
    from dataclasses import replace

    from lowmem_ft.train.model import load_model

    recipe = _recipe(str(v1_dir))
    recipe = replace(recipe, model=replace(recipe.model, quantization="nf4"))
    model = load_model(recipe, device="cpu")
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
    assert type(model).__name__ == "Qwen2ForCausalLM"


def test_save_writes_the_native_layout(loaded, tmp_path):
    loaded.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "qwen2" and "auto_map" not in config
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.self_attn.q_proj.weight" in keys and not any("c_attn" in k for k in keys)


# -- planning and refusals --------------------------------------------------------------------------------------
def test_catalog_plans_the_native_architecture():
    from lowmem_ft.memory.arch import catalog, load_architecture

    for name in ("Qwen/Qwen-7B", "Qwen/Qwen-7B-Chat", "Qwen/Qwen-1_8B-Chat", "Qwen/Qwen-14B", "Qwen/Qwen-72B"):
        arch = load_architecture(name)
        assert arch.model_type == "qwen2" and not arch.remote_code, name
        assert arch.linear_names == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert load_architecture("Qwen/Qwen-7B").total_params == catalog()["Qwen/Qwen-7B"]["published_params"]
    assert load_architecture("Qwen/Qwen-7B").max_position_embeddings == 8192  # seq_length
    assert load_architecture("Qwen/Qwen-14B").max_position_embeddings == 2048


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"rotary_pct": 0.5}, "rotary_pct 0.5"),
        ({"no_bias": False}, "no_bias is false"),
        ({"kv_channels": 8}, "kv_channels"),
    ],
)
def test_unmappable_configs_are_one_line(change, says):
    config = {"model_type": "qwen", "hidden_size": 64, "num_attention_heads": 4, "kv_channels": 16,
              "intermediate_size": 384, "num_hidden_layers": 2, "vocab_size": 896, **change}  # fmt: skip
    with pytest.raises(UserError, match=says) as err:
        qwen_v1.CONVERSION.native_config(config, "x")
    assert "\n" not in str(err.value)


def test_a_missing_or_damaged_vocab_file_is_one_line(v1_dir, tmp_path, capsys):
    import shutil

    from lowmem_ft.cli import main

    copy = tmp_path / "qwen"
    shutil.copytree(v1_dir, copy)
    (copy / "qwen.tiktoken").write_text("not base64 at all\n")
    assert main(["data", "stats", "--model", str(copy), "examples/chat.jsonl"]) == 2
    err = capsys.readouterr().err.strip()
    assert "qwen.tiktoken: line 1" in err and "\n" not in err
    (copy / "qwen.tiktoken").unlink()
    assert main(["data", "stats", "--model", str(copy), "examples/chat.jsonl"]) == 2
    assert "without qwen.tiktoken" in capsys.readouterr().err


def test_the_model_card_of_an_adapter_says_how_to_load_it(v1_dir):
    """AutoPeftModelForCausalLM cannot load a Qwen (v1) base (its code): the card says merge, not that snippet."""
    from lowmem_ft.hub import _usage

    text = "\n".join(_usage("me/qwen-adapter", str(v1_dir), merged=False))
    assert "Qwen (v1) checkpoint" in text and "lowmem-ft merge" in text and "AutoPeftModelForCausalLM" not in text
    assert "AutoModelForCausalLM.from_pretrained('me/merged')" in "\n".join(_usage("me/merged", str(v1_dir), True))


@pytest.mark.slow
def test_a_lora_run_exports_to_gguf_as_qwen2(v1_dir, tmp_path, capsys):
    """export reads the v1 shards under the native names (c_attn's rows as q, k, v): the GGUF's logits are the merged
    model's, loaded natively with the adapter merged (f16, to the type's rounding)."""
    from peft import PeftModel

    from lowmem_ft.cli import main
    from lowmem_ft.train.model import load_model
    from tests.export.roundtrip import TEXTS, gguf_model, logits, rounded
    from tests.train.tiny_runs import tiny_run

    data = str(Path(__file__).parents[2] / "examples" / "chat.jsonl")
    tiny_run(str(v1_dir), data, tmp_path, "v1", "training.max_steps=1", "model.quantization=none",
             "logging.wandb_mode=disabled")  # fmt: skip
    out = tmp_path / "v1.gguf"
    assert main(["export", str(tmp_path / "v1"), "--to", "gguf", "--quant", "f16", "--output", str(out)]) == 0
    base = load_model(_recipe(str(v1_dir)), device="cpu")
    merged = PeftModel.from_pretrained(base, str(tmp_path / "v1" / "adapter")).merge_and_unload().eval()
    from lowmem_ft.data.tokenize import load_tokenizer

    ids = load_tokenizer(str(v1_dir))(TEXTS[0], return_tensors="pt")["input_ids"]
    torch.testing.assert_close(logits(gguf_model(out), ids), logits(rounded(merged, "f16"), ids), atol=2e-5, rtol=1e-5)
