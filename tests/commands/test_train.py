"""`lowmem-ft train` end to end on the tiny model, and its user errors."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lowmem_ft.cli import main
from lowmem_ft.recipe.load import resolve
from lowmem_ft.train.model import load_model


def _train(tmp_path, tiny_model, data, *extra):
    return main(
        [
            "train", "--vram", "8", "--model", tiny_model, "--data", data, "--no-wandb",
            "--set", f"training.output_dir={tmp_path}", "--set", "optimizer.lr=5e-3",
            "--set", "training.logging_steps=1", "--set", "memory.gradient_accumulation=2",
            *extra,
        ]
    )  # fmt: skip


@pytest.fixture(scope="module")
def qlora_result(tmp_path_factory, tiny_model):
    """One QLoRA run: NF4 base, paged 8-bit AdamW, checkpointing, 8 steps, a checkpoint every 4.

    It goes through the same functions as `lowmem-ft train` (the command module's flag handling included) but
    in-process, so the test can look at the trained model object itself.
    """
    from lowmem_ft.cli import build_parser
    from lowmem_ft.commands.train import request_of
    from lowmem_ft.preparing import prepare
    from lowmem_ft.train.run import train

    out = tmp_path_factory.mktemp("runs")
    data = str(Path(__file__).parents[2] / "examples" / "chat.jsonl")
    argv = [
        "train", "--vram", "8", "--model", tiny_model, "--data", data, "--no-wandb", "--name", "qlora",
        "--set", f"training.output_dir={out}", "--set", "optimizer.lr=5e-3", "--set", "training.logging_steps=1",
        "--set", "memory.gradient_accumulation=2", "--set", "memory.micro_batch_size=1",
        "--set", "training.max_steps=8", "--set", "training.save_steps=4",
        # the planner would pick 16-bit weights for a tiny model; fixed keys make it QLoRA and are kept as given
        "--set", "model.quantization=nf4", "--set", "memory.gradient_checkpointing=true",
    ]  # fmt: skip
    args = build_parser().parse_args(argv)
    ready = prepare(request_of(args))
    result = train(ready.recipe, ready.run, choice=ready.choice)
    # transformers registered the model's embedding with bitsandbytes' process-wide optimizer manager (8-bit AdamW);
    # a finished run takes it back out, so the model does not outlive the run in this process
    from bitsandbytes.optim import GlobalOptimManager

    mine = {id(m) for m in result.model.modules()}
    result.leftover_overrides = [
        t for t in GlobalOptimManager.get_instance().module_weight_config_triple if id(t[0]) in mine
    ]
    return result


@pytest.fixture(scope="module")
def qlora_run(qlora_result):
    return qlora_result.run_dir


def test_qlora_run_writes_the_run_directory(qlora_run):
    for name in ("recipe.yaml", "run.json", "metrics.json", "log_history.jsonl"):
        assert (qlora_run / name).is_file(), name
    assert (qlora_run / "adapter" / "adapter_model.safetensors").is_file()
    assert (qlora_run / "adapter" / "adapter_config.json").is_file()
    assert (qlora_run / "adapter" / "tokenizer.json").is_file()
    assert (qlora_run / "checkpoints" / "checkpoint-4").is_dir()
    recipe = resolve(qlora_run / "recipe.yaml")
    assert recipe.model.quantization == "nf4"
    assert recipe.optimizer.name == "paged_adamw_8bit"
    assert recipe.memory.gradient_checkpointing is True
    run = json.loads((qlora_run / "run.json").read_text())
    assert run["choice"]["recipe"] == "8gb" and run["choice"]["how"] == "plan"
    plan = json.loads((qlora_run / "plan.json").read_text())
    assert plan["predicted_peak_gb"] <= plan["budget_gb"] and plan["vram_gb"] == 8
    # one meaning of budget_gb everywhere: VRAM − margin, in plan.json, run.json and memory.jsonl
    start = json.loads((qlora_run / "memory.jsonl").read_text().splitlines()[0])
    assert plan["budget_gb"] == run["choice"]["budget_gb"] == start["budget_gb"] == 8 - plan["safety_margin_gb"]
    # the planner sized the sequence from the data's length profile (examples/chat.jsonl: p99 49 tokens)
    assert "p99 49" in plan["reasons"]["max_seq_len"]
    assert 49 <= recipe.memory.max_seq_len < 512
    assert run["data"]["format"] == "messages" and run["data"]["loss_on"] == "assistant turns"


def test_a_finished_run_leaves_no_bnb_optimizer_override_behind(qlora_result):
    assert qlora_result.leftover_overrides == []


def test_qlora_loss_fell(qlora_run):
    metrics = json.loads((qlora_run / "metrics.json").read_text())
    assert metrics["global_step"] == 8
    assert metrics["last_loss"] < metrics["first_loss"] - 0.05


def test_lora_weights_changed_and_quantized_base_did_not(qlora_result):
    adapter = load_file(qlora_result.run_dir / "adapter" / "adapter_model.safetensors")
    lora_b = [t for name, t in adapter.items() if "lora_B" in name]
    assert lora_b and all(t.abs().sum() > 0 for t in lora_b)  # peft initializes B to zero
    assert all(t.dtype == torch.float32 for t in adapter.values())

    fresh = load_model(resolve(qlora_result.run_dir / "recipe.yaml")).state_dict()
    trained = qlora_result.model.get_base_model().state_dict()
    checked = quantized = 0
    for name, tensor in trained.items():
        if "lora_" in name:
            continue
        key = name.replace(".base_layer.", ".")
        # packed NF4 bytes stored as bf16 can read as NaN: compare raw bytes
        assert torch.equal(tensor.view(torch.uint8), fresh[key].view(torch.uint8)), name
        checked += 1
        quantized += name.endswith(".base_layer.weight")
    assert checked > 20 and quantized == 14  # 7 target modules × 2 layers stay NF4 and unchanged
    q_proj = qlora_result.model.get_base_model().model.layers[0].self_attn.q_proj.base_layer
    assert type(q_proj).__name__ == "Linear4bit"
    assert qlora_result.model.get_base_model().model.embed_tokens.weight.dtype == torch.bfloat16  # no fp32 upcast


def _snapshot(run: Path) -> dict[str, tuple[int, bytes]]:
    """Every file of a run directory (but the lock, which a refused command takes and gives back): its bytes and
    modification time."""
    return {
        str(p.relative_to(run)): (p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(run.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


@pytest.mark.parametrize("extra", [[], ["--set", "training.max_steps=10"]], ids=["as-is", "more-steps"])
def test_resume_of_a_finished_run_says_so_and_changes_nothing(qlora_run, capsys, extra):
    """Issue #24: `--resume` on a finished run trained one step past max_steps (with a constant learning rate it
    rewrote the finished adapter and said "done: 9 steps" for an 8-step run); more steps are a new run."""
    before = _snapshot(qlora_run)
    err = _one_line_error(capsys, main(["train", "--resume", str(qlora_run), "--no-wandb", *extra]))
    assert err == (
        f"lowmem-ft train: error: --resume {qlora_run}: the run finished (completed at step 8, weights in "
        f"{qlora_run / 'adapter'}); nothing to continue — to train further, start a new run from them: "
        f"lowmem-ft train --adapter {qlora_run / 'adapter'} ..."
    )
    assert _snapshot(qlora_run) == before and not capsys.readouterr().out


def _one_line_error(capsys, code):
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1
    return err


def test_missing_data_file(capsys, tmp_path, tiny_model):
    err = _one_line_error(capsys, _train(tmp_path, tiny_model, str(tmp_path / "nope.jsonl")))
    assert "nope.jsonl does not exist" in err


def test_bad_jsonl_line_names_file_and_line(capsys, tmp_path, tiny_model):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"text": "fine"}\n{"text": "broken\n')
    err = _one_line_error(capsys, _train(tmp_path, tiny_model, str(data)))
    assert f"{data}:2: invalid JSON" in err


def test_unknown_model(capsys, tmp_path, chat_data):
    err = _one_line_error(capsys, _train(tmp_path, "no/such-model", chat_data))
    assert "'no/such-model'" in err


def test_typo_in_set(capsys, tmp_path, tiny_model, chat_data):
    err = _one_line_error(capsys, _train(tmp_path, tiny_model, chat_data, "--set", "memory.max_seq_length=64"))
    assert "did you mean 'memory.max_seq_len'" in err
    assert "error: --set: unknown key" in err and "8gb.yaml" not in err  # the typo is in --set, not the recipe


def test_a_run_name_that_is_a_path_is_refused(capsys, tmp_path, tiny_model, chat_data):
    out = tmp_path / "runs"
    for name in ("../escaped", str(tmp_path / "abs")):
        argv = ["train", "--vram", "8", "--model", tiny_model, "--data", chat_data, "--name", name, "--no-wandb",
                "--set", f"training.output_dir={out}"]  # fmt: skip
        err = _one_line_error(capsys, main(argv))
        assert "a run name is a name, not a path" in err
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "abs").exists()


def test_no_target(capsys, tiny_model, chat_data):
    err = _one_line_error(capsys, main(["train", "--model", tiny_model, "--data", chat_data]))
    assert "--vram" in err


def test_resume_of_a_non_run(capsys, tmp_path):
    err = _one_line_error(capsys, main(["train", "--resume", str(tmp_path)]))
    assert "not a run directory" in err


def test_resume_of_a_run_without_a_complete_checkpoint(capsys, tmp_path):
    """It says to start again, which works under the same --name (tests/test_rundir.py, tests/train/resilience/test_checkpoints.py)."""
    from lowmem_ft.rundir import RunDir, RunStatus

    run = RunDir.new(tmp_path, "early", "m")
    run.recipe_file.write_text("model:\n  name_or_path: m\n")
    run.write_status(RunStatus.running().ended("failed", reason="bad data"))
    (run.checkpoints / "checkpoint-3").mkdir(parents=True)  # cut short: no trainer_state.json
    run.unlock()
    err = _one_line_error(capsys, main(["train", "--resume", str(run.path)]))
    assert err.endswith(
        f"--resume {run.path}: no complete checkpoint (skipped checkpoint-3: no trainer_state.json (the save did not "
        "finish)), nothing to continue; start the run again without --resume (same --name)"
    )


def test_done_line_says_which_steps_its_losses_are_from():
    """A run shorter than training.logging_steps logs one loss: the done line says so instead of 'loss a → a', and
    a run with no logged loss is a line too, not a format error on None."""
    from lowmem_ft.train.observe.progress import loss_line as _loss_line

    two = {"first_loss": 6.2, "last_loss": 5.75, "first_loss_step": 1, "last_loss_step": 30, "train_loss": 6.0}
    assert _loss_line(two) == "loss 6.2000 → 5.7500 (steps 1 → 30)"
    one = {"first_loss": 7.6474, "last_loss": 7.6474, "first_loss_step": 1, "last_loss_step": 1, "train_loss": 7.6415}
    assert _loss_line(one) == "loss 7.6474 at step 1, the only logged step (mean over the run 7.6415)"
    assert _loss_line({"first_loss": None, "last_loss": None, "train_loss": 7.5}) == "no loss logged (mean 7.5000)"
    assert _loss_line({"first_loss": 6.2, "last_loss": 5.75}) == "loss 6.2000 → 5.7500"  # an older metrics.json


@pytest.mark.parametrize("name", ["two\nlines", "cr\rname", "tab\tname", "nul\x00", "sep\u2028line", "bell\x07"])
def test_a_run_name_that_would_break_its_recipe_file_is_refused(capsys, tmp_path, tiny_model, chat_data, name):
    """Issue #24: `--name 'a<newline>b'` was accepted; the run's recipe.yaml (headed by the name in a comment) was
    then unreadable and `generate`, `merge` and `--resume` all failed on it."""
    out = tmp_path / "runs"
    argv = ["train", "--vram", "8", "--model", tiny_model, "--data", chat_data, "--name", name, "--no-wandb",
            "--set", f"training.output_dir={out}"]  # fmt: skip
    err = _one_line_error(capsys, main(argv))
    assert "argument --name" in err and "printable" in err and repr(name) in err
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.slow
def test_a_gzip_compressed_jsonl_file_trains(tmp_path, tiny_model, capsys):
    """Issue #24: `--data train.jsonl.gz` was refused ("not UTF-8 (byte 1)" for a .jsonl holding gzip); users keep
    data that way and datasets reads it. The run trains on the decompressed lines, as on the plain file."""
    import gzip

    from tests.train.tiny_runs import tiny_sets

    data = tmp_path / "chat.jsonl.gz"
    data.write_bytes(gzip.compress((Path(__file__).parents[2] / "examples" / "chat.jsonl").read_bytes()))
    argv = ["train", "--recipe", "8gb", "--name", "gz", "--no-wandb"]
    for item in tiny_sets(tiny_model, str(data), tmp_path, "training.max_steps=2"):
        argv += ["--set", item]
    assert main(argv) == 0
    run = json.loads((tmp_path / "gz" / "run.json").read_text())
    assert run["data"]["format"] == "messages" and run["data"]["records"] == 96
    assert json.loads((tmp_path / "gz" / "metrics.json").read_text())["global_step"] == 2
