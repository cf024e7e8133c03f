"""Every mapped zoo family exported to GGUF and read back by transformers' GGUF loader: the weights are the
streamed merge of base + LoRA adapter (equal to peft's merge_and_unload rounded to the file's type), the logits match,
the tokenizer gives the same ids, and the metadata carries the family's keys."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lowmem_ft.errors import UserError
from lowmem_ft.export.gguf_file import write_gguf
from tests.export.roundtrip import (
    TEXTS,
    confident_top1_agreement,
    gguf_model,
    gguf_tokenizer,
    kl,
    logits,
    rounded,
)
from tests.saved_adapters import save_adapter

# zoo family → whether transformers rebuilds its full config from the GGUF keys (else the test gives it the
# merged model's config: it reads no softcapping / query scale / layer types for Gemma, no head_dim for Qwen3,
# no Llama-3 RoPE scaling — its GGUF_CONFIG_MAPPING; the keys themselves are checked in test_family_keys)
MAPPED = {
    "llama3": False,
    "llama-zephyr": True,
    "mistral": True,  # read back as mistral from general.name; a mistral config cannot be passed (gguf-py has none)
    "qwen2.5": True,
    "qwen3": False,
    "qwen3-finetune": False,
    "gemma2": False,
    "gemma3": False,
    "phi3": True,
}


@pytest.fixture(scope="module")
def merged_refs(zoo_models, tmp_path_factory):
    """family → (base dir, adapter dir, peft's merged model in fp32)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for family in MAPPED:
        base = Path(zoo_models[family])
        torch.manual_seed(0)  # B random too (init_lora_weights=False): the merge must change every adapted linear
        adapter = save_adapter(str(base), root / family, targets="all-linear", init_lora_weights=False)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        merged = PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()
        out[family] = (base, adapter, merged)
    return out


@pytest.fixture(scope="module")
def sharp_refs(zoo_models, tmp_path_factory):
    """Like `merged_refs`, on copies of the bases whose final norm is scaled ×30: logits as peaked as a trained
    model's (a random tiny model's next-token distribution is nearly flat, where any rounding flips the top-1)."""
    import shutil

    from peft import PeftModel
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("sharp")
    out = {}
    for family in ("llama3", "qwen2.5", "gemma2", "phi3"):
        base = root / family
        shutil.copytree(zoo_models[family], base)
        weights = load_file(base / "model.safetensors")
        norm = weights["model.norm.weight"]
        # Gemma's RMSNorm multiplies by (1 + w)
        weights["model.norm.weight"] = (1 + norm) * 30 - 1 if family.startswith("gemma") else norm * 30
        save_file(weights, base / "model.safetensors", metadata={"format": "pt"})
        torch.manual_seed(0)
        adapter = save_adapter(str(base), root / f"{family}-adapter", targets="all-linear", init_lora_weights=False)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        out[family] = (base, adapter, PeftModel.from_pretrained(model, adapter).merge_and_unload().eval())
    return out


def _ids(base: Path, text: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base)(text, return_tensors="pt")["input_ids"]


@pytest.mark.parametrize("family", sorted(MAPPED))
def test_f16_round_trip_equals_the_merged_model(family, merged_refs, tmp_path):
    base, adapter, merged = merged_refs[family]
    path = tmp_path / f"{family}.gguf"
    write_gguf(base, adapter, base, path, "f16", family)
    model = gguf_model(path, None if MAPPED[family] else merged.config)
    ids = _ids(base, TEXTS[0])
    got = logits(model, ids)
    # the file holds exactly the merged weights rounded to f16 (norms and biases in f32)
    torch.testing.assert_close(got, logits(rounded(merged, "f16"), ids), atol=2e-5, rtol=1e-5)
    # and the adapter is in it: the base alone is far from it
    from transformers import AutoModelForCausalLM

    plain = logits(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval(), ids)
    assert (got - plain).abs().max() > 1e-2

    from transformers import AutoTokenizer

    tokenizer = gguf_tokenizer(path)
    for text in TEXTS:
        assert tokenizer(text)["input_ids"] == _ids(base, text)[0].tolist(), text
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(base).chat_template


# llama3 in the fast tier; the other three in the slow one (the suite's time)
@pytest.mark.parametrize(
    "family", ["llama3", *(pytest.param(f, marks=pytest.mark.slow) for f in ("qwen2.5", "gemma2", "phi3"))]
)
def test_q8_0_round_trip(family, sharp_refs, tmp_path):
    base, adapter, merged = sharp_refs[family]
    path = tmp_path / f"{family}.gguf"
    write_gguf(base, adapter, base, path, "q8_0", family)
    model = gguf_model(path, None if MAPPED[family] else merged.config)
    ids = torch.cat([_ids(base, t) for t in TEXTS], dim=1)
    got = logits(model, ids)
    # exactly llama.cpp's Q8_0 blocks of the merged weights ...
    torch.testing.assert_close(got, logits(rounded(merged, "q8_0"), ids), atol=2e-5, rtol=1e-5)
    # ... and close to the unquantized merged model: small KL, the same top-1 wherever the model is not at a tie
    expected = logits(merged, ids)
    assert kl(expected, got) < 1e-2  # llama.cpp reports ~1e-3 for Q8_0 on real models (its perplexity tool)
    agreement, positions = confident_top1_agreement(expected, got, margin=0.5)
    assert positions >= 0.5 * ids.shape[1] and agreement >= 0.99


def test_q8_0_is_about_half_of_f16(merged_refs, tmp_path):
    base, adapter, _ = merged_refs["qwen2.5"]
    sizes = {}
    for quant in ("f16", "q8_0", "bf16"):
        planned = write_gguf(base, adapter, base, tmp_path / f"{quant}.gguf", quant, "q")
        sizes[quant] = (tmp_path / f"{quant}.gguf").stat().st_size
        # the file is its planned tensor bytes plus metadata and alignment, nothing more
        assert 0 < sizes[quant] - sum(p.nbytes for p in planned) < 2 << 20
    assert sizes["bf16"] == sizes["f16"]
    assert 0.5 < sizes["q8_0"] / sizes["f16"] < 0.6  # 34 bytes per 32 weights vs 64


def test_family_keys(merged_refs, tmp_path):
    """The keys llama.cpp needs that transformers' loader does not read back, as the family's config says."""
    import gguf

    checks = {
        "gemma2": {"gemma2.attn_logit_softcapping": 50.0, "gemma2.final_logit_softcapping": 30.0,
                   "gemma2.attention.key_length": 32, "gemma2.attention.sliding_window": 16},
        "gemma3": {"gemma3.attention.key_length": 32, "gemma3.attention.sliding_window": 16},
        "qwen3": {"qwen3.attention.key_length": 32},
        "llama3": {"llama.rope.dimension_count": 16},
    }  # fmt: skip
    for family, expected in checks.items():
        base, adapter, _ = merged_refs[family]
        path = tmp_path / f"{family}.gguf"
        write_gguf(base, adapter, base, path, "f16", family)
        reader = gguf.GGUFReader(path)
        for key, value in expected.items():
            assert reader.get_field(key).contents() == pytest.approx(value), (family, key)
    reader = gguf.GGUFReader(tmp_path / "gemma3.gguf")
    assert reader.get_field("gemma3.attention.sliding_window_pattern").contents() == [True, False]
    # Llama-3.x RoPE scaling as llama.cpp stores it: a factor per rotary pair
    names = {t.name: t for t in gguf.GGUFReader(tmp_path / "llama3.gguf").tensors}
    assert "rope_freqs.weight" in names and names["rope_freqs.weight"].data.max() == pytest.approx(32.0)


def test_granite_keys(zoo_models, tmp_path):
    """Granite's multipliers as llama.cpp's scales (transformers' GGUF loader has no Granite: llama.cpp itself reads
    the file in test_llama_cpp)."""
    import gguf

    base = Path(zoo_models["granite"])
    write_gguf(base, None, base, tmp_path / "g.gguf", "f16", "g")
    reader = gguf.GGUFReader(tmp_path / "g.gguf")
    expected = {"granite.attention.scale": 0.0078125, "granite.embedding_scale": 12.0,
                "granite.residual_scale": 0.22, "granite.logit_scale": 16.0}  # fmt: skip
    for key, value in expected.items():
        assert reader.get_field(key).contents() == pytest.approx(value), key


@pytest.mark.parametrize("family", ["gemma3-vision"])
def test_unmapped_family_is_one_line(family, zoo_models, tmp_path):
    base = Path(zoo_models[family])
    with pytest.raises(UserError, match="no tensor mapping for model_type") as err:
        write_gguf(base, None, base, tmp_path / "x.gguf", "f16", family)
    assert "\n" not in str(err.value)
    assert not list(tmp_path.iterdir())


def test_a_failure_mid_write_leaves_no_file(merged_refs, tmp_path, monkeypatch):
    import lowmem_ft.export.gguf_file as gguf_file

    base, adapter, _ = merged_refs["llama3"]
    calls = {"n": 0}
    encode = gguf_file._encode

    def full_disk(block, qtype):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError(28, "No space left on device")
        return encode(block, qtype)

    monkeypatch.setattr(gguf_file, "_encode", full_disk)
    with pytest.raises(OSError):
        write_gguf(base, adapter, base, tmp_path / "x.gguf", "f16", "x")
    assert not list(tmp_path.iterdir())  # neither x.gguf nor the hidden partial file
