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


@pytest.fixture(scope="module")
def gemma3_vlm(zoo_models, tmp_path_factory):
    """(base, adapter, peft's merged VLM): a LoRA on every linear of the zoo's Gemma3ForConditionalGeneration, its
    SigLIP tower's included (peft's all-linear takes them), saved as peft saves a run on the VLM."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = Path(zoo_models["gemma3-vision"])
    torch.manual_seed(0)
    # an alpha_pattern key in the VLM's module names: matched before they are renamed to the text model's
    adapter = save_adapter(str(base), tmp_path_factory.mktemp("vlm") / "a", targets="all-linear",
                           init_lora_weights=False,
                           alpha_pattern={"language_model.layers.0.self_attn.q_proj": 64})  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return base, adapter, PeftModel.from_pretrained(model, adapter).merge_and_unload().eval()


def test_gemma3_vlm_exports_its_text_decoder(gemma3_vlm, tmp_path):
    """Gemma-3 4B and up as the Hub ships them: the text decoder under gemma3 names with the adapter merged, the
    tower and projector left out (llama.cpp's mmproj file); f16 and q8_0 hold exactly the merged text model."""
    import gguf
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lowmem_ft.export.stream import Adapter, left_out
    from lowmem_ft.export.text_decoder import GEMMA3

    base, adapter, merged = gemma3_vlm
    assert type(merged).__name__ == "Gemma3ForConditionalGeneration"
    with safe_open(str(adapter / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())  # noqa: SIM118
    assert any(".language_model.layers." in k for k in keys) and any("vision_tower" in k for k in keys)
    assert Adapter(adapter, GEMMA3.name).left_out == sum("vision_tower" in k for k in keys) > 0
    assert left_out(adapter / "adapter_model.safetensors", GEMMA3.name) == sum("vision_tower" in k for k in keys)

    ids = _ids(base, TEXTS[0])
    plain = logits(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval(), ids)
    for quant in ("f16", "q8_0"):
        path = tmp_path / f"{quant}.gguf"
        write_gguf(base, adapter, base, path, quant, "g")
        reader = gguf.GGUFReader(path)
        assert reader.get_field("general.architecture").contents() == "gemma3"
        names = {t.name for t in reader.tensors}
        # the text model's tensors and nothing else: 2 layers × 13 + embedding + final norm (tied: no output)
        assert len(names) == 28 and all(n.startswith(("blk.", "token_embd.", "output_norm.")) for n in names)
        model = gguf_model(path, merged.config.text_config)
        got = logits(model, ids)
        torch.testing.assert_close(got, logits(rounded(merged, quant), ids), atol=2e-5, rtol=1e-5)
        assert (got - plain).abs().max() > 1e-2  # the adapter is in it
    assert reader.get_field("gemma3.attention.sliding_window_pattern").contents() == [True, False]
    # the plan counts the text model's weights alone: the tower's are neither read nor planned
    from lowmem_ft.export.gguf_file import model_config, plan_tensors
    from lowmem_ft.export.plan import make_plan

    config = model_config(base)
    plan = make_plan(plan_tensors(base, config, "f16"), "f16", 0, config)
    assert plan.params == sum(p.numel() for p in merged.model.language_model.parameters())
    tokenizer = gguf_tokenizer(path)
    for text in TEXTS:
        assert tokenizer(text)["input_ids"] == _ids(base, text)[0].tolist(), text
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(base).chat_template


def test_gemma3_vlm_in_transformers_5_layout_exports_the_same_file(gemma3_vlm, tmp_path):
    """The same checkpoint stored under transformers 5's names (`model.language_model.*`, `model.vision_tower.*`,
    `model.multi_modal_projector.*`) gives the same bytes; a tensor of neither part is one line."""
    import shutil

    from safetensors.torch import load_file, save_file

    base, adapter, _ = gemma3_vlm
    write_gguf(base, adapter, base, tmp_path / "hub.gguf", "f16", "g")
    moved = tmp_path / "t5"
    shutil.copytree(base, moved)
    weights = load_file(moved / "model.safetensors")
    renamed = {k.replace("language_model.model.", "model.language_model.") if k.startswith("language_model.")
               else f"model.{k}": v for k, v in weights.items()}  # fmt: skip
    assert any(k.startswith("model.vision_tower.") for k in renamed)
    save_file(renamed, moved / "model.safetensors", metadata={"format": "pt"})
    write_gguf(moved, adapter, moved, tmp_path / "t5.gguf", "f16", "g")
    assert (tmp_path / "t5.gguf").read_bytes() == (tmp_path / "hub.gguf").read_bytes()

    save_file({**renamed, "model.audio_tower.w": torch.zeros(2)}, moved / "model.safetensors")
    with pytest.raises(UserError, match="model.audio_tower.w of a gemma3 checkpoint is neither") as err:
        write_gguf(moved, adapter, moved, tmp_path / "x.gguf", "f16", "g")
    assert "\n" not in str(err.value) and not (tmp_path / "x.gguf").exists()


def test_unmapped_family_is_one_line(zoo_models, tmp_path):
    """A family with no record (a Llama-shaped checkpoint relabelled as OLMo-2, which transformers loads) is
    refused in one line before any file is made."""
    import json
    import shutil

    base = tmp_path / "olmo2"
    shutil.copytree(zoo_models["llama3"], base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "model_type": "olmo2", "architectures": None}))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(UserError, match="no tensor mapping for model_type 'olmo2'") as err:
        write_gguf(base, None, base, out / "x.gguf", "f16", "x")
    assert "\n" not in str(err.value)
    assert not list(out.iterdir())


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
