"""A clean console: each library-noise filter catches the real emission and nothing else; the demo's console has no
warnings and a memory postfix on its bar; --quiet prints the summary only; the W&B offline run holds the recipe, the
plan and the memory series."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from lowmem_ft import console
from lowmem_ft.recipe.load import resolve

ROOT = Path(__file__).parents[1]
CHAT = str(ROOT / "examples" / "chat.jsonl")


def _recorded(fn, *, filtered: bool) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if filtered:
            console.filter_library_noise()
        fn()
    return list(caught)


def _build_checkpointed_lora(tiny_model):
    from lowmem_ft.train.model import build_model

    build_model(resolve("8gb", {"model": {"name_or_path": tiny_model, "quantization": "none"}}))


def test_the_checkpointing_alias_warning_is_filtered_and_only_it(tiny_model):
    """peft's PeftModel reads transformers' deprecated `is_gradient_checkpointing` on every build."""

    def alias(caught):
        return [w for w in caught if "is_gradient_checkpointing" in str(w.message)]

    assert alias(_recorded(lambda: _build_checkpointed_lora(tiny_model), filtered=False))  # the real emission
    assert not alias(_recorded(lambda: _build_checkpointed_lora(tiny_model), filtered=True))
    other = _recorded(lambda: warnings.warn("something else is deprecated", FutureWarning, stacklevel=1), filtered=True)
    assert [str(w.message) for w in other] == ["something else is deprecated"]


def test_the_cpu_paged_optimizer_note_is_filtered():
    import bitsandbytes as bnb
    import torch

    def step():
        p = torch.nn.Parameter(torch.ones(64, 64))
        p.grad = torch.ones_like(p)
        bnb.optim.PagedAdamW8bit([p], lr=1e-3).step()

    def paged(caught):
        return [w for w in caught if "Paged optimizers are not supported on CPU" in str(w.message)]

    if torch.cuda.is_available():
        pytest.skip("bitsandbytes warns only on the CPU")
    assert paged(_recorded(step, filtered=False))
    assert not paged(_recorded(step, filtered=True))


def test_the_bitsandbytes_kernel_log_line_is_dropped_and_only_it(caplog):
    console.filter_library_noise()
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    with caplog.at_level(logging.WARNING):
        logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please ...", "no kernels")
        logger.warning("a real problem")
    assert [r.getMessage() for r in caplog.records if r.name == logger.name] == ["a real problem"]


def test_each_level_shows_its_own_lines():
    def shown(level, name, levelno):
        return console._Shown(level).filter(logging.LogRecord(name, levelno, "", 0, "m", None, None))

    assert shown("normal", "lowmem_ft.train.run", logging.INFO)
    assert not shown("normal", "httpx", logging.INFO) and shown("normal", "datasets", logging.WARNING)
    assert shown("quiet", "lowmem_ft.train.resilience.guard", logging.WARNING) and not shown(
        "quiet", "lowmem_ft", logging.INFO
    )
    assert not shown("quiet", "datasets", logging.WARNING) and shown("quiet", "datasets", logging.ERROR)
    assert shown("debug", "httpx", logging.DEBUG)


# -- the console of a real run -------------------------------------------------------------------------------------
def _cli(*argv: str, cwd: Path) -> str:
    """`lowmem-ft ...` as a user runs it (a new process): its stdout and stderr together, progress bars included."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "LOWMEM_FT_", "PYTEST"))}
    env |= {"WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": str(ROOT)}  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "lowmem_ft.cli", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    return output


@pytest.fixture(scope="module")
def demo(tiny_model, tmp_path_factory):
    """The demo's command (W&B offline), for 3 steps with a checkpoint at step 2."""
    out = tmp_path_factory.mktemp("console")
    output = _cli("train", "--vram", "8", "--model", tiny_model, "--data", CHAT, "--name", "demo", "--output-dir",
                  str(out), "--max-steps", "3", "--set", "training.save_steps=2", cwd=out)  # fmt: skip
    return out / "demo", output


