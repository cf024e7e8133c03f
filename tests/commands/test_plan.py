"""`lowmem-ft plan` answers offline with a breakdown, writes a recipe `train` accepts, and fails usefully."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lowmem_ft.cli import main
from lowmem_ft.recipe.load import resolve


def test_plan_qwen7b_offline_tiers(capsys):
    for vram in ("8", "24", "40"):
        assert main(["plan", "--vram", vram, "--model", "Qwen/Qwen-7B"]) == 0
        out = capsys.readouterr().out
        assert "predicted peak" in out and "headroom" in out and "gradient_checkpointing:" in out


def test_plan_json_and_output(tmp_path, capsys):
    out_file = tmp_path / "r.yaml"
    assert main(["plan", "--vram", "24", "--model", "Qwen/Qwen2.5-7B", "--json", "--output", str(out_file)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] and data["predicted_peak_gb"] <= data["budget_gb"]
    assert {c["name"] for c in data["components"]} >= {"base weights (linears)", "logits / loss working set"}
    recipe = resolve(str(out_file))
    assert recipe.model.name_or_path == "Qwen/Qwen2.5-7B"
    assert recipe.memory.micro_batch_size == data["recipe"]["memory"]["micro_batch_size"]


def test_a_library_version_note_leaves_the_json_clean(monkeypatch, capsys):
    """With other library versions installed, `plan --json` printed its note on stdout, before the JSON (CI with
    transformers 5.25 failed 20 tests on it): the note goes to stderr, after a plan that was shown."""
    from lowmem_ft import versions

    monkeypatch.setitem(versions.CHECKED, "transformers", "5.0.0")
    assert main(["plan", "--vram", "24", "--model", "Qwen/Qwen2.5-7B", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["fits"]
    assert "checked 5.0.0" in err and "--verify" in err
    # and a refusal stays one line (the note is for a plan that was shown)
    assert main(["plan", "--vram", "8", "--model", "Qwen/Qwen2.5-7B", "--recipe", "40gb"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_plan_too_big_exits_2(capsys):
    assert main(["plan", "--vram", "8", "--model", "Qwen/Qwen2.5-72B"]) == 2
    assert "smaller model" in capsys.readouterr().err


def test_plan_imports_no_torch():
    """`plan` is pure arithmetic: it must not pay torch's or transformers' import (its latency is benchmarked in
    devkit/bench/plan_latency.py, not timed here)."""
    code = (
        "import sys; from lowmem_ft.cli import main; "
        "main(['plan','--vram','24','--model','Qwen/Qwen-7B','--json']); "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'heavy import'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_plan_sizes_the_sequence_from_the_data(tiny_model, chat_data, capsys):
    assert main(["plan", "--vram", "8", "--model", tiny_model, "--data", chat_data, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recipe"]["memory"]["max_seq_len"] == 64  # examples/chat.jsonl: p99 49, rounded up to 64
    assert "p99 49" in out["reasons"]["max_seq_len"]


def test_one_very_long_sample_plans_no_more_than_the_models_positions(tiny_model, tmp_path, capsys):
    """Issue #16: a single 5 MB line made the planner choose max_seq_len 984272. The tiny model has 4096 positions."""
    path = tmp_path / "long.jsonl"
    long_text = " ".join(["the cat sat on the mat"] * 3000)  # ~18k tokens
    path.write_text(json.dumps({"text": "a short one"}) + "\n" + json.dumps({"text": long_text}) + "\n")
    assert main(["plan", "--vram", "8", "--model", tiny_model, "--data", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["recipe"]["memory"]["max_seq_len"] == 4096
    assert out["reasons"]["max_seq_len"].startswith("4096 tokens: the model's 4096 positions")


def test_plan_with_missing_data_is_one_line(tiny_model, capsys):
    assert main(["plan", "--vram", "8", "--model", tiny_model, "--data", "nope.jsonl"]) == 2
    err = capsys.readouterr().err
    assert "data nope.jsonl does not exist" in err and len(err.strip().splitlines()) == 1


def test_full_finetune_from_a_4bit_tier_plans_16bit_storage(capsys):
    """`plan --set adapter.kind=full` from a QLoRA tier used to stop with "full cannot train nf4-quantized weights"."""
    assert main(["plan", "--vram", "24", "--model", "Qwen/Qwen2.5-0.5B", "--set", "adapter.kind=full", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] and out["recipe"]["adapter"]["kind"] == "full"
    assert out["recipe"]["model"]["quantization"] == "none"


def test_full_finetune_that_cannot_fit_says_what_does(capsys):
    assert main(["plan", "--vram", "8", "--model", "Qwen/Qwen2.5-7B", "--set", "adapter.kind=full"]) == 2
    err = capsys.readouterr().err
    assert "QLoRA (nf4) fits: predicted peak" in err and "drop adapter.kind=full" in err


def test_budget_is_vram_less_margin(capsys):
    assert main(["plan", "--vram", "24", "--model", "Qwen/Qwen2.5-7B", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["budget_gb"] == out["vram_gb"] - out["safety_margin_gb"] == 22.5


def test_a_plan_over_the_host_ram_does_not_fit_and_says_what_would(capsys):
    """100k tokens on Llama-3.1-8B at 24 GB offload 26.3 GB of layer inputs: over --host-ram 16 less the margin."""
    argv = ["plan", "--vram", "24", "--model", "meta-llama/Llama-3.1-8B", "--seq-len", "100000", "--host-ram", "16"]
    assert main([*argv, "--json"]) == 2
    out, err = capsys.readouterr()
    record = json.loads(out)
    assert record["fits"] is False and "over the 12.0 GB host budget" in record["unfit_reason"]
    assert err.count("\n") == 1 and "what fits: --seq-len" in err and "--host-ram 31" in err
    assert main([*argv[:-1], "64", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["fits"] and record["host_fits"] and record["host_ram_gb"] == 64 and record["host_budget_gb"] == 60


def test_a_recipe_over_the_host_ram_is_shown_not_fitting(tmp_path, capsys):
    recipe = tmp_path / "long.yaml"
    assert main(["plan", "--vram", "24", "--model", "meta-llama/Llama-3.1-8B", "--seq-len", "100000", "--output",
                 str(recipe)]) == 0  # fmt: skip
    capsys.readouterr()
    argv = ["plan", "--vram", "24", "--model", "meta-llama/Llama-3.1-8B", "--recipe", str(recipe), "--host-ram", "16"]
    assert main([*argv, "--json"]) == 2
    out, err = capsys.readouterr()
    record = json.loads(out)
    assert record["fits"] is False and record["host_fits"] is False and record["headroom_gb"] >= 0
    assert record["unfit_reason"].startswith("keeps 27.3 GB in host RAM") and "does not fit: keeps 27.3 GB" in err
    assert main(argv) == 2
    out = capsys.readouterr().out
    assert "host budget (RAM − margin)" in out and "DOES NOT FIT" in out


def test_plan_prices_dora_above_plain_lora(capsys):
    argv = ["plan", "--vram", "24", "--model", "meta-llama/Llama-3.1-8B", "--recipe", "24gb", "--seq-len", "4096"]
    assert main([*argv, "--json"]) == 0
    lora = json.loads(capsys.readouterr().out)
    assert main([*argv, "--set", "adapter.use_dora=true", "--json"]) == 0
    dora = json.loads(capsys.readouterr().out)
    assert dora["recipe"]["adapter"]["use_dora"] is True and dora["setup"]["use_dora"] is True
    assert dora["predicted_peak_gb"] > lora["predicted_peak_gb"] + 1  # 13.8 → 19.6 GB predicted
    assert {c["name"] for c in dora["components"]} - {c["name"] for c in lora["components"]} == {
        "DoRA weight norms (kept)",
        "DoRA weight-norm working set",
    }


def test_plan_shows_pissa_start_up_beside_an_unchanged_step_peak(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")  # the table's rows whole
    argv = ["plan", "--vram", "24", "--model", "meta-llama/Llama-3.1-8B", "--seq-len", "2048",
            "--set", "model.quantization=none", "--set", "memory.micro_batch_size=1", "--recipe", "24gb"]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    lora = json.loads(capsys.readouterr().out)
    assert main([*argv, "--set", "adapter.init=pissa", "--json"]) == 0
    pissa = json.loads(capsys.readouterr().out)
    assert pissa["predicted_peak_gb"] == lora["predicted_peak_gb"] and "startup_peak_gb" not in lora
    assert 16 < pissa["startup_peak_gb"] < pissa["predicted_peak_gb"]  # the bf16 model + one gate_proj's SVD
    assert main([*argv, "--set", "adapter.init=pissa"]) == 0
    out = capsys.readouterr().out
    assert "pissa init: SVD of gate_proj (once)" in out and "start-up peak" in out


def test_plan_with_nodes_plans_what_train_would(tiny_model, chat_data, tmp_path, monkeypatch, capsys):
    """`plan` and `train` choose by one path (`preparing.planned`): the same flags give the same plan, --nodes
    included (8 devices over 2 machines, each machine's host RAM holding its own 4 processes)."""
    from lowmem_ft.cli import build_parser
    from lowmem_ft.commands.train import request_of
    from lowmem_ft.preparing import choose

    monkeypatch.chdir(tmp_path)  # training.output_dir (runs/) checked writable here
    flags = ["--vram", "8", "--model", tiny_model, "--data", chat_data, "--gpus", "4", "--nodes", "2",
             "--host-ram", "16", "--offload"]  # fmt: skip
    assert main(["plan", *flags, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["gpus"] == 8 and planned["offload"] is True
    recipe, choice = choose(request_of(build_parser().parse_args(["train", *flags])))
    assert json.loads(json.dumps(choice.plan_record(recipe))) == planned
    # the same GPUs on one machine hold twice the processes in its host RAM
    assert main(["plan", *flags[:6], "--gpus", "8", "--host-ram", "16", "--offload", "--json"]) == 0
    one_node = json.loads(capsys.readouterr().out)
    assert one_node["host_need_gb"] == pytest.approx(2 * planned["host_need_gb"], rel=1e-3)


def test_verify_refuses_a_strategy_it_does_not_trace_in_one_line(capsys):
    argv = ["plan", "--vram", "24", "--model", "Qwen/Qwen2.5-7B", "--gpus", "2", "--strategy", "zero2", "--verify"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--verify --gpus 2 traces FSDP plans only (--strategy fsdp); the plan is zero2" in err[0]


@pytest.mark.parametrize("method", ["sft", "dpo", "orpo", "simpo", "kto", "grpo"])
def test_every_reason_line_is_true_for_every_method(method, capsys):
    """With no knob set, no line says the user set it (GRPO's chunked_loss said `set by you (--set)`), the loss a
    method's trainer computes says so, and a paired method's micro batch is said in the recipe's pairs."""
    assert main(["plan", "--vram", "24", "--model", "Qwen/Qwen2.5-7B", "--method", method, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    reasons = record["reasons"]
    assert not [line for line in reasons.values() if "set by you" in line]
    trainers_loss = f"--method {method}'s loss is its TRL trainer's"
    assert (trainers_loss in reasons["chunked_loss"]) == (method != "sft")
    b = record["recipe"]["memory"]["micro_batch_size"]
    said = {"dpo": f"{b} pairs ({2 * b} rows):", "orpo": f"{b} pairs ({2 * b} rows):",
            "simpo": f"{b} pairs ({2 * b} rows):", "grpo": f"{b} completions per micro-step"}  # fmt: skip
    assert reasons["micro_batch_size"].startswith(said.get(method, f"{b}:"))
