"""llama.cpp itself on the files `export` writes (llama-cpp-python, the `gguf-quants` extra; skipped without it).

For every mapped zoo family (the Gemma-3 VLM's text decoder included) the f16 GGUF is loaded by `llama_cpp.Llama` and its logits compared with the merged
model's; its tokenizer (`vocab_only`) encodes sample text to the Hugging Face tokenizer's ids. The quantized files —
q8_0 (written by lowmem-ft) and q4_k_m (llama.cpp's own quantizer, `lowmem_ft.export.llama_quant`) — are compared
with the unquantized merged model by KL and top-1 agreement, on bases whose logits are peaked like a trained
model's (`sharpened`), and q4_k_m on a base wide enough (rows of 256) for llama.cpp's K-quant blocks rather than
their 32-block fallbacks.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from lowmem_ft.errors import UserError
from lowmem_ft.export.gguf_file import write_gguf
from tests.export.roundtrip import TEXTS, confident_top1_agreement, kl, logits, rounded
from tests.saved_adapters import save_adapter

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None,
    reason="llama-cpp-python is not installed (pip install 'lowmem-ft[gguf-quants]': a source build of llama.cpp)",
)

# gemma3-vision: a Gemma3ForConditionalGeneration, its text decoder exported (the tower left out)
FAMILIES = ["llama3", "llama-zephyr", "mistral", "qwen2.5", "qwen3", "qwen3-finetune", "gemma2", "gemma3",
            "gemma3-vision", "phi3", "granite"]  # fmt: skip


def llama(path: Path, **kwargs):
    from llama_cpp import Llama

    return Llama(model_path=str(path), n_ctx=256, n_threads=2, verbose=False, **kwargs)


def llama_logits(path: Path, ids: list[int]) -> torch.Tensor:
    """llama.cpp's logits for every position of `ids` (fp32, CPU)."""
    model = llama(path, logits_all=True)
    model.eval(ids)
    scores = np.array(model.scores[: model.n_tokens], dtype=np.float32)
    model.close()
    return torch.from_numpy(scores)[None]


def hf_ids(base: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base)(text)["input_ids"]


