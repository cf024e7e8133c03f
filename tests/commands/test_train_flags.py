"""`train`'s shortcut flags are exactly `--set` of their keys; choices in `--help` are the schema's; internal flags
are hidden; `--quiet` / `--debug` work after every command."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import get_args

import pytest

from lowmem_ft import console
from lowmem_ft.cli import build_parser, main
from lowmem_ft.commands.train import request_of
from lowmem_ft.memory.planner import Requested
from lowmem_ft.recipe.load import resolve
from lowmem_ft.recipe.schema import DataFormat, DType, Tracker

CHAT = str(Path(__file__).parents[2] / "examples" / "chat.jsonl")
SHORTCUTS = [
    (["--seq-len", "64"], "memory.max_seq_len=64"),
    (["--max-steps", "5"], "training.max_steps=5"),
    (["--epochs", "2.5"], "training.epochs=2.5"),
    (["--lr", "1e-4"], "optimizer.lr=1e-4"),
    (["--output-dir", "elsewhere/runs"], "training.output_dir=elsewhere/runs"),
    (["--report-to", "tensorboard", "wandb"], "logging.report_to=[tensorboard, wandb]"),
    (["--adapter", "runs/x/adapter"], "adapter.name_or_path=runs/x/adapter"),
]


@pytest.fixture
def console_env(monkeypatch):
    """In-process `main` calls put the console level in the environment: restore it after the test."""
    for key in (console.DEBUG_ENV, console.QUIET_ENV, *console.QUIET_LIBRARIES, "TRANSFORMERS_VERBOSITY"):
        monkeypatch.setenv(key, "")


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["train", "--model", "m", "--data", "d", *argv])


@pytest.mark.parametrize(("flag", "setting"), SHORTCUTS)
def test_each_shortcut_is_its_set(flag, setting):
    by_flag, by_set = request_of(_args(*flag)), request_of(_args("--set", setting))
    assert by_flag.overrides == by_set.overrides
    key = setting.partition("=")[0]
    assert by_flag.origins[key] == flag[0] and key not in by_set.origins


def test_shortcuts_resolve_to_the_recipe_their_sets_do():
    flags = request_of(_args(*[part for flag, _ in SHORTCUTS if flag[0] != "--adapter" for part in flag]))
    sets = request_of(_args(*[part for flag, s in SHORTCUTS if flag[0] != "--adapter" for part in ("--set", s)]))
    recipe = resolve("8gb", flags.overrides, flags.origins)
    assert recipe == resolve("8gb", sets.overrides)
    m, t = recipe.memory, recipe.training
    assert (m.max_seq_len, t.max_steps, t.epochs, recipe.optimizer.lr) == (64, 5, 2.5, 1e-4)
    assert (t.output_dir, recipe.logging.report_to) == ("elsewhere/runs", ["tensorboard", "wandb"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lr", "fast"], "error: --lr: 'optimizer.lr' must be a number, got 'fast'"),
        (["--seq-len", "8"], "error: --seq-len: 'memory.max_seq_len' must be at least 16, got 8"),
        (["--max-steps", "0"], "error: --max-steps: 'training.max_steps' must be -1 (use epochs) or positive, got 0"),
    ],
)
def test_a_bad_value_names_the_flag(capsys, console_env, tiny_model, argv, message):
    code = main(["train", "--recipe", "8gb", "--model", tiny_model, "--data", CHAT, "--no-wandb", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err


def test_seq_len_fixes_the_planned_length(tiny_model):
    from lowmem_ft.preparing import choose

    args = _args("--vram", "8", "--seq-len", "96")
    args.model, args.data = tiny_model, CHAT
    recipe, choice = choose(request_of(args))
    assert recipe.memory.max_seq_len == 96
    assert choice.reasons["max_seq_len"] == "96 tokens, as --seq-len asked"


def _action(parser: argparse.ArgumentParser, *path: str) -> argparse.Action:
    *commands, flag = path
    for name in commands:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return next(a for a in parser._actions if flag in a.option_strings), parser


@pytest.mark.parametrize(
    ("path", "literal", "left_out"),
    [
        (("train", "--format"), DataFormat, {"auto"}),
        (("train", "--strategy"), Requested, set()),
        (("train", "--report-to"), Tracker, set()),
        (("plan", "--strategy"), Requested, set()),
        (("data", "stats", "--format"), DataFormat, set()),
        (("merge", "--dtype"), DType, set()),
    ],
)
def test_help_lists_the_schemas_choices(path, literal, left_out):
    action, parser = _action(build_parser(), *path)
    expected = [c for c in get_args(literal) if c not in left_out]
    assert sorted(action.choices) == sorted(expected)
    shown = " ".join(parser.format_help().split())  # argparse wraps long lines
    if action.metavar is None:  # the choices are the metavar: {a,b,c}
        assert "{" + ",".join(action.choices) + "}" in shown
    else:
        assert all(c in shown for c in expected)


def test_internal_flags_are_hidden_but_work():
    _, train = _action(build_parser(), "train", "--run-dir")
    assert "--run-dir" not in train.format_help()
    assert build_parser().parse_args(["train", "--run-dir", "runs/x"]).run_dir == "runs/x"


def test_quiet_and_debug_are_accepted_after_every_command():
    parser = build_parser()
    for argv in (["plan", "--model", "m", "--vram", "8"], ["recipes"], ["data", "stats", "x"], ["doctor"],
                 ["report", "r"], ["generate", "r"], ["merge", "r", "--output", "o"], ["train"]):  # fmt: skip
        assert parser.parse_args([*argv, "--quiet"]).quiet is True
        assert parser.parse_args([*argv, "--debug"]).debug is True
        assert parser.parse_args(["--quiet", *argv]).quiet is True
        assert parser.parse_args(argv).debug is False  # a subcommand's default never undoes the global flag


def test_debug_after_the_command_shows_the_traceback(console_env, capsys):
    from lowmem_ft.errors import UserError

    assert main(["plan", "--model", "no/such-model", "--vram", "8"]) == 2
    with pytest.raises(UserError, match="no/such-model"):
        main(["plan", "--model", "no/such-model", "--vram", "8", "--debug"])


def test_train_refuses_a_plan_over_the_host_ram_before_loading(tiny_model, chat_data, tmp_path, monkeypatch, capsys):
    """--host-ram 4, not above the 4 GB host margin, with offloading fixed on: one line, exit 2, nothing loaded
    (issue 32: a budget of 0 or below is said as such, before any plan, not as a plan over a negative budget)."""

    def not_loaded(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("lowmem_ft.train.model.load_model", not_loaded)
    runs = tmp_path / "runs"
    argv = ["train", "--model", tiny_model, "--data", chat_data, "--vram", "8", "--host-ram", "4", "--output-dir",
            str(runs), "--no-wandb", "--set", "memory.activation_offloading=true"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--host-ram 4: not above the 4 GB host margin (memory.host_margin_gb)" in err
    assert "give --host-ram above 4" in err and not runs.exists()
