"""The built-in rewards, `--reward-fn` files, and the checks that make a bad reward one line (train/methods/rewards.py)."""

from __future__ import annotations

import math

import pytest

from lowmem_ft.errors import UserError
from lowmem_ft.train.methods.rewards import (
    BUILTINS,
    CheckedReward,
    RewardFailed,
    RewardOptions,
    RewardSpec,
    as_number,
    build_rewards,
    columns_needed,
    final_answer,
    parse_builtin,
    parse_reward_fn,
)

GSM8K_ANSWER = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"


def call(reward: CheckedReward, completions, **columns):
    """As TRL 1.16's `_calculate_rewards` calls a synchronous reward (grpo_trainer.py)."""
    extra = {"trainer_state": None, "log_extra": lambda *a: None, "log_metric": lambda *a: None}
    ids = [[1] * len(str(c)) for c in completions]
    return reward(prompts=["q"] * len(completions), completions=completions, completion_ids=ids, **columns, **extra)


@pytest.mark.parametrize(
    "text, answer",
    [
        (GSM8K_ANSWER, "72"),
        ("so the total is \\boxed{1,234}.", "1,234"),
        ("It costs $5 and then 7 more, 12", "12"),
        ("no number here", None),
    ],
)
def test_final_answer(text, answer):
    assert final_answer(text) == answer


def test_as_number_reads_commas_dollars_and_decimals():
    assert as_number("1,234") == 1234.0
    assert as_number("$5") == 5.0
    assert as_number("-3.50") == -3.5
    assert as_number("seventy") is None


def test_numeric_match_on_gsm8k_answers_in_strings_and_conversations():
    [reward] = build_rewards([parse_builtin("numeric_match")], [], RewardOptions(), columns=["prompt", "answer"])
    completions = ["48 + 24 = 72 clips\n#### 72", "#### 72.0", "The answer is 71", "I don't know"]
    assert call(reward, completions, answer=[GSM8K_ANSWER] * 4) == [1.0, 1.0, 0.0, 0.0]
    chat = [[{"role": "assistant", "content": c}] for c in completions]
    assert call(reward, chat, answer=[GSM8K_ANSWER] * 4) == [1.0, 1.0, 0.0, 0.0]
    # an answer without a number does not count (None → TRL's NaN, left out of the mean), rather than scoring 0
    assert call(reward, ["#### 3"], answer=["unknowable"]) == [None]


def test_exact_match_folds_case_and_spaces():
    [reward] = build_rewards([parse_builtin("exact_match")], [], RewardOptions(answer_column="solution"))
    assert call(reward, ["#### Paris", "#### paris.", "#### Lyon"], solution=["#### PARIS"] * 3) == [1.0, 1.0, 0.0]


def test_format_and_length_penalty():
    options = RewardOptions(format_regex=r"<answer>.+</answer>", max_completion_length=8, length_cache=4)
    fmt, length = build_rewards([parse_builtin("format"), parse_builtin("length_penalty:0.5")], [], options)
    assert call(fmt, ["<answer>4</answer>", "4"]) == [1.0, 0.0]
    # DAPO's soft overlong punishment (TRL): 0 up to 8 - 4 tokens, then linearly to -1 at 8
    ids = [[1] * 3, [1] * 6, [1] * 8]
    out = length(prompts=["q"] * 3, completions=["a"] * 3, completion_ids=ids)
    assert out == [0.0, -0.5, -1.0]
    assert length.weight == 0.5 and length.__name__ == "length_penalty"


def test_builtin_names_and_weights():
    assert parse_builtin("numeric_match:2") == RewardSpec("numeric_match", 2.0)
    with pytest.raises(UserError, match="unknown reward 'accuracy'; the built-in rewards are exact_match"):
        parse_builtin("accuracy")
    with pytest.raises(UserError, match="weight 'heavy' is not a number"):
        parse_builtin("format:heavy")


@pytest.mark.parametrize("entry", ["my_rewards.py:correct", "./r/x:f", "rewards.py", "format:my.py"])
def test_a_recipe_cannot_name_a_file(entry):
    with pytest.raises(UserError, match="on the command line only"):
        parse_builtin(entry)


def test_reward_fn_specs():
    assert parse_reward_fn("rewards.py:correct") == RewardSpec("correct", 1.0, "rewards.py")
    assert parse_reward_fn("dir/rewards.py:correct:2.5") == RewardSpec("correct", 2.5, "dir/rewards.py")
    assert parse_reward_fn("C:\\r\\x.py:f") == RewardSpec("f", 1.0, "C:\\r\\x.py")
    for bad in ("rewards.py", "rewards.py:", "rewards.py:no-name"):
        with pytest.raises(UserError, match="expected PATH.py:FUNCTION"):
            parse_reward_fn(bad)
    with pytest.raises(UserError, match="weight 'x y' is not a number"):
        parse_reward_fn("r.py:f:x y")