def merged(base: Path, adapter: Path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().eval()


def sharpened(source: Path, out: Path, config_changes: dict | None = None, factor: float = 30) -> Path:
    """A copy of a zoo base whose final norm is ×`factor` (logits as peaked as a trained model's; a random tiny model's
    are flat, where any rounding flips near-ties), optionally re-initialized at another shape."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, out)
    if config_changes:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(out)
        for key, value in config_changes.items():
            setattr(config, key, value)
        torch.manual_seed(0)
        for f in out.glob("*.safetensors"):
            f.unlink()
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    (shard,) = out.glob("*.safetensors")
    weights = load_file(shard)
    norm = weights["model.norm.weight"]
    gemma = json.loads((out / "config.json").read_text())["model_type"].startswith("gemma")
    weights["model.norm.weight"] = (1 + norm) * factor - 1 if gemma else norm * factor  # Gemma: x · (1 + w)
    save_file(weights, shard, metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def adapters(zoo_models, tmp_path_factory):
    """family → (base, random LoRA adapter on every linear, peft's merged model), built when first asked for."""
    root = tmp_path_factory.mktemp("llama-cpp")
    built = {}

    def get(family: str):
        if family not in built:
            base = Path(zoo_models[family])
            torch.manual_seed(0)
            adapter = save_adapter(str(base), root / family, targets="all-linear", init_lora_weights=False)
            built[family] = (base, adapter, merged(base, adapter))
        return built[family]

    return get


# llama3 in the fast tier (where llama-cpp-python is installed); the other families in the slow one
@pytest.mark.parametrize(
    "family", ["llama3", *(pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES if f != "llama3")]
)
def test_llama_cpp_reads_the_f16_file_as_the_merged_model(family, adapters, tmp_path):
    base, adapter, model = adapters(family)
    path = tmp_path / f"{family}.gguf"
    write_gguf(base, adapter, base, path, "f16", family)

    # the tokenizer: llama.cpp's own (vocab_only) gives the Hugging Face ids, BOS included where the family adds it
    vocab = llama(path, vocab_only=True)
    for text in TEXTS:
        assert vocab.tokenize(text.encode(), add_bos=True, special=False) == hf_ids(base, text), (family, text)
    vocab.close()

    ids = hf_ids(base, TEXTS[0])
    got = llama_logits(path, ids)
    expected = logits(rounded(model, "f16"), torch.tensor([ids]))
    # llama.cpp's CPU matmul with f16 weights rounds the activations to f16 too: equal to that precision
    scale = expected.abs().max()
    assert (got - expected).abs().max() / scale < 1e-2, (family, float((got - expected).abs().max()), float(scale))
    assert kl(expected, got) < 1e-4
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.95


@pytest.fixture(scope="module")
def sharp(zoo_models, tmp_path_factory):
    """(base, adapter, merged) on sharpened bases: two families at the zoo's width, and a Llama at hidden 256
    (rows of 256: llama.cpp's K-quant blocks apply, not their 32-block fallbacks)."""
    root = tmp_path_factory.mktemp("llama-cpp-sharp")
    shapes = {
        "qwen2.5": ("qwen2.5", None),
        "gemma2": ("gemma2", None),
        "llama3-wide": ("llama3", {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}),
    }
    out = {}
    for name, (family, changes) in shapes.items():
        # at hidden 256 the random model's logits are already wider: ×10 gives them a trained model's peaks
        base = sharpened(Path(zoo_models[family]), root / name, changes, factor=10 if changes else 30)
        torch.manual_seed(0)
        adapter = save_adapter(str(base), root / f"{name}-adapter", targets="all-linear", init_lora_weights=False)
        out[name] = (base, adapter, merged(base, adapter))
    return out


def _quantized(quant: str, base: Path, adapter: Path, path: Path) -> None:
    if quant == "q8_0":
        write_gguf(base, adapter, base, path, "q8_0", "x")
        return
    from lowmem_ft.export.llama_quant import write_quantized

    write_quantized(lambda f16: write_gguf(base, adapter, base, f16, "f16", "x"), path, quant)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2.5", "gemma2"])
def test_q8_0_in_llama_cpp_agrees_with_the_merged_model(name, sharp, tmp_path):
    """Measured (llama.cpp 0.3.36, CPU): KL 8.5e-3 / 5.9e-3, top-1 agreement 1.000 on 45 / 48 positions."""
    base, adapter, model = sharp[name]
    path = tmp_path / f"{name}-q8_0.gguf"
    _quantized("q8_0", base, adapter, path)
    ids = hf_ids(base, TEXTS[0]) + hf_ids(base, TEXTS[1])
    got = llama_logits(path, ids)
    expected = logits(model, torch.tensor([ids]))
    agreement, positions = confident_top1_agreement(expected, got, margin=0.5)
    assert kl(expected, got) < 1e-2  # the bound for q8_0
    assert positions >= 0.5 * len(ids) and agreement >= 0.99


@pytest.mark.slow
def test_q4_k_m_in_llama_cpp_is_the_merged_model_in_k_quant_blocks(sharp, tmp_path):
    """llama.cpp runs the q4_k_m file as transformers runs the same file's blocks dequantized (its GGUF loader):
    the file holds the merged model quantized and nothing else. Against the unquantized merged model the 4-bit
    rounding itself shows (measured in the print; a wrong tensor layout would leave no agreement at all)."""
    from tests.export.roundtrip import gguf_model

    base, adapter, model = sharp["llama3-wide"]
    path = tmp_path / "q4_k_m.gguf"
    _quantized("q4_k_m", base, adapter, path)
    ids = hf_ids(base, TEXTS[0]) + hf_ids(base, TEXTS[1])
    got = llama_logits(path, ids)
    same_blocks = logits(gguf_model(path, model.config), torch.tensor([ids]))
    unquantized = logits(model, torch.tensor([ids]))
    agreement, positions = confident_top1_agreement(same_blocks, got, margin=0.5)
    to_merged, merged_positions = confident_top1_agreement(unquantized, got, margin=0.5)
    print(f"q4_k_m: vs its own blocks KL {kl(same_blocks, got):.2e} agreement {agreement:.3f} ({positions}); "
          f"vs the merged model KL {kl(unquantized, got):.2e} agreement {to_merged:.3f} ({merged_positions})")  # fmt: skip
    # llama.cpp's CPU matmul rounds the activations to 8 bits for K-quant weights: close, not equal
    assert kl(same_blocks, got) < 2e-2 and positions >= 0.5 * len(ids) and agreement >= 0.95
    assert to_merged >= 0.5


@pytest.mark.slow
def test_q4_k_m_is_llama_cpps_k_quant_mix(sharp, tmp_path):
    """The file holds llama.cpp's Q4_K_M choices (Q4_K matrices, Q6_K where its mix says), smaller than q8_0."""
    import gguf

    base, adapter, _ = sharp["llama3-wide"]
    _quantized("q4_k_m", base, adapter, tmp_path / "q4.gguf")
    _quantized("q8_0", base, adapter, tmp_path / "q8.gguf")
    reader = gguf.GGUFReader(tmp_path / "q4.gguf")
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    # tied embeddings (no output.weight): llama.cpp quantizes token_embd as the output matrix, Q6_K
    assert types["blk.0.attn_q.weight"] == "Q4_K" and types.get("output.weight", types["token_embd.weight"]) == "Q6_K"
    assert "Q6_K" in {types["blk.0.attn_v.weight"], types["blk.1.attn_v.weight"]}  # the mix's more bits for attn_v
    assert types["blk.0.attn_norm.weight"] == "F32"
    assert reader.get_field("general.file_type").contents() == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    assert (tmp_path / "q4.gguf").stat().st_size < 0.7 * (tmp_path / "q8.gguf").stat().st_size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q4.gguf", "q8.gguf"]  # no f16 or partial file left


def test_a_quantizer_failure_leaves_no_file(tmp_path):
    """llama.cpp refusing its input (here a file that is no GGUF) raises with its reason; neither the f16 file nor
    a partial output is left, and nothing is under the final name."""
    from lowmem_ft.export.llama_quant import write_quantized

    with pytest.raises(UserError, match="llama.cpp's quantizer failed"):
        write_quantized(lambda f16: f16.write_bytes(b"not a gguf file"), tmp_path / "x.gguf", "q4_k_m")
    assert not list(tmp_path.iterdir())
