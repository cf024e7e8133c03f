"""adapter.init (peft's PiSSA / OLoRA): the start-up decomposition priced against the exact CPU count, the saved
adapter converted so the original base model reproduces the trained one, and resume rebuilding the residual base.

Measured: `PeakMemory` around peft's `get_peft_model` (lowmem_ft.train.model.attach_adapter) on zoo models of three
families, against the memory model's start-up phase (lowmem_ft.memory.adapter_init)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

from lowmem_ft import cli
from lowmem_ft.errors import ConfigError
from lowmem_ft.memory.arch import load_architecture
from lowmem_ft.memory.estimate import Setup, estimate, weight_bytes
from lowmem_ft.recipe.load import resolve
from lowmem_ft.train import run as run_module
from tests.train.tiny_runs import tiny_run, tiny_sets

# fp32 (FAST's storage), 128 tokens (the zoo's chat templates), a checkpoint every step (resume)
SETS = ("memory.max_seq_len=128", "training.max_steps=3", "training.save_steps=1", "logging.wandb_mode=disabled")


def _zoo(name: str, tmp_path_factory) -> str:
    from devkit.zoo import build

    return str(build(name, tmp_path_factory.mktemp("zoo") / name))


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the resumed run redoes the same matmuls: bit for bit
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "family, init, dtype",
    [("llama3", "pissa", "float32"), ("qwen2.5", "pissa_niter_4", "bfloat16"), ("phi3", "olora", "float32"),
     ("llama3", "olora", "bfloat16")],
)  # fmt: skip
def test_the_start_up_decomposition_is_priced(family, init, dtype, tmp_path_factory):
    from lowmem_ft.choosing import setup_from_recipe
    from lowmem_ft.train.measure.peak import PeakMemory
    from lowmem_ft.train.model import attach_adapter, load_model

    path = _zoo(family, tmp_path_factory)
    recipe = resolve("8gb", [f"model.name_or_path={path}", "model.quantization=none", f"model.compute_dtype={dtype}",
                             f"adapter.init={init}", "adapter.r=8"])  # fmt: skip
    model = load_model(recipe)
    with PeakMemory(device="cpu", roots=[model]) as pm:
        loaded = pm.live_bytes
        attach_adapter(model, recipe)
    arch, s = load_architecture(path), setup_from_recipe(recipe, device="cpu")
    est = estimate(arch, s)
    predicted = est.phases["start-up"]
    weights = sum(weight_bytes(arch, s)[:2])
    assert loaded == pytest.approx(weights, rel=1e-3)  # the loaded model (and RoPE's inv_freq buffer)
    # whole moment within 1 %; above the loaded model within 5 % (an upper bound: adapters peft attaches after the
    # largest linear's are counted too: 8 KB on phi3, whose largest linear is not its last)
    assert abs(pm.peak_bytes - predicted) <= 0.01 * predicted
    assert 0 <= (predicted - weights) - (pm.peak_bytes - loaded) <= 0.05 * (pm.peak_bytes - loaded)
    assert est.peak_bytes == estimate(arch, Setup(**{**s.__dict__, "adapter_init": "default"})).peak_bytes


def test_the_plan_shows_the_start_up_moment_and_keeps_the_step_peak():
    arch = load_architecture("meta-llama/Llama-3.1-8B")
    plain = estimate(arch, Setup(quantization="none", max_seq_len=4096))
    by_init = {i: estimate(arch, Setup(quantization="none", max_seq_len=4096, adapter_init=i))
               for i in ("pissa", "pissa_niter_16", "olora")}  # fmt: skip
    assert plain.startup_peak_gb is None and "start-up" not in plain.phases
    for est in by_init.values():
        assert est.peak_bytes == plain.peak_bytes  # the step's peak is unchanged
        assert plain.phases["static"] < est.phases["start-up"] < est.peak_bytes
    work = {i: next(c.bytes for c in e.components if c.phase == "start-up") for i, e in by_init.items()}
    # gate_proj, 4096 → 14336 in bf16, r 16, on CUDA: the fp32 copy and cuSOLVER's input copy, U (out × k), S and
    # Vh (k × in), the product and the result, and this linear's A and B still in fp32
    o, i, k = 14336, 4096, 4096
    copies, factors, products, adapter = 2 * 4 * o * i, 4 * (o * k + k + k * i), 2 * 4 * o * i, 2 * 16 * (o + i)
    assert work["pissa"] == copies + factors + products + adapter
    assert work["pissa_niter_16"] < work["olora"] < work["pissa"]


@pytest.mark.parametrize(
    "sets, says",
    [(("adapter.init=pissa", "model.quantization=nf4"), "nf4 storage cannot hold exactly"),
     (("adapter.init=olora", "model.quantization=none", "adapter.use_dora=true"), "drops the magnitude vectors"),
     (("adapter.init=pissa_niter_4", "model.quantization=none", "adapter.use_rslora=true"), "alpha·√2"),
     (("adapter.init=pissa", "model.quantization=none", "training.method=dpo"), "the residual, not the model"),
     (("adapter.init=eva",), "needs a pass over the training data"),
     (("adapter.init=pissa_niter_x",), "must be one of default, gaussian, pissa, pissa_niter_N")],
)  # fmt: skip
def test_what_cannot_work_is_one_line(sets, says):
    with pytest.raises(ConfigError, match=says):
        resolve("8gb", list(sets))


def _logits(model, ids) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _trained_and_reloaded(result, model_path: str, **reload) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits of the trained model, of the original base with the saved adapter, and of the original base alone."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.arange(3, 35)[None]
    trained = _logits(result.model, ids)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    alone = _logits(base, ids)
    reloaded = PeftModel.from_pretrained(base, str(result.run_dir / "adapter"))
    return trained, _logits(reloaded, ids), alone


@pytest.fixture(scope="module")
def llama3(tmp_path_factory) -> str:
    return _zoo("llama3", tmp_path_factory)


@pytest.fixture(scope="module")
def pissa_run(llama3, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    return tiny_run(llama3, _chat(), out, "pissa", "adapter.init=pissa", "adapter.r=8", *SETS)


def _chat() -> str:
    return os.path.join(os.path.dirname(__file__), "..", "..", "examples", "chat.jsonl")


@pytest.mark.slow
def test_a_pissa_adapter_on_the_original_base_gives_the_trained_model(pissa_run, llama3):
    run = pissa_run.run_dir
    config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    initial = json.loads((run / "initial_adapter" / "adapter_config.json").read_text())
    assert initial["r"] == 8  # (peft's conversion rewrote its init_lora_weights to True, so it loads as saved)
    assert (config["r"], config["lora_alpha"], config["init_lora_weights"]) == (16, 2 * initial["lora_alpha"], True)
    trained, reloaded, alone = _trained_and_reloaded(pissa_run, llama3)
    assert (trained - alone).abs().max() > 1e-2  # training moved the model
    torch.testing.assert_close(reloaded, trained, atol=2e-5, rtol=1e-5)
    # merged into the original base (what lowmem-ft merge does: peft's merge_and_unload), the same outputs
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(llama3, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(run / "adapter")).merge_and_unload()
    torch.testing.assert_close(_logits(merged, torch.arange(3, 35)[None]), trained, atol=2e-5, rtol=1e-5)


@pytest.mark.slow
def test_an_olora_adapter_on_the_original_base_gives_the_trained_model(tmp_path, tmp_path_factory):
    path = _zoo("qwen2.5", tmp_path_factory)
    result = tiny_run(path, _chat(), tmp_path, "olora", "adapter.init=olora", "adapter.r=8", "memory.max_seq_len=128",
                      "training.max_steps=2", "logging.wandb_mode=disabled")  # fmt: skip
    trained, reloaded, alone = _trained_and_reloaded(result, path)
    assert (trained - alone).abs().max() > 1e-2
    torch.testing.assert_close(reloaded, trained, atol=2e-5, rtol=1e-5)


class StopAt(TrainerCallback):
    """SIGTERM at the start of optimizer step `step`: the run finishes that step, saves a checkpoint and stops."""

    def __init__(self, step: int):
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run / "log_history.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.mark.slow
def test_an_interrupted_pissa_run_resumes_on_the_same_residual_base(pissa_run, llama3, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    train = run_module.train
    monkeypatch.setattr(run_module, "train", lambda *a, **k: train(*a, **{**k, "callbacks": [StopAt(2)]}))
    argv = ["train", "--recipe", "8gb", "--name", "pissa", "--no-wandb"]
    for item in tiny_sets(llama3, _chat(), tmp_path, "adapter.init=pissa", "adapter.r=8", *SETS):
        argv += ["--set", item]
    run = tmp_path / "pissa"
    assert cli.main(argv) == 143, _losses(run)  # stopped after step 2, checkpoint-2 kept
    assert not (run / "adapter").exists() and (run / "initial_adapter").is_dir()
    monkeypatch.undo()
    assert cli.main(["train", "--resume", str(run), "--no-wandb"]) == 0
    assert _losses(run) == _losses(pissa_run.run_dir)  # step 3 trained on the residual base of the first start
    a, b = (load_file(r / "adapter" / "adapter_model.safetensors") for r in (run, pissa_run.run_dir))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "init, peft_value", [("default", True), ("gaussian", "gaussian"), ("pissa_niter_2", "pissa_niter_2")]
)
def test_the_init_reaches_peft(init, peft_value, tiny_model):
    from lowmem_ft.train.model import attach_adapter, load_model

    recipe = resolve("8gb", [f"model.name_or_path={tiny_model}", "model.quantization=none", f"adapter.init={init}"])
    model = attach_adapter(load_model(recipe), recipe)
    assert model.peft_config["default"].init_lora_weights == peft_value
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    # default and gaussian (A drawn from a normal instead of kaiming) start as a no-op, B = 0; PiSSA does not
    assert all(not p.any() for p in lora_b) == (init != "pissa_niter_2")
