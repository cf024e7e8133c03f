"""GRPO end to end (lowmem_ft/train/methods/grpo.py): `train --vram 8 --method grpo` on TRL's GRPOTrainer with a built-in
reward and with a reward function from a file, each run's phases measured against the memory model (the suite's
check); and what a run needs around it: pieces weighted as TRL normalises each loss, the recipe's refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

from lowmem_ft.cli import main
from lowmem_ft.errors import UserError
from lowmem_ft.recipe.load import resolve

FIXTURES = Path(__file__).parents[1] / "data" / "fixtures" / "grpo"
GSM8K = str(FIXTURES / "gsm8k_mini.jsonl")
GSM8K_CHAT = str(FIXTURES / "gsm8k_chat.jsonl")
TINY_ROUND = [
    "--set", "grpo.num_generations=2", "--set", "grpo.max_completion_length=8", "--set", "memory.micro_batch_size=2",
    "--set", "memory.gradient_accumulation=2", "--set", "training.logging_steps=1", "--max-steps", "2", "--no-wandb",
]  # fmt: skip


def _records(run_dir: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines() if line.strip()]


class OutOfMemoryOnce(TrainerCallback):
    """Raises `torch.OutOfMemoryError` before the first training forward of `step` (not generation's or scoring's
    no-grad forwards)."""

    def __init__(self, step: int):
        self.step, self.state, self.raised = step, None, 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.state = state
        model.register_forward_pre_hook(self._before_forward)

    def _before_forward(self, module, args):
        if module.training and torch.is_grad_enabled() and self.state.global_step + 1 == self.step and not self.raised:
            self.raised += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected by the test)")


@pytest.mark.slow
def test_grpo_trains_with_a_builtin_reward(zoo_models, tmp_path, capsys, monkeypatch):
    """`train --vram 8 --method grpo` with GSM8K's columns and built-in rewards, no user code: the adapter is saved,
    each reward's mean / std, the completion length and the clip ratio are logged, the monitor marks generation as a
    phase with its prediction (the suite compares each phase within 8 %, the split micro-step's too), the done line
    shows the reward trend, and `generate` and `merge` take the run. An OOM in step 2's training forward is
    recovered by the guard: the micro-step runs in pieces of one completion, the round is not generated again."""
    from lowmem_ft.train import run as run_module

    oom = OutOfMemoryOnce(step=2)
    train = run_module.train
    monkeypatch.setattr(run_module, "train", lambda *a, **k: train(*a, **{**k, "callbacks": [oom]}))
    argv = ["train", "--vram", "8", "--method", "grpo", "--model", zoo_models["llama3"], "--data", GSM8K,
            "--set", "data.columns={prompt: question}", "--set", "grpo.rewards=[numeric_match, format:0.5]",
            "--output-dir", str(tmp_path), "--name", "builtin", *TINY_ROUND]  # fmt: skip
    assert main(argv) == 0
    done = capsys.readouterr().out
    assert "reward " in done.split("done:")[-1] and "→" in done.split("done:")[-1]
    run = tmp_path / "builtin"
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    logged = [h for h in _records(run, "log_history.jsonl") if "loss" in h]
    for key in ("rewards/numeric_match/mean", "rewards/numeric_match/std", "rewards/format/mean", "reward",
                "completions/mean_length", "clip_ratio/region_mean"):  # fmt: skip
        assert key in logged[-1], key
    samples = [r for r in _records(run, "memory.jsonl") if "phase" in r]
    generation = [r for r in samples if r["phase"] == "generation"]
    assert len(generation) == 2 and all(r.get("predicted_peak_live_gb") for r in generation)
    assert generation[0]["batch"] == [4, generation[0]["batch"][1]]  # b 2 × 2 micro-steps per round
    assert oom.raised == 1
    recovered = [r for r in _records(run, "memory.jsonl") if r.get("event") == "oom_recovered"]
    assert len(recovered) == 1 and recovered[0]["step"] == 2
    assert {r["micro_batch"] for r in samples if r["phase"] == "forward" and r["step"] == 2} >= {1}
    assert len([r for r in samples if r["phase"] == "generation" and r["step"] == 2]) == 1  # not generated again
    recipe = json.loads((run / "run.json").read_text())["data"]
    assert recipe["prompt_fit"]["kept"] == 16 and "answer" in recipe["columns"]
    assert main(["generate", str(run), "--prompt", "Tom has 3 apples", "--max-new-tokens", "4"]) == 0
    assert main(["merge", str(run), "--output", str(tmp_path / "merged")]) == 0
    assert (tmp_path / "merged" / "config.json").is_file()


@pytest.mark.slow
def test_grpo_trains_with_a_reward_function_from_a_file(zoo_models, tmp_path, capsys):
    """Conversations (a reference answer dropped from the prompt) through Qwen's chat template, scored by the user's
    own function named on the command line with a weight; the data's `answer` column reaches it by name."""
    reward = tmp_path / "my_rewards.py"
    reward.write_text(
        "seen = []\n"
        "def brevity(completions, answer, **kwargs):\n"
        "    seen.append(len(answer))\n"
        "    return [1.0 / (1 + len(str(c))) for c in completions]\n"
    )
    argv = ["train", "--vram", "8", "--method", "grpo", "--model", zoo_models["qwen2.5"], "--data", GSM8K_CHAT,
            "--reward-fn", f"{reward}:brevity:2", "--output-dir", str(tmp_path), "--name", "file", *TINY_ROUND]  # fmt: skip
    assert main(argv) == 0
    logged = [h for h in _records(tmp_path / "file", "log_history.jsonl") if "loss" in h]
    assert "rewards/brevity/mean" in logged[-1]
    assert any(r.get("phase") == "generation" for r in _records(tmp_path / "file", "memory.jsonl"))


@pytest.mark.memory_unchecked(reason="no training run: a recipe refused before anything runs")
def test_a_reward_file_in_a_recipe_is_refused(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("training: {method: grpo}\ngrpo: {rewards: ['my_rewards.py:score']}\n")
    with pytest.raises(UserError, match="names a Python file; a reward function from a file is named on the command"):
        resolve(str(recipe))
    with pytest.raises(UserError, match="unknown reward 'exactmatch'"):
        resolve(None, ["grpo.rewards=[exactmatch]"])


@pytest.mark.parametrize("how", [["--set", "grpo.use_vllm=true"]])
def test_vllm_is_refused_in_one_line_saying_why(how, capsys, tiny_model, chat_data):
    code = main(["train", "--model", tiny_model, "--data", chat_data, "--method", "grpo", "--recipe", "8gb", *how])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "transformers < 5.18" in err and "5.24" in err


def test_reward_fn_is_for_grpo_and_checked_before_any_model_is_loaded(tmp_path, capsys, tiny_model, chat_data):
    code = main(["train", "--model", tiny_model, "--data", chat_data, "--recipe", "8gb",
                 "--reward-fn", str(tmp_path / "missing.py") + ":f"])  # fmt: skip
    assert code == 2 and "no such file" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.memory_unchecked(reason="no training run: one micro-step's loss computed whole and in pieces")
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo"])
def test_pieces_add_up_to_the_micro_step_for_each_loss(zoo_models, tmp_path, loss_type):
    """The guard's pieces of a micro-step, weighted by `piece_weights`, give the loss (and so the gradients) of the
    whole micro-step as TRL normalises `loss_type`; the advantages come with the round, untouched by the cut."""
    from trl import GRPOTrainer

    from lowmem_ft.choosing import Choice
    from lowmem_ft.rundir import RunDir
    from lowmem_ft.train.methods.grpo import piece_weights, row_pieces
    from lowmem_ft.train.methods.rewards import parse_reward_fn
    from lowmem_ft.train.run import FineTune
    from tests.train.tiny_runs import tiny_sets

    reward = tmp_path / "r.py"
    reward.write_text("def length(completions, **kw):\n    return [float(len(str(c))) for c in completions]\n")
    sets = ["training.method=grpo", "data.columns={prompt: question}", "grpo.num_generations=2",
            "grpo.max_completion_length=6", f"grpo.loss_type={loss_type}", "memory.micro_batch_size=4",
            "memory.gradient_accumulation=1", "logging.wandb_mode=disabled"]  # fmt: skip
    recipe = resolve("8gb", tiny_sets(zoo_models["llama3"], GSM8K, tmp_path, *sets))
    job = FineTune(recipe, RunDir.new(tmp_path, "t", "m"), Choice("recipe", "8gb"),
                   reward_fns=[parse_reward_fn(f"{reward}:length")]).build()  # fmt: skip
    trainer, model = job.trainer, job.trainer.model
    prompts = [job.train_ds[i] for i in (0, 0, 1, 1)]
    model.train()
    inputs = GRPOTrainer._prepare_inputs(trainer, prompts)
    inputs["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5])  # nonzero, so that the loss depends on the rows
    trainer._in_micro_step, trainer.current_gradient_accumulation_steps = True, 1  # as train() sets it
    whole = trainer.compute_loss(model, inputs)
    pieces = row_pieces(inputs, 1)
    weights = piece_weights(loss_type, pieces, 4)
    total = sum(trainer.compute_loss(model, p) * w for p, w in zip(pieces, weights, strict=True))
    assert total.item() == pytest.approx(whole.item(), rel=1e-4, abs=1e-6)
    # an OOM while generating has no smaller piece: one line naming what shrinks a round
    from lowmem_ft.train.methods.grpo import GenerationOutOfMemory

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    trainer._in_micro_step, trainer._step, trainer._generate_single_turn = False, 0, no_memory
    with pytest.raises(GenerationOutOfMemory, match="generating a round of 4 completions .* grpo.steps_per_generation"):
        trainer.training_step(model, prompts)
    job.run.unlock()


def _reward_file(tmp_path: Path) -> Path:
    reward = tmp_path / "my_rewards.py"
    reward.write_text(
        "def brevity(completions, **kwargs):\n    return [1.0 / (1 + len(str(c))) for c in completions]\n"
    )
    return reward


@pytest.mark.slow
def test_grpo_resumes_with_its_reward_named_again(zoo_models, tmp_path, monkeypatch, capsys):
    """SIGTERM in step 2 saves checkpoint-2; --resume without the --reward-fn the run started with is one line (the
    run directory never names code to run), with it the run finishes its 3 steps from the checkpoint."""
    import signal

    from lowmem_ft.train import run as run_module
    from tests.train.resilience.test_interrupt import SendAt

    reward = _reward_file(tmp_path)
    train = run_module.train
    monkeypatch.setattr(
        run_module, "train", lambda *a, **k: train(*a, **{**k, "callbacks": [SendAt(2, signal.SIGTERM)]})
    )
    argv = ["train", "--recipe", "8gb", "--method", "grpo", "--model", zoo_models["qwen2.5"], "--data", GSM8K,
            "--set", "data.columns={prompt: question}", "--reward-fn", f"{reward}:brevity", "--output-dir",
            str(tmp_path), "--name", "resumed", *TINY_ROUND, "--max-steps", "3", "--set", "training.save_steps=1"]  # fmt: skip
    assert main(argv) != 0
    monkeypatch.setattr(run_module, "train", train)
    run = tmp_path / "resumed"
    assert (run / "checkpoints" / "checkpoint-2").is_dir()
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--no-wandb"]) == 2
    assert "--reward-fn" in capsys.readouterr().err
    assert main(["train", "--resume", str(run), "--no-wandb", "--reward-fn", f"{reward}:brevity"]) == 0
    assert json.loads((run / "metrics.json").read_text())["global_step"] == 3
    assert "rewards/brevity/mean" in [h for h in _records(run, "log_history.jsonl") if "loss" in h][-1]


@pytest.mark.slow
def test_grpo_on_two_cpu_processes(zoo_models, tmp_path, capfd):
    """`--gpus 2` (two gloo ranks through accelerate launch): the --reward-fn travels on the ranks' command line, both
    ranks generate and train, each logs its own memory file (the suite checks both)."""
    reward = _reward_file(tmp_path)
    argv = ["train", "--recipe", "8gb", "--gpus", "2", "--method", "grpo", "--model", zoo_models["llama3"],
            "--data", GSM8K, "--set", "data.columns={prompt: question}", "--reward-fn", f"{reward}:brevity",
            "--output-dir", str(tmp_path), "--name", "ddp", *TINY_ROUND]  # fmt: skip
    assert main(argv) == 0
    out = capfd.readouterr().out
    run = tmp_path / "ddp"
    assert out.count("done: 2 steps") == 1 and "--reward-fn" in json.loads((run / "launch.json").read_text())["command"]
    for name in ("memory.jsonl", "memory.rank1.jsonl"):
        assert any(r.get("phase") == "generation" for r in _records(run, name)), name


TURNS_BAD = """
def late_nan(completions, trainer_state=None, **kwargs):
    step = trainer_state.global_step if trainer_state is not None else 0
    return [float("nan") if step >= 1 else 1.0 for _ in completions]

def never(completions, **kwargs):
    return [None] * len(completions)
"""


@pytest.mark.slow
def test_a_reward_that_goes_bad_stops_the_run_at_its_step_with_the_checkpoint_kept(zoo_models, tmp_path, capsys):
    """Issue 32: a reward that returned NaN was trained on to the end; one that returned None everywhere ended in a
    crash of the done line. Now the bad value stops the run at the step it came at, in one line naming the function,
    the step and the row, with the last checkpoint kept and the resume command naming the --reward-fn again."""
    from lowmem_ft.rundir import RunDir

    rewards = tmp_path / "rewards.py"
    rewards.write_text(TURNS_BAD)
    base = ["train", "--vram", "8", "--method", "grpo", "--model", zoo_models["llama3"], "--data", GSM8K,
            "--set", "data.columns={prompt: question}", "--output-dir", str(tmp_path), *TINY_ROUND,
            "--set", "training.save_steps=1"]  # fmt: skip
    assert main([*base, "--name", "nan", "--reward-fn", f"{rewards}:late_nan:2"]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if ": error: " in x]
    run = tmp_path / "nan"
    assert f"reward {rewards}:late_nan returned nan for completion 0 at step 2 (prompt '" in line, line
    assert line.endswith(
        f"kept {run}/checkpoints/checkpoint-1 (step 1); continue with: lowmem-ft train --resume {run} "
        f"--reward-fn {rewards}:late_nan:2"
    ), line
    status = RunDir(run).read_status()
    assert status.state == "failed" and status.step == 1 and not (run / "adapter").exists()

    assert main([*base, "--name", "none", "--reward-fn", f"{rewards}:never"]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if ": error: " in x]
    assert "completions at step 1 have no reward (every reward returned None: never)" in line, line
    assert "nothing can be learned" in line and "no checkpoint kept" in line
