"""devkit/gpu/check.py: the GPU kit's steps. Here they run on the CPU path (`--cpu-smoke`); a CUDA test checks the
probe where a GPU is present.

The whole CPU smoke run (every step of `scripts/gpu_check.sh`, about 70 s on two cores) is opt-in, like the fake-CUDA
probe: `LOWMEM_FT_GPU_SMOKE=1`, before building the kit and before a GPU session (docs/development.md). The kit is
development tooling, not the product, and its parts are tested here one by one on every run: the planner's longest
context, the overrides, the checkpoint writer and the data (below), the report (test_gpu_report.py), the kit's
settings and contents (test_gpu_settings.py, test_gpu_kit.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from devkit.gpu import check as gpu_check
from devkit.gpu import report as gpu_report
from lowmem_ft import cli

ROOT = Path(__file__).resolve().parents[2]


def test_planner_longest_context_is_the_longest_length_the_planner_fits(capsys):
    """The context run's length: `plan` with the run's own --set items fits at it and not 16 tokens longer."""
    model = "meta-llama/Llama-3.1-8B"
    seq = gpu_check.planner_longest_context(model, 24)
    assert seq > 0 and seq % 16 == 0

    def plan(length: int) -> int:
        sets = [x for item in gpu_check.context_overrides(length) for x in ("--set", item)]
        return cli.main(["plan", "--vram", "24", "--model", model, *sets])

    assert plan(seq) == 0
    assert plan(seq + 16) == 2
    assert "memory.max_seq_len" not in str(gpu_check.CONTEXT_FIXED)  # the length is the one thing planned


def test_context_overrides_fix_the_savers_setting_and_one_step():
    items = gpu_check.context_overrides(4096)
    assert items[:3] == ["model.quantization=nf4", "adapter.kind=lora", "memory.micro_batch_size=1"]
    assert {"memory.max_seq_len=4096", "memory.gradient_accumulation=1", "training.max_steps=1"} <= set(items)


def test_checkpoint_is_random_bf16_loadable_and_keeps_ties(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = gpu_check.SMOKE_MODELS["tiny-qwen2"]  # tied embeddings, q/k/v biases
    info = gpu_check.write_checkpoint(config, tmp_path / "m", "cpu")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert model.dtype == torch.bfloat16 and info["params"] == model.num_parameters()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    attn = model.model.layers[0].self_attn
    assert 0.015 < attn.q_proj.weight.float().std().item() < 0.025  # normal(0, 0.02), not zeros, not empty memory
    assert torch.all(attn.q_proj.bias == 0) and torch.all(model.model.norm.weight == 1)
    assert json.loads((tmp_path / "m" / "lowmem_config.json").read_text()) == config

    data = tmp_path / "d.jsonl"
    gpu_check.write_text_data(tmp_path / "m", data, samples=6, shortest=40, longest=60)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "m")
    lengths = [len(tokenizer(json.loads(line)["text"])["input_ids"]) for line in data.read_text().splitlines()]
    assert len(lengths) == 6 and all(40 <= n <= 60 for n in lengths), lengths


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("LOWMEM_FT_GPU_SMOKE"), reason="opt-in CPU smoke run: LOWMEM_FT_GPU_SMOKE=1")
def test_cpu_smoke_runs_every_step_end_to_end(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "GPU_CHECK_SCRATCH": str(tmp_path), "LOWMEM_FT_CACHE": str(tmp_path / "cache")}
    run = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--cpu-smoke", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in records if r["kind"] != "step"]
    assert kinds.count("point") == 3 and kinds.count("checkpoint") == 2
    assert {"env", "probe", "train", "context"} <= set(kinds)
    steps = [r for r in records if r["kind"] == "step"]
    assert steps and all(s["status"] == "ok" for s in steps), steps
    probe = next(r for r in records if r["kind"] == "probe")
    assert probe["preflight"] == [] and "error" not in probe
    for phase in ("forward", "backward"):  # the loss head alone, measured against the model's CPU form
        measured, predicted = probe["loss_head"]["measured"][phase], probe["loss_head"]["predicted"][phase]
        assert abs(predicted - measured) / measured <= 0.08
    for point in (r for r in records if r["kind"] == "point"):
        assert point["status"] == "ok"
        exact, predicted = point["measured"]["exact"], gpu_report.predict_point(point).model_peak_bytes
        assert abs(predicted - exact) / exact <= 0.08  # the CPU harness's target
    train = next(r for r in records if r["kind"] == "train")
    context = next(r for r in records if r["kind"] == "context")
    assert train["rc"] == 0 and train["metrics"]["global_step"] == 2
    assert context["rc"] == 0 and context["metrics"]["global_step"] == 1
    assert context["plan"]["setup"]["max_seq_len"] == gpu_check.SMOKE_CONTEXT_LIMIT
    with tarfile.open(out / "runs.tar") as archive:
        assert {"train/plan.json", "train/memory.jsonl", "context/plan.json"} <= set(archive.getnames())
    calibration = next(r for r in records if r["kind"] == "calibration")  # no CUDA here: said, not failed
    assert "doctor --calibrate measures a CUDA GPU and there is none here" in calibration["error"]
    assert "calibration: none recorded" in run.stdout and not (out / "calibration.json").exists()
    report = (out / "estimator_gpu.md").read_text()
    assert "CPU smoke run — NOT GPU figures" in report
    assert report.count("| tiny-qwen2 |") == 6  # harness and per-phase rows
    assert (out / "gpu_check.log").read_text().rstrip().endswith(report.rstrip().splitlines()[-1])


@pytest.mark.requires_cuda
def test_probe_measures_the_cuda_terms(tmp_path):
    results = tmp_path / "results.jsonl"
    subprocess.run([sys.executable, "-m", "devkit.gpu.check", "probe", "--results", str(results)], cwd=ROOT, check=True)
    probe = json.loads(results.read_text().splitlines()[-1])
    assert probe["preflight"] == [] and "error" not in probe
    assert probe["context"]["device"] > probe["context"]["reserved"] > 0  # the context lies outside torch
    assert probe["cublas"]["bf16 mm"]["kept_allocated"] >= 0
    assert probe["loss_head"]["measured"]["backward"] > probe["loss_head"]["measured"]["forward"] > 0
