"""`lowmem-ft export` on finished runs: a LoRA run and a full fine-tune to GGUF that loads back with the merged
model's logits, the Modelfile, and the one-line refusals (memory, disk, K-quants, an existing file)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from lowmem_ft.cli import main
from tests.export.roundtrip import TEXTS, gguf_model, gguf_tokenizer, logits, rounded


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("lowmem-ft export: error: "), err
    assert "Traceback" not in "".join(err)
    return err[-1]


def _merged(run_dir: str):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lowmem_ft.finetuned import open_run

    run = open_run(run_dir)
    if run.full:
        return AutoModelForCausalLM.from_pretrained(run.weights_dir, dtype=torch.float32).eval(), run
    base = AutoModelForCausalLM.from_pretrained(run.base, dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(run.weights_dir)).merge_and_unload().eval(), run


def _check_round_trip(path: Path, run_dir: str, quant: str) -> None:
    from transformers import AutoTokenizer

    merged, run = _merged(run_dir)
    tokenizer = AutoTokenizer.from_pretrained(run.weights_dir)
    ids = tokenizer(TEXTS[0], return_tensors="pt")["input_ids"]
    torch.testing.assert_close(logits(gguf_model(path), ids), logits(rounded(merged, quant), ids), atol=2e-5, rtol=1e-5)
    assert gguf_tokenizer(path)(TEXTS[0])["input_ids"] == ids[0].tolist()


def test_lora_run_exports_f16_and_q8_0_with_a_modelfile(finished_run, tmp_path, capsys):
    out = tmp_path / "done-f16.gguf"
    assert main(["export", finished_run, "--quant", "f16", "--output", str(out), "--ollama"]) == 0
    printed = capsys.readouterr().out
    assert "export plan:" in printed and "host memory" in printed and "never the whole model" in printed
    assert f"ollama create done -f {tmp_path / 'Modelfile'}" in printed
    _check_round_trip(out, finished_run, "f16")
    modelfile = (tmp_path / "Modelfile").read_text()
    assert modelfile.startswith("FROM ./done-f16.gguf\n")
    eos = _merged(finished_run)[1]
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(eos.weights_dir).eos_token
    assert f'PARAMETER stop "{eos}"' in modelfile and "PARAMETER num_ctx 48" in modelfile

    q8 = tmp_path / "done-q8.gguf"
    assert main(["export", finished_run, "--quant", "q8_0", "--output", str(q8)]) == 0
    _check_round_trip(q8, finished_run, "q8_0")
    assert q8.stat().st_size < 0.7 * out.stat().st_size


@pytest.fixture(scope="module")
def full_run(tiny_model, tmp_path_factory) -> str:
    from tests.train.tiny_runs import tiny_run

    out = tmp_path_factory.mktemp("full")
    data = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "chat.jsonl")
    tiny_run(tiny_model, data, out, "full", "adapter.kind=full", "training.max_steps=2", "logging.wandb_mode=disabled")
    return str(out / "full")


def test_full_fine_tune_exports(full_run, tmp_path, capsys):
    out = tmp_path / "full.gguf"
    assert main(["export", full_run, "--quant", "bf16", "--output", str(out)]) == 0
    assert "full fine-tune" in capsys.readouterr().out
    _check_round_trip(out, full_run, "bf16")


def test_default_output_is_in_the_run_dir(finished_run, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run, run, ignore=shutil.ignore_patterns("checkpoints"))
    assert main(["export", str(run)]) == 0
    assert (run / "run-q8_0.gguf").is_file()
    assert main(["export", str(run)]) == 2  # never over an existing file
    assert "exists" in _error(capsys)


def test_host_memory_too_small_is_refused_before_any_work(finished_run, tmp_path, capsys, monkeypatch):
    import lowmem_ft.export.gguf_file as gguf_file

    monkeypatch.setattr(gguf_file, "write_gguf", lambda *a, **k: pytest.fail("the export started"))
    out = tmp_path / "x.gguf"
    assert main(["export", finished_run, "--output", str(out), "--host-ram", "0.00001"]) == 2
    line = _error(capsys)
    assert "needs" in line and "of host memory" in line and "--host-ram 1e-05 allows 10.00 kB" in line
    assert not list(tmp_path.iterdir())


def test_disk_too_small_names_what_fits(finished_run, tmp_path, capsys, monkeypatch):
    from lowmem_ft.export import plan

    f16 = tmp_path / "f16.gguf"
    assert main(["export", finished_run, "--quant", "f16", "--output", str(f16)]) == 0
    size = f16.stat().st_size
    capsys.readouterr()
    # room for the q8_0 file (and the metadata bound) but not for the f16 one
    monkeypatch.setattr(plan, "free_disk", lambda output: int(0.7 * size) + plan.METADATA_BOUND)
    assert main(["export", finished_run, "--quant", "bf16", "--output", str(tmp_path / "y.gguf")]) == 2
    line = _error(capsys)
    assert "the bf16 GGUF needs" in line and "another disk with --output" in line and "--quant q8_0" in line
    assert "--quant f16" not in line
    assert not (tmp_path / "y.gguf").exists()


def test_k_quant_without_llama_cpp_is_one_line(finished_run, tmp_path, capsys, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else find_spec(name, *a)
    )
    assert main(["export", finished_run, "--quant", "q4_k_m", "--output", str(tmp_path / "x.gguf")]) == 2
    assert "pip install 'lowmem-ft[gguf-quants]'" in _error(capsys)
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_k_quant_through_llama_cpp(finished_run, tmp_path, capsys):
    """--quant q4_k_m: the f16 file written, quantized by llama.cpp, renamed; planned disk holds both files."""
    import gguf

    out = tmp_path / "q4.gguf"
    assert main(["export", finished_run, "--quant", "q4_k_m", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "for the f16 file llama.cpp quantizes" in printed and "quantizing to q4_k_m with llama.cpp" in printed
    assert [p.name for p in tmp_path.iterdir()] == ["q4.gguf"]  # neither the f16 file nor a partial one
    reader = gguf.GGUFReader(out)
    assert reader.get_field("general.file_type").contents() == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    # the tiny model's rows (64) are no multiple of 256: llama.cpp's fallbacks for Q4_K / Q6_K, as it documents
    assert {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2} <= {"Q5_0", "Q8_0", "F16"}


def test_unknown_run_dir_is_one_line(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nope")]) == 2
    assert "does not exist" in _error(capsys)


@pytest.mark.slow
def test_lora_run_on_gemma3_vlm_exports_its_text_decoder(zoo_models, tmp_path, capsys):
    """A LoRA run on Gemma3ForConditionalGeneration (the zoo's gemma-3-4b-it replica): f16 and q8_0 files of its
    text decoder with the adapter merged, the plan and the note on the left-out tower printed."""
    import gguf

    from tests.train.tiny_runs import tiny_run

    data = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "chat.jsonl")
    tiny_run(zoo_models["gemma3-vision"], data, tmp_path, "vlm", "training.max_steps=2", "logging.wandb_mode=disabled")
    run_dir = str(tmp_path / "vlm")
    merged, run = _merged(run_dir)
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(run.weights_dir)(TEXTS[0], return_tensors="pt")["input_ids"]
    for quant in ("f16", "q8_0"):
        out = tmp_path / f"vlm-{quant}.gguf"
        assert main(["export", run_dir, "--quant", quant, "--output", str(out)]) == 0
        printed = capsys.readouterr().out
        assert "gemma3_text" in printed and "vision tower and projector are not exported" in printed
        assert "mmproj" in printed and "tensors on the vision tower" not in printed  # the recipe's LoRA: decoder only
        got = logits(gguf_model(out, merged.config.text_config), ids)
        torch.testing.assert_close(got, logits(rounded(merged, quant), ids), atol=2e-5, rtol=1e-5)
        assert gguf_tokenizer(out)(TEXTS[0])["input_ids"] == ids[0].tolist()
        names = [t.name for t in gguf.GGUFReader(out).tensors]
        assert len(names) == 28 and all(n.startswith(("blk.", "token_embd.", "output_norm.")) for n in names)

    # an adapter with LoRA on the tower too (peft's all-linear on the VLM): those tensors are named as left out
    import shutil

    from tests.saved_adapters import save_adapter

    saved = save_adapter(zoo_models["gemma3-vision"], tmp_path / "all-linear", targets="all-linear")
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        shutil.copy(saved / name, run.weights_dir / name)
    assert main(["export", run_dir, "--quant", "f16", "--output", str(tmp_path / "all.gguf")]) == 0
    assert "the adapter's 12 tensors on the vision tower / projector are left out" in capsys.readouterr().out
