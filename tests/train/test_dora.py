"""DoRA through peft, priced: the plan predicts more than plain LoRA, and real DoRA runs on the CPU of two zoo
families train their magnitude vectors within the memory model's tolerance (the suite's conftest checks every CPU
run's measured peak and phases against the prediction; `memory_disagreements` is asserted here too)."""

from __future__ import annotations

import json

import pytest
from tiny_runs import memory_disagreements, tiny_run

from lowmem_ft.memory.arch import load_architecture
from lowmem_ft.memory.estimate import Setup, estimate


@pytest.fixture(scope="module", params=["llama3", "qwen2.5"])
def zoo_model(request, tmp_path_factory) -> str:
    """One zoo family's tiny replica (only the two these runs use, not the whole zoo)."""
    from devkit.zoo import build

    return str(build(request.param, tmp_path_factory.mktemp("zoo") / request.param))


def test_a_dora_run_trains_its_magnitudes_within_the_prediction(zoo_model, chat_data, tmp_path):
    # the zoo's chat templates are longer than the embedded model's: 128 tokens keep every sample's answer
    result = tiny_run(zoo_model, chat_data, tmp_path, "dora", "adapter.use_dora=true",
                      "memory.max_seq_len=128", "training.max_steps=2", "logging.wandb_mode=disabled")  # fmt: skip
    config = json.loads((result.run_dir / "adapter" / "adapter_config.json").read_text())
    assert config["use_dora"] is True
    from safetensors.torch import load_file

    saved = load_file(result.run_dir / "adapter" / "adapter_model.safetensors")
    assert any("lora_magnitude_vector" in k for k in saved)
    start = json.loads((result.run_dir / "memory.jsonl").read_text().splitlines()[0])
    assert start["exact"] and memory_disagreements(result.run_dir) == []


def test_the_plan_prices_dora_above_lora_and_rslora_at_lora():
    arch = load_architecture("meta-llama/Llama-3.1-8B")
    lora = Setup(max_seq_len=4096)
    plain, dora = estimate(arch, lora), estimate(arch, Setup(max_seq_len=4096, use_dora=True))
    assert dora.peak_bytes > plain.peak_bytes
    names = dora.by_name()
    assert names["DoRA weight-norm working set"] > 0 and names["DoRA weight norms (kept)"] > 0
    assert "DoRA weight norms (kept)" not in plain.by_name()
    # the magnitude vectors: one fp32 per output feature of each adapted linear, trained with their states
    outputs = sum(lin.out_features for lin in arch.lora_targets(list(lora.lora_targets))) * arch.num_layers
    assert names["gradients"] - plain.by_name()["gradients"] == 4 * outputs