USER_REWARDS = """
def correct(completions, answer, **kwargs):
    return [1.0 if a.split("####")[-1].strip() in c else 0.0 for c, a in zip(completions, answer)]

def by_level(prompts, completions, level, trainer_state=None, **kwargs):
    return [float(lv) for lv in level]

def raises(completions, **kwargs):
    return [1 / 0 for _ in completions]

def short(completions, **kwargs):
    return [1.0]

def words(completions, **kwargs):
    return ["good" for _ in completions]

def scalar(completions, **kwargs):
    return 1.0

def maybe(completions, **kwargs):
    return [None, 1, 2.5][: len(completions)]

def nan(completions, **kwargs):
    return [1.0, float("nan")][: len(completions)]

def inf(completions, **kwargs):
    return [float("-inf"), 1.0][: len(completions)]

def leaves(completions, **kwargs):
    import sys
    sys.exit(3)
"""


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_REWARDS)
    return str(path)


def test_user_functions_get_their_columns_by_name(user_file):
    specs = [parse_reward_fn(f"{user_file}:correct:2"), parse_reward_fn(f"{user_file}:by_level")]
    correct, by_level = build_rewards([], specs, RewardOptions(), columns=["prompt", "answer", "level"])
    assert (correct.weight, correct.needs, by_level.needs) == (2.0, ("answer",), ("level",))
    assert call(correct, ["it is 72", "it is 7"], answer=[GSM8K_ANSWER] * 2) == [1.0, 0.0]
    assert call(by_level, ["a", "b"], level=[1, 3]) == [1.0, 3.0]
    assert correct.__name__ == "correct"  # TRL logs rewards/correct/mean


def test_a_missing_column_is_refused_before_training(user_file):
    # the advice is a change that works (issue 32: `data.columns={answer: X}` was refused, "no format reads")
    with pytest.raises(UserError, match="needs the data column 'level'.*name that parameter of .*:by_level after"):
        build_rewards([], [parse_reward_fn(f"{user_file}:by_level")], RewardOptions(), columns=["prompt", "answer"])
    with pytest.raises(
        UserError, match="numeric_match needs the data column 'answer'.*--set grpo.answer_column=solution$"
    ):
        build_rewards([parse_builtin("numeric_match")], [], RewardOptions(), columns=["prompt", "solution"])
    fixed = build_rewards([parse_builtin("numeric_match")], [], RewardOptions(answer_column="solution"),
                          columns=["prompt", "solution"])  # fmt: skip
    assert fixed[0].needs == ("solution",)


@pytest.mark.parametrize(
    "name, message",
    [
        ("raises", r"reward .*my_rewards.py:raises raised ZeroDivisionError: division by zero$"),
        ("short", r"reward .*:short returned 1 values for 2 completions"),
        ("words", r"reward .*:words returned 'good' \(str\) for completion 0 \(prompt 'q'\): each reward is a number"),
        ("scalar", r"reward .*:scalar returned a float, not a list of 2 numbers"),
        # issue 32: non-finite values were trained on, and sys.exit ended lowmem-ft with its code and no word
        ("nan", r"reward .*my_rewards.py:nan returned nan for completion 1 \(prompt 'q'\): a reward must be a finite"),
        ("inf", r"reward .*:inf returned -inf for completion 0 \(prompt 'q'\): a reward must be a finite number"),
        ("leaves", r"reward .*my_rewards.py:leaves called sys.exit\(3\); a reward returns numbers$"),
    ],
)
def test_a_bad_reward_is_one_line_naming_it(user_file, name, message):
    [reward] = build_rewards([], [parse_reward_fn(f"{user_file}:{name}")], RewardOptions())
    with pytest.raises(RewardFailed, match=message) as info:
        call(reward, ["a", "b"])
    assert "\n" not in str(info.value) and info.value.exit_code == 2


def test_a_bad_reward_names_the_step_in_progress(user_file):
    """TRL passes the trainer's state: the line names the step the bad value came at (global_step + 1)."""
    from types import SimpleNamespace

    [reward] = build_rewards([], [parse_reward_fn(f"{user_file}:nan")], RewardOptions())
    state = SimpleNamespace(global_step=6)
    with pytest.raises(RewardFailed, match=r"returned nan for completion 1 at step 7 \(prompt 'two'\)"):
        reward(prompts=["one", [{"role": "user", "content": "two"}]], completions=["a", "b"], trainer_state=state)


def test_a_reward_file_that_exits_at_import_is_one_line(tmp_path):
    exits = tmp_path / "exits.py"
    exits.write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(UserError, match=r"--reward-fn .*exits.py:f: importing exits.py called sys.exit\(3\)$"):
        build_rewards([], [parse_reward_fn(f"{exits}:f")], RewardOptions())


