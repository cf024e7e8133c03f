"""A run directory is data: it cannot make a command run code without that command's own --trust-remote-code.

Issue #16: `generate`, `merge` and `train --resume` took `trust_remote_code` from the run directory's recipe.yaml, so
a run directory whose recipe said `true`, over a base with an `auto_map`, ran the base's Python in all three without
any flag. Here the base's module (and, in a second run directory, a tokenizer module inside adapter/) writes a marker
file when imported: without the flag no command may write it; with the flag, `generate` does (the flag still works).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lowmem_ft.cli import main

ROOT = Path(__file__).resolve().parents[1]

MODULE = """\
import pathlib

pathlib.Path({marker!r}).write_text("{who} code ran")

from transformers import Qwen2Config, Qwen2ForCausalLM


class MarkerConfig(Qwen2Config):
    model_type = "marker_qwen2"


class MarkerForCausalLM(Qwen2ForCausalLM):
    config_class = MarkerConfig
"""


def _remote_base(tiny_model: str, root: Path, marker: Path) -> Path:
    """The tiny model as a repository with its own code: config.json's auto_map points at marker.py."""
    base = root / "remote-base"
    shutil.copytree(tiny_model, base)
    config = json.loads((base / "config.json").read_text())
    config |= {
        "model_type": "marker_qwen2",
        "architectures": ["MarkerForCausalLM"],
        "auto_map": {"AutoConfig": "marker.MarkerConfig", "AutoModelForCausalLM": "marker.MarkerForCausalLM"},
    }
    (base / "config.json").write_text(json.dumps(config))
    (base / "marker.py").write_text(MODULE.format(marker=str(marker), who="the base model's"))
    return base


def _hostile(run: Path, dst: Path, base: Path) -> Path:
    """A copy of a finished run whose recipe says trust_remote_code: true and whose base is `base`."""
    shutil.copytree(run, dst)
    recipe = yaml.safe_load((dst / "recipe.yaml").read_text())
    recipe["model"] |= {"name_or_path": str(base), "trust_remote_code": True}
    (dst / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    adapter_config = dst / "adapter" / "adapter_config.json"
    adapter_config.write_text(
        json.dumps(json.loads(adapter_config.read_text()) | {"base_model_name_or_path": str(base)})
    )
    return dst


@pytest.fixture(scope="module")
def hostile(tiny_model, finished_run, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("remote-code")
    marker = root / "MARKER"
    base = _remote_base(tiny_model, root, marker)
    run = _hostile(Path(finished_run), root / "runs" / "hostile", base)
    # a second vector: the run's own adapter/ carries a tokenizer module
    tok_run = _hostile(Path(finished_run), root / "runs" / "tokenizer-code", Path(tiny_model))
    tokenizer_config = tok_run / "adapter" / "tokenizer_config.json"
    config = json.loads(tokenizer_config.read_text()) | {"auto_map": {"AutoTokenizer": ["marker.MarkerTok", None]}}
    tokenizer_config.write_text(json.dumps(config))
    (tok_run / "adapter" / "marker.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('x')\n")
    return {"root": root, "marker": marker, "base": base, "run": run, "tok_run": tok_run}


def _refused(capsys, code: int) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "{run}", "--prompt", "hi", "--max-new-tokens", "2"],
        ["merge", "{run}", "--output", "{root}/merged"],
        ["train", "--resume", "{run}", "--no-wandb"],
    ],
    ids=["generate", "merge", "resume"],
)
def test_a_run_directory_cannot_grant_itself_code_execution(argv, hostile, capsys):
    if "--resume" in argv:  # a finished run is not resumed at all (issue #24): make it one that stopped midway
        from lowmem_ft.rundir import RunDir, RunStatus

        RunDir(hostile["run"]).write_status(RunStatus("interrupted", step=1, signal="SIGINT"))
    line = _refused(capsys, main([a.format(**hostile) for a in argv]))
    assert "needs its own code" in line and "--trust-remote-code" in line
    assert not hostile["marker"].exists(), hostile["marker"].read_text()


def test_a_tokenizer_module_in_the_run_directory_does_not_run(hostile, capsys):
    """transformers ignores a tokenizer auto_map without trust (it uses its own Qwen2 tokenizer class)."""
    assert main(["generate", str(hostile["tok_run"]), "--prompt", "hi", "--max-new-tokens", "2"]) == 0
    assert not hostile["marker"].exists()


def test_a_launched_rank_takes_the_flag_from_its_command_line_only(hostile, capsys):
    """`train --gpus N` writes recipe.yaml + launch.json; its ranks run `train --run-dir`. A prepared run directory
    whose recipe says true runs no code unless the rank's command line carries --trust-remote-code."""
    run = hostile["root"] / "runs" / "launched"
    shutil.copytree(hostile["run"], run, ignore=shutil.ignore_patterns("checkpoints", "adapter"))
    (run / "launch.json").write_text(json.dumps({"choice": {"how": "recipe", "recipe": "8gb"}, "command": "x"}))
    line = _refused(capsys, main(["train", "--run-dir", str(run), "--no-wandb"]))
    assert "--trust-remote-code" in line
    assert not hostile["marker"].exists()


