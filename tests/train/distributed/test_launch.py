"""`train --gpus N`: a 2-process CPU run through accelerate launch, the generated configs, the errors before launch."""

import json
from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file
from safetensors.torch import load_file

from lowmem_ft.cli import main
from lowmem_ft.errors import UserError
from lowmem_ft.recipe.load import resolve
from lowmem_ft.train.distributed import launch

DATA = str(Path(__file__).parents[3] / "examples" / "chat.jsonl")


def _entry(cmd: list[str], module: str, replacement: str) -> list[str]:
    """The launch command with the ranks' `-m module` swapped."""
    at = cmd.index("-m")
    assert cmd[at + 1] == module
    return [*cmd[: at + 1], replacement, *cmd[at + 2 :]]


def _argv(out, tiny_model, *extra):
    return [
        "train", "--vram", "8", "--model", tiny_model, "--data", DATA, "--no-wandb",
        "--set", f"training.output_dir={out}", "--set", "training.max_steps=2", "--set", "training.logging_steps=1",
        "--set", "memory.gradient_accumulation=1", "--set", "memory.max_seq_len=128", "--set", "optimizer.lr=5e-3",
        "--set", "model.quantization=nf4",  # the planner would pick 16-bit weights for a model this small
        *extra,
    ]  # fmt: skip


@pytest.mark.slow
def test_two_cpu_processes_train_one_adapter(tmp_path, tiny_model, capfd, monkeypatch):
    """QLoRA (NF4 base, the 8 GB recipe) under DDP: two gloo ranks through `accelerate launch`, one run dir.

    Rank 1 runs out of memory once (injected after the loss of step 2 by tests/train/faulty_rank.py, which the ranks
    run in place of `lowmem_ft`): both ranks must step down together and finish the same steps, each logging its own
    memory file.
    """
    monkeypatch.setenv("FAULTY_RANK", "1")
    monkeypatch.setenv("FAULTY_STEP", "2")
    launch_run = launch.run
    monkeypatch.setattr(launch, "run", lambda cmd: launch_run(_entry(cmd, "lowmem_ft", "tests.train.faulty_rank")))
    argv = _argv(tmp_path, tiny_model, "--gpus", "2", "--name", "ddp", "--set", "memory.micro_batch_size=2")
    assert main(argv) == 0
    out = capfd.readouterr().out  # the launched processes write to the file descriptors
    run = tmp_path / "ddp"
    assert f"relaunch by hand: {launch.launcher()[0]}" in out
    assert f"--config_file {run / 'accelerate.yaml'}" in out and f"--run-dir {run}" in out
    assert out.count("done: 2 steps") == 1  # rank 0 reports, rank 1 does not
    assert out.count("plan: sft of ") == 1  # the plan once per launch, from rank 0
    assert "2 micro × 1 accumulation × 2 devices = 4 sequences per step" in out and "{'loss'" not in out

    for name in ("recipe.yaml", "run.json", "metrics.json", "log_history.jsonl", "accelerate.yaml", "launch.json"):
        assert (run / name).is_file(), name
    assert sorted(p.name for p in run.iterdir() if p.is_dir()) == ["adapter", "checkpoints"]
    config = load_config_from_file(str(run / "accelerate.yaml"))
    assert config.num_processes == 2 and config.use_cpu and config.distributed_type == "MULTI_GPU"
    # both ranks stepped: the trainer saves one RNG state per process
    checkpoint = run / "checkpoints" / "checkpoint-2"
    assert sorted(p.name for p in checkpoint.glob("rng_state_*.pth")) == ["rng_state_0.pth", "rng_state_1.pth"]
    assert json.loads((run / "metrics.json").read_text())["global_step"] == 2
    assert resolve(run / "recipe.yaml").model.quantization == "nf4"
    info = json.loads((run / "launch.json").read_text())
    assert info["plan"]["strategy"] == "ddp" and info["plan"]["cpu"] is True
    info = json.loads((run / "run.json").read_text())
    assert info["choice"]["gpus"] == 2 and info["choice"]["strategy"] == "ddp"
    adapter = load_file(run / "adapter" / "adapter_model.safetensors")
    assert any("lora_B" in k and t.abs().sum() > 0 for k, t in adapter.items())  # B starts at zero: it trained

    # per-rank memory logs: rank-tagged records, the OOM of rank 1 stepped both ranks down at step 2
    for rank, name in ((0, "memory.jsonl"), (1, "memory.rank1.jsonl")):
        records = [json.loads(line) for line in (run / name).read_text().splitlines()]
        assert records and all(r["rank"] == rank for r in records), name
        oom = [r for r in records if r.get("event") == "oom_recovered"]
        assert len(oom) == 1 and oom[0]["step"] == 2 and oom[0]["memory"]["ranks"] == [1], name
        assert "micro batch 2 → 1" in oom[0]["action"]
        assert max(r["step"] for r in records if "phase" in r) == 2
        after = [r for r in records if r.get("phase") == "forward" and r["t"] > oom[0]["t"]]
        assert after and {r["micro_batch"] for r in after} == {1}  # the redone micro batch ran as 2 × 1 row
    peaks = [
        r for r in map(json.loads, (run / "memory.jsonl").read_text().splitlines()) if r.get("event") == "rank_peaks"
    ]
    assert len(peaks) == 1 and len(peaks[0]["peaks_gb"]) == 2 and min(peaks[0]["peaks_gb"]) > 0


