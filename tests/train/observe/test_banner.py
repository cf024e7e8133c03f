"""The plan on the console: what the run chose, the same lines for every method, printed once on rank 0."""

from __future__ import annotations

from transformers import TrainerControl, TrainerState, TrainingArguments

from lowmem_ft.choosing import Choice
from lowmem_ft.memory.target import Target
from lowmem_ft.recipe.load import resolve
from lowmem_ft.train.observe.banner import PlanBanner, RunView, count, savers_on


def _recipe(*sets: str):
    return resolve("8gb", ["model.name_or_path=org/model", *sets])


def test_a_planned_run_shows_every_choice():
    recipe = _recipe("memory.micro_batch_size=2", "memory.gradient_accumulation=4", "memory.max_seq_len=2048",
                     "memory.chunked_loss=true", "optimizer.name=adamw_8bit")  # fmt: skip
    choice = Choice("plan", "8gb", "org/model", Target(8, 0.75), predicted_peak_gb=6.4, fits=True)
    view = RunView("sft", recipe, choice, 20_000_000, 7_600_000_000, world_size=1, max_steps=500, host_gb=0.0,
                   machine_ram_gb=31.2, run_dir="runs/demo", trackers=("W&B https://wandb.ai/me/p/runs/x",))  # fmt: skip
    text = "\n".join(view.lines())
    assert text.splitlines()[0] == "plan: sft of org/model, planned for --vram 8 from recipe 8gb"
    a = recipe.adapter
    assert f"LoRA rank {a.r} (alpha {a.alpha}) on {', '.join(a.target_modules)}: 20.00M trainable of 7.60B" in text
    assert "4-bit NF4" in text or "16-bit" in text  # the recipe's storage, whichever the tier has
    assert "2 micro × 4 accumulation × 1 device = 8 sequences per step, ≤ 2048 tokens each, 500 steps" in text
    assert "savers   gradient checkpointing, chunked loss" in text
    assert "predicted peak 6.40 GB of the 7.25 GB budget (8 GB − 0.75 GB margin): fits" in text
    assert "host     nothing offloaded to host memory; this machine has 31.2 GB" in text
    assert "run      runs/demo" in text and "tracker  W&B https://wandb.ai/me/p/runs/x" in text


def test_other_methods_devices_and_unplanned_runs_read_alike():
    recipe = _recipe("adapter.kind=full", "model.quantization=none", "memory.activation_offloading=true",
                     "optimizer.name=paged_adamw_8bit", "memory.gradient_accumulation=2")  # fmt: skip
    unplanned = RunView("dpo", recipe, Choice("recipe", "my.yaml", "org/model"), 100, 100, world_size=4)
    text = "\n".join(unplanned.lines())
    assert text.startswith("plan: dpo of org/model, recipe my.yaml")
    assert "adapter  none: full fine-tune, 100 trainable of 100 (100.00 %)" in text
    assert f"{recipe.memory.micro_batch_size} micro × 2 accumulation × 4 devices = " in text
    assert "activation offloading" in text and "paged optimizer (paged_adamw_8bit)" in text
    assert "memory   not planned (no --vram)" in text
    assert not [line for line in unplanned.lines() if line.startswith("  host")]  # no plan, no machine figure given
    over = Choice("plan", "8gb", "org/model", Target(8, 1, gpus=4), predicted_peak_gb=7.5, fits=False)
    text = "\n".join(RunView("sft", recipe, over, 1, 2, world_size=4, host_gb=12.5, machine_ram_gb=64).lines())
    assert "7.00 GB budget per device" in text and "OVER the budget" in text
    assert "12.50 GB per process planned in host memory (offloaded parts); this machine has 64.0 GB" in text
    host_planned = Choice("plan", "8gb", "org/model", Target(8, 1, host_ram_gb=30.0, host_margin_gb=4.0))
    text = "\n".join(RunView("sft", recipe, host_planned, 1, 2, host_gb=0.0, machine_ram_gb=64).lines())
    assert "nothing offloaded to host memory; host budget 26.0 GB (30.0 GB available − 4 GB margin)" in text


def test_a_calibrated_gpu_is_said_under_the_memory_line():
    """The calibration's line (`lowmem_ft.calibrated`) and what it took from the budget; a stale one is said too."""
    said = "calibrated on this GPU: +0.41 GB reserved over allocated (NVIDIA H100 80GB HBM3, 2 measurements)"
    choice = Choice("plan", "8gb", "org/model", Target(8, 0.75, calibration_gb=0.41, calibration=said),
                    predicted_peak_gb=6.4, fits=True)  # fmt: skip
    lines = RunView("sft", _recipe(), choice, 1, 2).lines()
    memory = lines.index(next(line for line in lines if line.startswith("  memory")))
    assert "of the 6.84 GB budget (8 GB − 0.75 GB margin − 0.41 GB calibrated): fits" in lines[memory]
    assert lines[memory + 1] == f"  margin   {said}"
    stale = Choice("plan", "8gb", "org/model", Target(8, 0.75, calibration="the calibration of this GPU is ignored"))
    assert "  margin   the calibration of this GPU is ignored" in RunView("sft", _recipe(), stale, 1, 2).lines()
    assert not any(
        line.startswith("  margin") for line in RunView("sft", _recipe(), Choice("recipe", "x", "m"), 1, 2).lines()
    )


def test_counts_and_savers():
    assert (count(7_615_616_512), count(20_185_088), count(16_384), count(999)) == ("7.62B", "20.19M", "16.38K", "999")
    assert savers_on(_recipe("memory.gradient_checkpointing=false", "optimizer.name=adamw_torch")) == []


def test_the_banner_prints_once_and_only_on_rank_0(tmp_path, capsys):
    view = RunView("sft", _recipe(), Choice("recipe", "8gb", "org/model"), 1, 2, run_dir=str(tmp_path))
    banner = PlanBanner(view)
    args, control = TrainingArguments(str(tmp_path), report_to=[]), TrainerControl()
    other = TrainerState(max_steps=3)
    other.is_world_process_zero = False
    capsys.readouterr()  # what transformers printed importing its tracker integrations
    banner.on_train_begin(args, other, control)
    assert capsys.readouterr().out == ""
    state = TrainerState(max_steps=3)
    banner.on_train_begin(args, state, control)
    banner.on_train_begin(args, state, control)  # a second train() in the process: said once
    out = capsys.readouterr().out
    assert out.count("plan: sft of org/model") == 1 and ", 3 steps" in out
    assert f"tracker  none (the run's logs are in {tmp_path})" in out