def test_the_demo_console_has_no_warnings(demo):
    _, output = demo
    noisy = [line for line in re.split(r"[\r\n]", output) if re.search(r"warn|deprecat", line, re.IGNORECASE)]
    assert noisy == []
    assert "done: 3 steps" in output


def test_the_demo_shows_the_plan_before_step_1_and_compact_lines(demo):
    run, output = demo
    assert output.count("plan: sft of ") == 1
    plan = output.index("plan: sft of ")
    assert plan < output.index("step 1/3  loss ")
    banner = output[plan:].split("\n")
    assert [line.split()[0] for line in banner[1:9]] == ["weights", "adapter", "batch", "savers", "memory", "host",
                                                         "run", "tracker"]  # fmt: skip
    assert f"  run      {run}" in output and f"  tracker  W&B offline in {run}/wandb/offline-run-" in output
    assert "predicted peak " in banner[5] and " budget " in banner[5] and "× 1 device = " in banner[3]
    assert "{'" not in output  # none of the Trainer's raw dictionaries
    assert "Truncating" not in output and "Dropping fully masked" not in output  # no second pass over our data
    assert re.search(r"step 1/3  loss \d+\.\d{4}  lr \S+  grad \S+  [\d,]+ tok/s  host \d+\.\d\d GB  acc ", output)
    assert re.search(r"done: 3 steps, .*, [\d,]+ tokens/s; run directory ", output)


def test_the_progress_bar_shows_the_memory(demo):
    run, output = demo
    shown = [float(gb) for gb in re.findall(r"\d+/3 \[[^\]]*, host (\d+\.\d\d) GB\]", output)]
    assert len(shown) >= 3  # the bar after each step (redrawn at the end)
    rss = [json.loads(line).get("rss_gb") for line in (run / "memory.jsonl").read_text().splitlines()]
    assert max(shown) <= round(max(r for r in rss if r), 2) + 0.005 and min(shown) > 0


def test_the_wandb_offline_run_holds_the_recipe_the_plan_and_the_memory(demo):
    from devkit.wandb_offline import find

    run_dir, _ = demo
    wb = find(run_dir)
    recipe = resolve(run_dir / "recipe.yaml")
    plan = json.loads((run_dir / "plan.json").read_text())
    assert wb.name == "demo"  # the run directory's name
    cfg = wb.config["recipe"]
    assert cfg["memory"]["max_seq_len"] == recipe.memory.max_seq_len
    assert cfg["model"]["quantization"] == recipe.model.quantization
    assert cfg["memory"]["activation_offloading"] is False and cfg["memory"]["chunked_loss"] is False  # the savers
    assert wb.config["plan"]["predicted_peak_gb"] == plan["predicted_peak_gb"]
    assert wb.config["plan"]["reasons"] == plan["reasons"]
    steps = [h["train/global_step"] for h in wb.history if "memory/rss_gb" in h]
    assert steps == [1, 2, 3]
    chart = wb.chart("memory/curves")
    lines: dict[str, list] = {}
    for step, key, gb in chart["data"]:
        lines.setdefault(key, []).append((step, gb))
    assert {"forward (host RSS)", "backward (host RSS)", "optimizer (host RSS)", "save (host RSS)"} <= set(lines)
    assert {gb for _, gb in lines["budget (GPU)"]} == {plan["budget_gb"]}
    assert {gb for _, gb in lines["predicted peak (GPU)"]} == {plan["predicted_peak_gb"]}
    assert wb.config["_wandb/visualize/memory/curves"]["panel_config"]["panelDefId"] == "wandb/lineseries/v0"