def test_the_launch_command_carries_the_flag_not_the_recipe(tiny_model, tmp_path):
    from lowmem_ft.recipe.load import resolve
    from lowmem_ft.rundir import RunDir
    from lowmem_ft.train.distributed.launch import LaunchPlan, launch_command

    run = RunDir(tmp_path)
    plan = LaunchPlan(gpus=2, cpu=True)
    assert "--trust-remote-code" not in launch_command(run, plan)
    assert launch_command(run, plan, trust_remote_code=True)[-1] == "--trust-remote-code"
    recipe = resolve("8gb", {"model": {"name_or_path": tiny_model, "trust_remote_code": True}})
    run.write_recipe(recipe)  # the record says true …
    assert "trust_remote_code: true" in run.recipe_file.read_text()
    assert run.read_recipe().model.trust_remote_code is False  # … and reading it back grants nothing
    assert run.read_recipe({"model": {"trust_remote_code": True}}).model.trust_remote_code is True


def test_a_recipe_file_saying_true_is_read_as_false_and_says_so(tmp_path, caplog):
    from lowmem_ft.recipe.load import resolve

    path = tmp_path / "r.yaml"
    path.write_text("base: 8gb\nmodel:\n  trust_remote_code: true\n")
    with caplog.at_level(logging.WARNING):
        assert resolve(path).model.trust_remote_code is False
    assert "only the command line can grant" in caplog.text and "--trust-remote-code" in caplog.text
    assert resolve(path, ["model.trust_remote_code=true"]).model.trust_remote_code is True


def test_with_the_flag_generate_runs_the_models_code(hostile):
    """The positive control: the marker mechanism works, and --trust-remote-code reaches the loaders. A subprocess,
    so the remote module is imported into a scratch HF_MODULES_CACHE and not into this test process."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(hostile["root"] / "modules"),
           "PYTHONPATH": str(ROOT)}  # fmt: skip
    argv = ["generate", str(hostile["run"]), "--prompt", "hi", "--max-new-tokens", "2", "--trust-remote-code"]
    done = subprocess.run([sys.executable, "-m", "lowmem_ft", *argv], capture_output=True, text=True, env=env,
                          timeout=300)  # fmt: skip
    try:
        assert done.returncode == 0, done.stderr[-2000:]
        assert hostile["marker"].read_text() == "the base model's code ran"
    finally:
        hostile["marker"].unlink(missing_ok=True)


def test_with_the_flag_a_recipe_file_saying_true_is_not_said_to_be_off(tmp_path, caplog):
    """`train --resume RUN --trust-remote-code`: the run's recipe.yaml says true and the command line grants it, so
    no warning may say it is off (issue #24: it did)."""
    from lowmem_ft.recipe.load import resolve

    path = tmp_path / "granted.yaml"
    path.write_text("base: 8gb\nmodel:\n  trust_remote_code: true\n")
    with caplog.at_level(logging.WARNING):
        assert resolve(path, {"model": {"trust_remote_code": True}}).model.trust_remote_code is True
        assert resolve(path, ["model.trust_remote_code=true"]).model.trust_remote_code is True
    assert "it is off" not in caplog.text and "only the command line can grant" not in caplog.text


@pytest.mark.parametrize(
    "failure",
    [
        "import not_a_package_lowmem_ft_lacks  # e.g. tiktoken",
        "from transformers import DisjunctiveConstraint  # removed in transformers 5",
    ],
)
def test_repository_code_that_fails_to_import_is_one_line(tiny_model, tmp_path, capsys, failure):
    """With --trust-remote-code, code that cannot import under this transformers names the family and the error."""
    base = _remote_base(tiny_model, tmp_path, tmp_path / "marker")
    (base / "marker.py").write_text(failure + "\n" + (base / "marker.py").read_text())
    data = str(ROOT / "examples" / "chat.jsonl")
    code = main(["train", "--vram", "8", "--model", str(base), "--data", data, "--trust-remote-code", "--output-dir",
                 str(tmp_path / "runs"), "--max-steps", "1", "--no-wandb"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert "model_type 'marker_qwen2'" in err and "ships its own code" in err
    assert ("not_a_package_lowmem_ft_lacks" if "not_a_package" in failure else "DisjunctiveConstraint") in err


def test_a_tokenizer_without_offsets_is_one_line():
    """A slow (Python) tokenizer gives no character offsets, which the loss masks are found by: one line."""
    from lowmem_ft.data.chat import encode_with_offsets
    from lowmem_ft.errors import UserError

    class SlowTokenizer:
        is_fast = False

    with pytest.raises(UserError, match="SlowTokenizer.*slow Python tokenizer.*no character offsets"):
        encode_with_offsets(SlowTokenizer(), ["hi"])
