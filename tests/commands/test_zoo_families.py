"""Every zoo family through the CLI as a user runs it: QLoRA `train` with the shipped recipe's defaults, `plan`,
`generate` (greedy answer = base + adapter) and `merge` (logits = base + adapter), in-process.

A few steps at a short sequence per family; chat formats rotate across families (the masking of every family ×
format is tests/data/test_chat.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from devkit.zoo import NAMES
from lowmem_ft.cli import main
from lowmem_ft.data.readers import load_file
from tests.data.conftest import fixture

FORMATS = {"messages": "messages.jsonl", "sharegpt": "sharegpt.jsonl", "alpaca": "alpaca.jsonl"}
FORMAT_OF = {name: list(FORMATS)[i % 3] for i, name in enumerate(NAMES)}
FORMAT_OF["qwen3-finetune"] = "sharegpt"  # multi-turn data: its template's rewrite splits conversations per turn
PROMPT = "What is 2 plus 3?"


def _data(family: str, tmp: Path) -> str:
    """The format's fixture, four times over (enough micro batches), without system turns for Gemma-2's template."""
    lines = Path(fixture(FORMATS[FORMAT_OF[family]])).read_text().splitlines()
    if family == "gemma2":
        lines = [line for line in lines if '"system"' not in line]
    path = tmp / f"{family}.jsonl"
    path.write_text("\n".join(lines * 4) + "\n")
    load_file(path)  # still valid
    return str(path)


def _train(model: str, data: str, out: Path, name: str) -> Path:
    argv = ["train", "--vram", "8", "--model", model, "--data", data, "--name", name, "--no-wandb"]
    # QLoRA kept as given (the planner would store a model this small in 16 bits); the rest is the 8gb recipe's,
    # attn_implementation sdpa included
    for kv in (
        "model.quantization=nf4",
        "training.max_steps=8",
        "training.logging_steps=1",
        "memory.gradient_accumulation=1",
        "memory.max_seq_len=96",
        "optimizer.lr=0.03",
        "optimizer.warmup_ratio=0",
        f"training.output_dir={out}",
    ):
        argv += ["--set", kv]
    assert main(argv) == 0
    return out / name


def _base_and_adapter(run_dir: Path, dtype=None):
    from peft import PeftModel

    from devkit.zoo import from_pretrained
    from lowmem_ft.rundir import RunDir
    from lowmem_ft.train.model import attention, load_config, quantization_config, torch_dtype

    recipe = RunDir(run_dir).read_recipe()
    kwargs = {"dtype": dtype or torch_dtype(recipe.model.compute_dtype)}
    if dtype is None:
        kwargs["quantization_config"] = quantization_config(recipe)
    kwargs["attn_implementation"] = attention(recipe, load_config(recipe))
    base = from_pretrained(recipe.model.name_or_path, **kwargs)
    return PeftModel.from_pretrained(base, str(run_dir / "adapter")).eval()


@pytest.mark.slow
@pytest.mark.parametrize("family", NAMES)
def test_family_trains_plans_generates_and_merges(zoo_models, family, tmp_path, capsys):
    model = zoo_models[family]
    run_dir = _train(model, _data(family, tmp_path), tmp_path / "runs", family)

    # train: assistant-only loss, loss falls, an adapter peft loads
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["global_step"] == 8 and metrics["last_loss"] < metrics["first_loss"]
    data = json.loads((run_dir / "run.json").read_text())["data"]
    assert data["loss_on"] == "assistant turns" and "assistant tokens" in data["chat_template"]
    adapted = _base_and_adapter(run_dir)
    from lowmem_ft.memory.arch import load_architecture
    from lowmem_ft.recipe.schema import AdapterSection

    names = [n for n, _ in adapted.named_parameters()]
    for module in load_architecture(model).adapter_modules(AdapterSection().target_modules):  # Phi-3: qkv_proj
        assert any(f"{module}.lora_A" in n for n in names), module
    from safetensors import safe_open

    with safe_open(run_dir / "adapter" / "adapter_model.safetensors", "pt") as saved:
        keys = list(saved.keys())
    decoder = "language_model." if family == "gemma3-vision" else "model.layers."  # not Gemma-3's vision tower
    assert keys and all(decoder in key for key in keys), [k for k in keys if decoder not in k][:3]

    # plan: the planner describes the family (eager attention planned where SDPA is refused)
    capsys.readouterr()
    assert main(["plan", "--vram", "8", "--model", model, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"]
    eager = any("eager attention" in c["name"] for c in plan["components"])
    assert eager == (family == "gemma2") and (plan["setup"]["attn_implementation"] == "eager") == eager

    # generate: the streamed greedy answer is base + adapter's, through the saved chat template
    assert main(["generate", str(run_dir), "--prompt", PROMPT, "--max-new-tokens", "8", "--temperature", "0"]) == 0
    streamed = capsys.readouterr().out
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(run_dir / "adapter")
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_dict=True)
    ids = {k: torch.tensor([v]) for k, v in ids.items()}
    with torch.no_grad():
        out = adapted.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    new = out[0, ids["input_ids"].shape[1] :]
    assert len(new) > 0
    assert streamed.strip() == tok.decode(new, skip_special_tokens=True).strip()

    # merge: the merged model's logits are base + adapter's (fp32), and it loads without peft
    merged_dir = tmp_path / "merged"
    assert main(["merge", str(run_dir), "--output", str(merged_dir), "--dtype", "float32"]) == 0
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    # a native checkpoint whatever the base's layout (qwen-v1: Qwen2 with no auto_map, a tokenizer.json)
    assert "auto_map" not in json.loads((merged_dir / "config.json").read_text())
    assert (merged_dir / "tokenizer.json").is_file() and not list(merged_dir.glob("*.py"))
    reference = _base_and_adapter(run_dir, dtype=torch.float32)
    probe = ids["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(
            merged(input_ids=probe).logits, reference(input_ids=probe).logits, atol=1e-4, rtol=1e-4
        )


@pytest.mark.slow
def test_chat_template_key_trains_with_it_and_generate_uses_it(zoo_models, tmp_path):
    """data.chat_template replaces the tokenizer's template for training, and is saved with the adapter."""
    from transformers import AutoTokenizer

    from lowmem_ft.data.templates import LLAMA2

    data = _data("llama-zephyr", tmp_path)
    out = tmp_path / "runs"
    argv = ["train", "--recipe", "8gb", "--model", zoo_models["llama-zephyr"], "--data", data, "--name", "t"]
    for kv in (
        "data.chat_template=llama2",
        "training.max_steps=1",
        "model.quantization=none",
        f"training.output_dir={out}",
    ):
        argv += ["--set", kv]
    assert main([*argv, "--no-wandb"]) == 0
    assert AutoTokenizer.from_pretrained(out / "t" / "adapter").chat_template == LLAMA2
    data_report = json.loads((out / "t" / "run.json").read_text())["data"]
    assert data_report["chat_template"].startswith("data.chat_template: llama2 (lowmem-ft)")