def test_quiet_prints_the_summary_only(demo, tiny_model):
    run, _ = demo
    output = _cli("train", "--quiet", "--vram", "8", "--adapter", str(run), "--data", CHAT, "--name", "more",
                  "--output-dir", str(run.parent), "--max-steps", "2", cwd=run.parent)  # fmt: skip
    lines = [line for line in output.splitlines() if line.strip()]
    assert lines[0].startswith("memory: measured peak ") and lines[-1].startswith("done: 2 steps")
    assert all(line.startswith(("memory:", "  ")) for line in lines[:-1]), output
    assert resolve(run.parent / "more" / "recipe.yaml").adapter.name_or_path == str(run)


# -- text from users and models is printed as given ----------------------------------------------------------------
def _flat(text: str) -> str:
    """Rich wraps a table's title at the table's width: compare without the whitespace."""
    return "".join(text.split())


def test_brackets_from_users_are_printed_not_read_as_rich_markup(tiny_model, tmp_path, capsys, monkeypatch):
    """Model directories, `--set` values and paths may hold `[bold]` or `[/INST]`: Rich markup dropped the first and
    raised MarkupError (a traceback) on the second."""
    import shutil

    from lowmem_ft.cli import main

    monkeypatch.setenv("COLUMNS", "400")  # Rich's width: no cell folded across lines
    model = tmp_path / "tiny[bold]x :smile:"
    shutil.copytree(tiny_model, model)
    argv = ["plan", "--vram", "8", "--model", str(model), "--set", 'adapter.target_modules=[q_proj, "[/INST]"]']
    assert main(argv) == 0
    out = _flat(capsys.readouterr().out)
    assert _flat(f"{model} on 8 GB") in out  # the title
    assert _flat("adapts q_proj only: [/INST] are absent") in out  # a reason line carrying a --set value

    runs = tmp_path / "runs[/bold]"
    assert main(["doctor", "--output-dir", str(runs)]) == 0
    assert _flat(f"free at {runs}") in _flat(capsys.readouterr().out)


def test_each_warning_is_said_once_per_command(tiny_model, tmp_path, monkeypatch, caplog):
    """The plan and the run each load the tokenizer, resolve the recipe and read the data, and a stream is read on
    every pass: the ChatML default was warned twice, the recipe's trust_remote_code twice, and a stream's bad line
    four times (its head, then three passes of 3 steps)."""
    import shutil
    from collections import Counter

    from lowmem_ft.cli import main

    model = tmp_path / "no-template"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    lines = Path(CHAT).read_text().splitlines()
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join([*lines[:3], '{"bad json', *lines[3:]]) + "\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"base: 8gb\nmodel:\n  name_or_path: {model}\n  trust_remote_code: true\n")
    monkeypatch.setenv("LOWMEM_FT_CACHE", str(tmp_path / "cache"))
    caplog.set_level(logging.WARNING)
    argv = ["train", "--recipe", str(recipe), "--vram", "8", "--data", str(data), "--skip-bad-lines",
            "--output-dir", str(tmp_path / "runs"), "--max-steps", "3", "--set", "data.streaming=true",
            "--set", "logging.wandb_mode=disabled"]  # fmt: skip
    for name in ("first", "second"):  # a second command in the same process says them again
        caplog.clear()
        assert main([*argv, "--name", name]) == 0
        said = Counter(r.getMessage() for r in caplog.records if r.name.startswith("lowmem_ft"))
        assert any("has no chat template" in m for m in said), said
        assert any("only the command line can grant" in m for m in said), said
        assert any(m.startswith(f"skipped {data}:4: invalid JSON") for m in said), said
        assert set(said.values()) == {1}, said


def test_an_error_closes_the_open_progress_bars_before_its_line(capsys):
    """Issue 32: an error raised mid-training (a failing reward, a full disk) was written onto the progress bar's
    line. The CLI closes the open bars first, so the bar's line ends and the error starts a line of its own."""
    from tqdm import tqdm

    from lowmem_ft import cli

    bar = tqdm(total=3)
    bar.update(1)
    assert bar in tqdm._instances
    cli._end_progress_bars()
    assert bar not in tqdm._instances
    assert capsys.readouterr().err.endswith("\n")