def test_the_resume_command_names_the_reward_files_again():
    from lowmem_ft.train.methods.rewards import reward_flags

    specs = [RewardSpec("f", 1.0, "r.py"), RewardSpec("g", 2.5, "my dir/r.py"), RewardSpec("format")]
    assert reward_flags(specs) == "--reward-fn r.py:f --reward-fn 'my dir/r.py:g:2.5'"
    assert parse_reward_fn("my dir/r.py:g:2.5") == specs[1]


def test_none_is_allowed_and_numbers_become_floats(user_file):
    [reward] = build_rewards([], [parse_reward_fn(f"{user_file}:maybe")], RewardOptions())
    assert call(reward, ["a", "b", "c"]) == [None, 1.0, 2.5]


def test_bad_files_are_one_line(tmp_path, user_file):
    with pytest.raises(UserError, match="no such file"):
        build_rewards([], [parse_reward_fn(f"{tmp_path}/none.py:f")], RewardOptions())
    with pytest.raises(UserError, match=r"has no 'nope' \(it defines: correct, by_level"):
        build_rewards([], [parse_reward_fn(f"{user_file}:nope")], RewardOptions())
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    with pytest.raises(UserError, match="importing broken.py failed: ModuleNotFoundError"):
        build_rewards([], [parse_reward_fn(f"{broken}:f")], RewardOptions())
    with pytest.raises(UserError, match="--method grpo needs a reward"):
        build_rewards([], [], RewardOptions())


def test_every_builtin_builds_and_scores():
    options = RewardOptions(max_completion_length=16)
    for name in BUILTINS:
        [reward] = build_rewards([parse_builtin(name)], [], options)
        out = call(reward, ["#### 4"], answer=["#### 4"])
        assert len(out) == 1 and (out[0] is None or math.isfinite(out[0]))
    assert columns_needed(BUILTINS["format"](options)) == ()


@pytest.fixture(scope="module")
def grpo_trainer(tmp_path_factory):
    """TRL 1.16's GRPOTrainer on a zoo model, not trained: its own `_calculate_rewards` calls our rewards."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from devkit import zoo

    root = tmp_path_factory.mktemp("grpo_rewards")
    path = zoo.build("qwen2.5", root / "model")
    user = root / "my_rewards.py"
    user.write_text(USER_REWARDS)
    rewards = build_rewards(
        [parse_builtin("numeric_match:2"), parse_builtin("format")],
        [parse_reward_fn(f"{user}:by_level"), parse_reward_fn(f"{user}:raises")],
        RewardOptions(),
        columns=["prompt", "answer", "level"],
    )
    config = GRPOConfig(
        output_dir=str(root / "out"), per_device_train_batch_size=2, num_generations=2, use_cpu=True,
        report_to="none", reward_weights=[r.weight for r in rewards],
    )  # fmt: skip
    data = Dataset.from_list([{"prompt": "2+2?", "answer": "#### 4", "level": 1}] * 2)
    model = AutoModelForCausalLM.from_pretrained(path)
    trainer = GRPOTrainer(
        model=model, reward_funcs=rewards, args=config, train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(path),
    )  # fmt: skip
    return trainer


def test_trls_own_call_passes_columns_by_name(grpo_trainer):
    t = grpo_trainer
    assert t.reward_func_names == ["numeric_match", "format", "by_level", "raises"]
    assert t.reward_weights.tolist() == [2.0, 1.0, 1.0, 1.0]
    inputs = [{"prompt": "2+2?", "answer": "#### 4", "level": 1}, {"prompt": "2+2?", "answer": "#### 4", "level": 3}]
    t.reward_funcs = t.reward_funcs[:3]  # without the one that raises
    t.reward_processing_classes = t.reward_processing_classes[:3]
    t.reward_func_names = t.reward_func_names[:3]
    out = t._calculate_rewards(inputs, ["2+2?"] * 2, ["#### 4", "five"], [[1, 2], [3]])
    assert out.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 3.0]]


def test_a_raising_reward_stops_trl_with_one_line(grpo_trainer, user_file):
    t = grpo_trainer
    [bad] = build_rewards([], [parse_reward_fn(f"{user_file}:raises")], RewardOptions())
    t.reward_funcs, t.reward_processing_classes, t.reward_func_names = [bad], [None], ["raises"]
    with pytest.raises(RewardFailed, match="raised ZeroDivisionError"):
        t._calculate_rewards([{"prompt": "q", "answer": "1"}], ["q"], ["#### 1"], [[1]])


def test_the_recipe_knows_every_builtin_by_name():
    """The recipe layer checks reward names without importing them (`lowmem_ft.recipe.rewards`)."""
    from lowmem_ft.recipe.rewards import BUILTIN_REWARDS
    from lowmem_ft.train.methods.rewards import BUILTINS

    assert tuple(BUILTINS) == BUILTIN_REWARDS