@pytest.fixture
def recipe(tiny_model):
    return resolve("8gb", {"model": {"name_or_path": tiny_model}, "data": {"path": DATA}})


def test_fsdp_config_for_qlora(recipe, tmp_path):
    plan = launch.LaunchPlan(gpus=4, strategy="fsdp", cpu=False)
    config = launch.accelerate_config(recipe, plan, launch.layer_class(recipe))
    fsdp = config["fsdp_config"]
    assert config["distributed_type"] == "FSDP" and config["num_processes"] == 4
    assert config["mixed_precision"] == "bf16"
    assert fsdp["fsdp_transformer_layer_cls_to_wrap"] == "Qwen2DecoderLayer"
    assert fsdp["fsdp_sharding_strategy"] == "FULL_SHARD" and fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert fsdp["fsdp_cpu_ram_efficient_loading"] and fsdp["fsdp_sync_module_states"]
    assert fsdp["fsdp_use_orig_params"] is False  # LoRA: peft wraps the adapters in their own units
    assert fsdp["fsdp_offload_params"] is False
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(config))
    loaded = load_config_from_file(str(path))  # accelerate's own reader accepts it
    assert loaded.distributed_type == "FSDP" and loaded.fsdp_config["fsdp_version"] == 1


@pytest.mark.parametrize("adapter", ["lora", "full"])
def test_fsdp2_config_without_4bit_weights_as_accelerate_reads_it(recipe, tmp_path, monkeypatch, adapter):
    """Unquantized weights get FSDP2; the written file goes through accelerate's own launcher parsing into the
    environment its processes read, and its FSDP plugin built from that environment is FSDP2 with our layer wrap."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    recipe.model.quantization = "none"
    recipe.adapter.kind = adapter
    config = launch.accelerate_config(recipe, launch.LaunchPlan(gpus=4, strategy="fsdp"), launch.layer_class(recipe))
    fsdp = config["fsdp_config"]
    assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_reshard_after_forward"] is True
    assert not {"fsdp_use_orig_params", "fsdp_sync_module_states", "fsdp_backward_prefetch"} & set(fsdp)
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(config))
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(path), "x.py"]))
    for key, value in prepare_multi_gpu_env(args).items():
        monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.transformer_cls_names_to_wrap == ["Qwen2DecoderLayer"]
    assert plugin.cpu_ram_efficient_loading and str(plugin.state_dict_type).endswith("SHARDED_STATE_DICT")


def test_plan_says_which_fsdp():
    from lowmem_ft.memory.sharding import fsdp_version

    assert fsdp_version("nf4")[0] == 1 and "FSDP1 kept" in fsdp_version("nf4")[1]
    assert fsdp_version("none")[0] == 2


def test_zero3_config_with_offload(recipe):
    recipe.optimizer.name = "adamw_torch"
    config = launch.accelerate_config(recipe, launch.LaunchPlan(gpus=8, nodes=2, strategy="zero3", offload=True))
    ds = config["deepspeed_config"]
    assert config["distributed_type"] == "DEEPSPEED" and config["num_processes"] == 16
    assert config["num_machines"] == 2 and "main_process_port" not in config
    assert ds["zero_stage"] == 3 and ds["offload_optimizer_device"] == "cpu" and ds["zero3_init_flag"]
    assert ds["gradient_accumulation_steps"] == recipe.memory.gradient_accumulation


def _one_line_error(capsys, code):
    err = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err and len(err.splitlines()) == 1
    return err


def test_deepspeed_missing_fails_before_launch(capsys, tmp_path, tiny_model):
    err = _one_line_error(capsys, main(_argv(tmp_path, tiny_model, "--gpus", "2", "--strategy", "zero3")))
    assert "pip install deepspeed" in err
    assert not any(tmp_path.iterdir())  # nothing written, nothing launched


def test_fsdp_on_cpu_fails_before_launch(capsys, tmp_path, tiny_model):
    err = _one_line_error(capsys, main(_argv(tmp_path, tiny_model, "--gpus", "2", "--strategy", "fsdp")))
    assert "needs CUDA GPUs" in err and "--strategy ddp" in err


@pytest.mark.parametrize(
    "change,plan,message",
    [
        ({"quantization": "int8"}, dict(strategy="fsdp"), "int8"),
        ({}, dict(strategy="fsdp", offload=True), "optimizer.name=adamw_torch"),
        ({}, dict(strategy="ddp", offload=True), "--offload needs a sharded strategy"),
        ({}, dict(strategy="ddp", nodes=2), "main_process_ip"),
    ],
)
def test_unsupported_combinations(recipe, change, plan, message):
    for key, value in change.items():
        setattr(recipe.model, key, value)
    with pytest.raises(UserError, match=message):
        launch.check(recipe, launch.LaunchPlan(gpus=2, cpu=False, **plan))


def test_run_dir_must_be_prepared(capsys, tmp_path):
    err = _one_line_error(capsys, main(["train", "--run-dir", str(tmp_path)]))
    assert "not a prepared run" in err


def test_auto_strategy_shards_a_full_fine_tune_only_where_accelerate_can(monkeypatch):
    full = resolve(None, {"adapter": {"kind": "full"}, "model": {"quantization": "none"}})
    assert launch.auto_strategy(full, offload=False, cpu=False)[0] == "fsdp"
    strategy, reason = launch.auto_strategy(full, offload=False, cpu=True)
    assert strategy == "ddp" and "GPUs" in reason
    monkeypatch.setattr(launch, "cuda_devices", lambda: 0)
    assert launch.plan_launch(full, gpus=2).strategy == "ddp"  # not refused on the CPU
    assert launch.auto_strategy(full, offload=True, cpu=True)[0] == "fsdp"  # offload still asks for sharding


@pytest.mark.parametrize(
    "step, waited",
    [
        (3, "waited 10 s for it at a collective (training.rank_timeout_s)"),
        (None, "waited 1800 s for it while the ranks"),
    ],
)
def test_a_hung_rank_is_told_by_the_wait_it_hit(step, waited):
    """A rank that hangs while the ranks build is waited for the build wait, not training.rank_timeout_s."""
    from lowmem_ft.rundir import RunStatus
    from lowmem_ft.train.distributed.ranks import SETUP_TIMEOUT_S

    assert SETUP_TIMEOUT_S == 1800
    timed_out = RunStatus("failed", step=step, reason="lost the other ranks: gloo Timed out waiting 10000ms")
    state, rank, why, _ = launch.how_it_ended({0: timed_out, 1: RunStatus("running")}, 10)
    assert (state, rank) == ("failed", 1)
    assert why.startswith(f"rank 1 stopped responding: the other ranks {waited}")
