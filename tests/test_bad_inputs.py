"""The bad-input catalogue (issue #16): what a hostile new user hands every command, and the one line each gets back.

Every case runs `lowmem_ft.cli.main` in-process and asserts exit code 2, exactly one line on stderr (the CLI's
`lowmem-ft CMD: error: …`), no traceback anywhere, nothing logged at WARNING or above, and the words that name the
cause. Inputs are built once per session in a scratch directory (the `world` fixture): damaged copies of the tiny
model, hostile recipe files, bad data files, and damaged copies of one finished tiny run (`finished_run`). Nearly every
case fails before any model is loaded; the few that reach the planner or the tokenizer use the tiny model and the
8-line example data. A handful run as real subprocesses too, to see the console a user sees.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lowmem_ft.cli import main

ROOT = Path(__file__).resolve().parents[1]
CHAT = str(ROOT / "examples" / "chat.jsonl")


# -- the world: every bad input, built once ----------------------------------------------------------------------
def _copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _truncate(path: Path, size: int) -> None:
    os.truncate(path, size)


def _models(model: Path, root: Path) -> None:
    m = root / "models"
    _truncate(
        _copy_model(model, m / "truncated") / "model.safetensors", (model / "model.safetensors").stat().st_size // 2
    )
    (_copy_model(model, m / "empty-weights") / "model.safetensors").write_bytes(b"")
    head = _copy_model(model, m / "huge-header") / "model.safetensors"
    head.write_bytes((10**12).to_bytes(8, "little") + head.read_bytes()[8:])
    garbage = _copy_model(model, m / "garbage-header") / "model.safetensors"
    raw = garbage.read_bytes()
    garbage.write_bytes(
        raw[:8] + b"x" * (int.from_bytes(raw[:8], "little")) + raw[8 + int.from_bytes(raw[:8], "little") :]
    )
    (_copy_model(model, m / "no-weights") / "model.safetensors").unlink()
    (_copy_model(model, m / "no-config") / "config.json").unlink()
    (_copy_model(model, m / "config-not-json") / "config.json").write_text("{'hidden_size': 64,")
    (_copy_model(model, m / "config-list") / "config.json").write_text("[1, 2]")
    (_copy_model(model, m / "config-binary") / "config.json").write_bytes(b"\xff\xfe\x00garbage")
    sharded = _copy_model(model, m / "shard-missing")
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    index = {
        "metadata": {},
        "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
    }
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    broken_index = _copy_model(model, m / "index-not-json")
    (broken_index / "model.safetensors").unlink()
    (broken_index / "model.safetensors.index.json").write_text("{nope")
    (m / "a-file").write_text("not a model\n")


RECIPES = {
    "invalid.yaml": "memory:\n  micro_batch_size: [1, 2\n",
    "list.yaml": "- memory\n- training\n",
    "scalar.yaml": "just a string\n",
    "loop-a.yaml": "base: loop-b.yaml\n",
    "loop-b.yaml": "base: loop-a.yaml\n",
    "missing-base.yaml": "base: 12gb\n",
    "deep.yaml": "memory: " + "[" * 3000 + "]" * 3000 + "\n",
    "unknown-key.yaml": "base: 8gb\nmemory:\n  micro_batchsize: 2\n",
    "wrong-section.yaml": "base: 8gb\nmemory:\n  lr: 0.001\n",
    "wrong-type.yaml": "base: 8gb\nmemory:\n  max_seq_len: long\n",
    "section-scalar.yaml": "base: 8gb\nmemory: 5\n",
    "trust-string.yaml": "base: 8gb\nmodel:\n  trust_remote_code: 'yes'\n",
    "negative-lr.yaml": "base: 8gb\noptimizer:\n  lr: -0.01\n",
    "zero-epochs.yaml": "base: 8gb\ntraining:\n  epochs: 0\n",
    "nan-margin.yaml": "base: 8gb\nmemory:\n  safety_margin_gb: .nan\n",
    "long-seq.yaml": "base: 8gb\nmemory:\n  max_seq_len: 8192\n",
}


def _recipes(root: Path) -> None:
    r = root / "recipes"
    r.mkdir()
    for name, text in RECIPES.items():
        (r / name).write_text(text, encoding="utf-8")
    (r / "binary.yaml").write_bytes(bytes(range(256)) * 4)
    (r / "latin1.yaml").write_bytes("memory:\n  max_seq_len: 512 # größer\n".encode("latin-1"))
    (r / "a-directory.yaml").mkdir()


def _data(root: Path) -> None:
    d = root / "data"
    d.mkdir()
    (d / "deep.jsonl").write_text('{"text": "fine"}\n{"text": ' + "[" * 5000 + "]" * 5000 + "}\n")
    (d / "bad.jsonl").write_text('{"text": "fine"}\n{"text": "broken\n')
    (d / "binary.jsonl").write_bytes(b'{"text": "ok"}\n' + bytes(range(128, 256)) + b"\n")
    (d / "empty.jsonl").write_text("")
    (d / "role.jsonl").write_text(json.dumps({"messages": [{"role": "bot", "content": "hi"}]}) + "\n")
    (d / "no-field.jsonl").write_text(json.dumps({"title": "no text field"}) + "\n")
    (d / "empty-dir").mkdir()


def _run_copy(run: Path, dst: Path, checkpoints: bool = False, interrupted: bool = False) -> Path:
    """A copy of the finished run; `interrupted`: as a run stopped by a signal after its last step looks, which
    `--resume` continues (a finished run it refuses before reading anything else)."""
    shutil.copytree(run, dst, ignore=None if checkpoints else shutil.ignore_patterns("checkpoints"))
    if interrupted:
        info = json.loads((dst / "run.json").read_text())
        info["status"] = {**info["status"], "state": "interrupted", "signal": "SIGTERM"}
        (dst / "run.json").write_text(json.dumps(info))
    return dst


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def _runs(run: Path, root: Path) -> None:
    r = root / "runs"
    (r / "not-a-run").mkdir(parents=True)
    (r / "a-file").write_text("not a run directory\n")
    (_run_copy(run, r / "recipe-binary", interrupted=True) / "recipe.yaml").write_bytes(bytes(range(256)))
    (_run_copy(run, r / "recipe-invalid") / "recipe.yaml").write_text("model: [unclosed\n")
    with (_run_copy(run, r / "recipe-unknown-key", interrupted=True) / "recipe.yaml").open("a") as handle:
        handle.write("surprise:\n  key: 1\n")
    shutil.rmtree(_run_copy(run, r / "unfinished", checkpoints=True, interrupted=True) / "adapter")
    shutil.rmtree(_run_copy(run, r / "adapter-gone") / "adapter")  # completed, then its adapter/ removed
    (_run_copy(run, r / "adapter-config-not-json") / "adapter" / "adapter_config.json").write_text("{nope")
    (_run_copy(run, r / "adapter-config-list") / "adapter" / "adapter_config.json").write_text("[]")
    _edit_json(_run_copy(run, r / "adapter-not-lora") / "adapter" / "adapter_config.json", peft_type="PREFIX_TUNING")
    _edit_json(_run_copy(run, r / "adapter-rank-string") / "adapter" / "adapter_config.json", r="sixteen")
    _edit_json(_run_copy(run, r / "adapter-base-moved") / "adapter" / "adapter_config.json",
               base_model_name_or_path=str(root / "moved" / "tiny-qwen2"))  # fmt: skip
    weights = _run_copy(run, r / "adapter-truncated") / "adapter" / "adapter_model.safetensors"
    _truncate(weights, weights.stat().st_size - 100)
    (_run_copy(run, r / "adapter-no-weights") / "adapter" / "adapter_model.safetensors").unlink()
    (_run_copy(run, r / "adapter-empty-weights") / "adapter" / "adapter_model.safetensors").write_bytes(b"")
    _edit_json(
        _run_copy(run, r / "run-json-bad-choice", checkpoints=True, interrupted=True) / "run.json",
        choice={"how": "plan", "vram_gb": "lots"},
    )
    (_run_copy(run, r / "run-json-inf", checkpoints=True) / "run.json").write_text(
        '{"choice": {"vram_gb": Infinity}, "status": {"state": "interrupted", "signal": "SIGTERM", "step": 2}}'
    )
    # checkpoints for --resume
    shutil.rmtree(_run_copy(run, r / "no-checkpoints", checkpoints=True, interrupted=True) / "checkpoints")
    # `--resume` takes the newest complete checkpoint (an earlier one when the newest is damaged, tests/test_rundir.py):
    # with checkpoint-1 gone, the damaged checkpoint-2 is all there is, and the run cannot continue
    for name in ("empty-newest", "truncated-newest", "state-corrupt", "state-no-step", "optimizer-truncated",
                 "no-optimizer", "only-one-corrupt", "optimizer-garbage"):  # fmt: skip
        shutil.rmtree(
            _run_copy(run, r / f"ck-{name}", checkpoints=True, interrupted=True) / "checkpoints" / "checkpoint-1"
        )
    newest = "checkpoints/checkpoint-2"
    for f in (r / "ck-empty-newest" / newest).iterdir():
        f.unlink()
    _truncate(r / "ck-truncated-newest" / newest / "adapter_model.safetensors", 50)
    (r / "ck-state-corrupt" / newest / "trainer_state.json").write_text('{"global_step": 2, "log_hist')
    _edit_json(r / "ck-state-no-step" / newest / "trainer_state.json", global_step="two")
    optimizer = r / "ck-optimizer-truncated" / newest / "optimizer.pt"
    _truncate(optimizer, optimizer.stat().st_size // 2)
    (r / "ck-no-optimizer" / newest / "optimizer.pt").unlink()
    (r / "ck-optimizer-garbage" / newest / "optimizer.pt").write_bytes(b"not a torch file at all")
    _truncate(r / "ck-only-one-corrupt" / newest / "adapter_model.safetensors", 10)
    full = root / "out" / "full"
    full.mkdir(parents=True)
    (full / "keep.txt").write_text("mine")


@pytest.fixture(scope="session")
def world(tiny_model, finished_run, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("bad-inputs")
    _models(Path(tiny_model), root)
    _recipes(root)
    _data(root)
    _runs(Path(finished_run), root)
    return {
        "model": tiny_model,
        "data": CHAT,
        "run": finished_run,
        "models": str(root / "models"),
        "recipes": str(root / "recipes"),
        "bad": str(root / "data"),
        "runs": str(root / "runs"),
        "out": str(root / "out"),
        "tmp": str(root),
    }


# -- the catalogue -----------------------------------------------------------------------------------------------
# (argv with {placeholders} from `world`, words the one error line must contain)
TRAIN = "train --vram 8 --model {model} --data {data} --no-wandb --set training.output_dir={tmp}/train-out"
PLAN = "plan --vram 8 --model {model}"
GEN = "generate {run} --prompt hi"
MERGE = "merge {run} --output {tmp}/merged"

FLAGS = [
    # train
    ("train --vram abc", ["argument --vram", "expected a number", "'abc'"]),
    ("train --vram inf --model {model} --data {data}", ["argument --vram", "finite", "'inf'"]),
    ("train --vram nan --model {model} --data {data}", ["argument --vram", "finite", "'nan'"]),
    ("train --vram=-inf", ["argument --vram", "finite"]),
    ("train --vram 0 --model {model} --data {data}", ["argument --vram", "above 0 GB", "got 0"]),
    ("train --vram -8 --model {model} --data {data}", ["argument --vram", "above 0 GB", "got -8"]),
    ("train --vram 1e400", ["argument --vram", "finite"]),
    (TRAIN + " --gpus 0", ["argument --gpus", "at least 1", "got 0"]),
    (TRAIN + " --gpus -2", ["argument --gpus", "at least 1"]),
    (TRAIN + " --gpus two", ["argument --gpus", "expected an integer", "'two'"]),
    (TRAIN + " --gpus 1.5", ["argument --gpus", "expected an integer"]),
    (TRAIN + " --gpus 99999999999", ["argument --gpus", "below 2,147,483,648"]),
    (TRAIN + " --nodes 0", ["argument --nodes", "at least 1", "got 0"]),
    (TRAIN + " --nodes -1", ["argument --nodes", "at least 1"]),
    (TRAIN + " --name ../escaped", ["argument --name", "a name, not a path"]),
    (TRAIN + " --name /tmp/abs", ["argument --name", "a name, not a path"]),
    (TRAIN + " --name a/b", ["argument --name", "a name, not a path"]),
    (TRAIN + " --name ..", ["argument --name", "a name, not a path"]),
    (TRAIN + " --name=", ["argument --name", "a name, not a path"]),
    (TRAIN + " --strategy zero4", ["argument --strategy", "invalid choice", "zero4"]),
    (TRAIN + " --format yaml", ["argument --format", "invalid choice", "yaml"]),
    (TRAIN + " --bogus", ["lowmem-ft train: error: unrecognized arguments: --bogus"]),
    (TRAIN + " --set", ["argument --set", "expected one argument"]),
    # plan
    ("plan --vram 8", ["required", "--model"]),
    ("plan --model {model}", ["required", "--vram"]),
    ("plan --vram eight --model {model}", ["argument --vram", "expected a number", "'eight'"]),
    ("plan --vram inf --model {model}", ["argument --vram", "finite"]),
    ("plan --vram nan --model {model}", ["argument --vram", "finite"]),
    ("plan --vram 0 --model {model}", ["argument --vram", "above 0 GB"]),
    ("plan --vram -24 --model {model}", ["argument --vram", "above 0 GB"]),
    (PLAN + " --seq-len 8", ["argument --seq-len", "at least 16", "got 8"]),
    (PLAN + " --seq-len 0", ["argument --seq-len", "at least 16"]),
    (PLAN + " --seq-len -512", ["argument --seq-len", "at least 16"]),
    (PLAN + " --seq-len 1k", ["argument --seq-len", "expected an integer", "'1k'"]),
    (PLAN + " --seq-len 512.5", ["argument --seq-len", "expected an integer"]),
    (PLAN + " --gpus 0", ["argument --gpus", "at least 1"]),
    (PLAN + " --strategy tp", ["argument --strategy", "invalid choice"]),
    # generate
    ("generate", ["required", "RUN_DIR"]),
    (GEN + " --max-new-tokens 0", ["argument --max-new-tokens", "at least 1", "got 0"]),
    (GEN + " --max-new-tokens -5", ["argument --max-new-tokens", "at least 1"]),
    (GEN + " --max-new-tokens many", ["argument --max-new-tokens", "expected an integer"]),
    (GEN + " --temperature -0.1", ["argument --temperature", "at least 0", "got -0.1"]),
    (GEN + " --temperature nan", ["argument --temperature", "finite"]),
    (GEN + " --temperature inf", ["argument --temperature", "finite"]),
    (GEN + " --top-p 0", ["argument --top-p", "in (0, 1]", "got 0"]),
    (GEN + " --top-p 1.5", ["argument --top-p", "in (0, 1]", "got 1.5"]),
    (GEN + " --top-p -1", ["argument --top-p", "in (0, 1]"]),
    (GEN + " --repetition-penalty -1", ["argument --repetition-penalty", "above 0", "got -1"]),
    (GEN + " --repetition-penalty 0", ["argument --repetition-penalty", "above 0"]),
    (GEN + " --repetition-penalty nan", ["argument --repetition-penalty", "finite"]),
    (GEN + " --seed -1", ["argument --seed", "at least 0"]),
    (GEN + " --seed lucky", ["argument --seed", "expected an integer"]),
    (GEN + " --vram 0", ["argument --vram", "above 0 GB"]),
    (GEN + " --vram inf", ["argument --vram", "finite"]),
    (GEN + " --device tpu", ["argument --device", "invalid choice", "tpu"]),
    # merge
    ("merge {run}", ["required", "--output"]),
    (MERGE + " --max-shard-size 1.5GB", ["argument --max-shard-size", "whole number", "'1.5GB'"]),
    (MERGE + " --max-shard-size big", ["argument --max-shard-size", "'big'"]),
    (MERGE + " --max-shard-size 0GB", ["argument --max-shard-size", "positive"]),
    (MERGE + " --max-shard-size 5TB", ["argument --max-shard-size", "'5TB'"]),
    (MERGE + " --dtype int8", ["argument --dtype", "invalid choice"]),
    (MERGE + " --device npu", ["argument --device", "invalid choice"]),
    # the rest
    ("data stats {data} --model {model} --max-len 0", ["argument --max-len", "at least 1"]),
    ("data stats {data} --model {model} --max-len -3", ["argument --max-len", "at least 1"]),
    ("data stats {data} --model {model} --max-len long", ["argument --max-len", "expected an integer"]),
    ("data stats {data} --model {model} --format csv", ["argument --format", "invalid choice"]),
    ("data", ["required", "SUBCOMMAND"]),
    ("data statistics", ["invalid choice", "statistics"]),
    ("recipes remove 8gb", ["argument action", "invalid choice", "remove"]),
    ("report", ["required", "RUN_DIR"]),
    ("doctor --gpu", ["lowmem-ft doctor: error: unrecognized arguments: --gpu"]),
    ("finetune --vram 8", ["invalid choice", "finetune"]),
]

RECIPE_VALUES = [
    # the silent acceptances and tracebacks, through train (checked before any data is read)
    (TRAIN + " --set optimizer.lr=-0.01", ["--set", "'optimizer.lr' must be above 0", "-0.01"]),
    (TRAIN + " --set optimizer.lr=0", ["--set", "'optimizer.lr' must be above 0", "got 0"]),
    (TRAIN + " --set adapter.dropout=2.5", ["'adapter.dropout' must be in [0, 1)", "2.5"]),
    (TRAIN + " --set training.epochs=0", ["'training.epochs' must be above 0"]),
    (TRAIN + " --set training.save_steps=0", ["'training.save_steps' must be at least 1", "got 0"]),
    (TRAIN + " --set training.logging_steps=-5", ["'training.logging_steps' must be at least 1", "-5"]),
    (TRAIN + " --set training.save_total_limit=-1", ["'training.save_total_limit' must be at least 0", "-1"]),
    (TRAIN + " --set optimizer.lr=.nan", ["'optimizer.lr' must be a finite number"]),
    # the rest of the schema's ranges and types, through plan (no torch, no data)
    (PLAN + " --set optimizer.lr=.inf", ["'optimizer.lr' must be a finite number"]),
    (PLAN + " --set optimizer.lr=fast", ["'optimizer.lr' must be a number", "'fast'"]),
    (PLAN + " --set optimizer.weight_decay=-0.1", ["'optimizer.weight_decay' must be at least 0"]),
    (PLAN + " --set optimizer.warmup_ratio=1", ["'optimizer.warmup_ratio' must be in [0, 1)"]),
    (PLAN + " --set optimizer.warmup_ratio=-0.5", ["'optimizer.warmup_ratio' must be in [0, 1)"]),
    (PLAN + " --set optimizer.max_grad_norm=-1", ["'optimizer.max_grad_norm' must be at least 0"]),
    (PLAN + " --set optimizer.name=sgd", ["'optimizer.name' must be one of", "adamw_torch", "'sgd'"]),
    (PLAN + " --set optimizer.schedule=step", ["'optimizer.schedule' must be one of", "cosine"]),
    (PLAN + " --set adapter.dropout=-0.1", ["'adapter.dropout' must be in [0, 1)"]),
    (PLAN + " --set adapter.dropout=1", ["'adapter.dropout' must be in [0, 1)"]),
    (PLAN + " --set adapter.r=0", ["'adapter.r' must be at least 1"]),
    (PLAN + " --set adapter.r=-4", ["'adapter.r' must be at least 1"]),
    (PLAN + " --set adapter.r=1.5", ["'adapter.r' must be an integer"]),
    (PLAN + " --set adapter.alpha=0", ["'adapter.alpha' must be at least 1"]),
    (PLAN + " --set adapter.kind=qlora", ["'adapter.kind' must be one of", "lora, full"]),
    (PLAN + " --set adapter.target_modules=7", ["'adapter.target_modules' must be a list", "got 7"]),
    (PLAN + " --set training.epochs=-1", ["'training.epochs' must be above 0"]),
    (PLAN + " --set training.max_steps=0", ["'training.max_steps' must be -1 (use epochs) or positive"]),
    (PLAN + " --set training.max_steps=-5", ["'training.max_steps' must be -1 (use epochs) or positive"]),
    (PLAN + " --set training.logging_steps=0", ["'training.logging_steps' must be at least 1"]),
    (PLAN + " --set training.eval_steps=0", ["'training.eval_steps' must be at least 1"]),
    (PLAN + " --set training.seed=-1", ["'training.seed' must be at least 0"]),
    (PLAN + " --set training.seed=99999999999", ["'training.seed' must be below 2,147,483,648"]),
    (PLAN + " --set memory.micro_batch_size=0", ["'memory.micro_batch_size' must be at least 1"]),
    (PLAN + " --set memory.micro_batch_size=100000000000000000000", ["'memory.micro_batch_size' must be below"]),
    (PLAN + " --set memory.gradient_accumulation=0", ["'memory.gradient_accumulation' must be at least 1"]),
    (PLAN + " --set memory.max_seq_len=8", ["'memory.max_seq_len' must be at least 16"]),
    (PLAN + " --set memory.safety_margin_gb=-1", ["'memory.safety_margin_gb' must be at least 0"]),
    (PLAN + " --set memory.eval_batch_size=-1", ["'memory.eval_batch_size' must be at least 0"]),
    (PLAN + " --set memory.gradient_checkpointing=maybe", ["'memory.gradient_checkpointing' must be true or false"]),
    (PLAN + " --set data.eval_fraction=1", ["'data.eval_fraction' must be in [0, 1)"]),
    (PLAN + " --set data.overlap=-1", ["'data.overlap' must be at least 0"]),
    (PLAN + " --set data.truncate=middle", ["'data.truncate' must be one of"]),
    (PLAN + " --set data.columns=prompt", ["'data.columns' must be a mapping"]),
    (PLAN + " --set model.quantization=int4", ["'model.quantization' must be one of", "nf4"]),
    (PLAN + " --set model.compute_dtype=fp8", ["'model.compute_dtype' must be one of"]),
    (PLAN + " --set model.trust_remote_code=maybe", ["'model.trust_remote_code' must be true or false"]),
    (PLAN + " --set logging.wandb_mode=loud", ["'logging.wandb_mode' must be one of"]),
    (
        PLAN + " --set memory.max_seq_length=64",
        ["unknown key 'memory.max_seq_length'", "did you mean 'memory.max_seq_len'"],
    ),
    (PLAN + " --set memory.lr=0.1", ["unknown key 'memory.lr'", "belongs under 'optimizer.lr'"]),
    (PLAN + " --set optimiser.lr=0.1", ["unknown section 'optimiser'", "did you mean 'optimizer'"]),
    (PLAN + " --set memory.micro_batch_size", ["--set: 'memory.micro_batch_size': expected section.key=value"]),
    (PLAN + " --set nodot=1", ["expected section.key=value"]),
    (PLAN + " --set adapter.kind=full --set model.quantization=nf4", ["full cannot train nf4"]),
    (
        PLAN + " --set memory.activation_offloading=true --set memory.gradient_checkpointing=false",
        ["'memory.activation_offloading'", "needs memory.gradient_checkpointing=true"],
    ),  # fmt: skip
    (
        PLAN + " --set data.truncate=chunk --set data.overlap=64 --set memory.max_seq_len=64",
        ["'data.overlap' (64) must be smaller than memory.max_seq_len (64)"],
    ),  # fmt: skip
    ("recipes show 8gb --set optimizer.lr=0", ["'optimizer.lr' must be above 0"]),
]

RECIPE_FILES = [
    ("recipes show {recipes}/binary.yaml", ["binary.yaml", "not a text file", "UTF-8"]),
    ("recipes show {recipes}/latin1.yaml", ["latin1.yaml", "not a text file"]),
    ("train --recipe {recipes}/binary.yaml --model {model} --data {data}", ["binary.yaml", "not a text file"]),
    (PLAN + " --recipe {recipes}/binary.yaml", ["binary.yaml", "not a text file"]),
    ("recipes show {recipes}/invalid.yaml", ["invalid.yaml:3", "not valid YAML", "expected ',' or ']'"]),
    ("recipes show {recipes}/list.yaml", ["list.yaml", "a recipe is a mapping of sections, got list"]),
    ("recipes show {recipes}/scalar.yaml", ["scalar.yaml", "a recipe is a mapping of sections, got str"]),
    ("recipes show {recipes}/loop-a.yaml", ["inheritance loops back"]),
    ("recipes show {recipes}/missing-base.yaml", ["recipe '12gb' is neither a file nor a shipped recipe"]),
    ("recipes show {recipes}/deep.yaml", ["deep.yaml", "nested deeper"]),
    ("recipes show {recipes}/unknown-key.yaml", ["unknown-key.yaml", "did you mean 'memory.micro_batch_size'"]),
    ("recipes show {recipes}/wrong-section.yaml", ["wrong-section.yaml", "'lr' belongs under 'optimizer.lr'"]),
    ("recipes show {recipes}/wrong-type.yaml", ["wrong-type.yaml", "'memory.max_seq_len' must be an integer"]),
    ("recipes show {recipes}/section-scalar.yaml", ["section 'memory' must be a mapping of keys"]),
    ("recipes show {recipes}/trust-string.yaml", ["'model.trust_remote_code' must be true or false"]),
    ("recipes show {recipes}/nan-margin.yaml", ["'memory.safety_margin_gb' must be a finite number"]),
    ("recipes show {recipes}/a-directory.yaml", ["a-directory.yaml", "a directory, not a recipe file"]),
    ("recipes show 24gbb", ["recipe '24gbb' is neither a file nor a shipped recipe", "did you mean '24gb'"]),
    ("recipes show", ["give a recipe name"]),
    (TRAIN + " --recipe {recipes}/negative-lr.yaml", ["negative-lr.yaml", "'optimizer.lr' must be above 0"]),
    (TRAIN + " --recipe {recipes}/zero-epochs.yaml", ["zero-epochs.yaml", "'training.epochs' must be above 0"]),
    (PLAN + " --recipe {recipes}/long-seq.yaml", ["recipe", "long-seq.yaml", "max_seq_len 8192", "4096 positions"]),
]

MODELS = [
    (TRAIN.replace("{model}", "{models}/truncated"), ["model.safetensors is truncated", "281,052 of 562,104 bytes"]),
    (TRAIN.replace("{model}", "{models}/empty-weights"), ["model.safetensors is truncated", "0 bytes"]),
    (TRAIN.replace("{model}", "{models}/huge-header"), ["model.safetensors is corrupt", "header"]),
    (TRAIN.replace("{model}", "{models}/garbage-header"), ["model.safetensors is corrupt", "not a safetensors header"]),
    (TRAIN.replace("{model}", "{models}/no-weights"), ["no-weights", "no weights", "model.safetensors"]),
    (TRAIN.replace("{model}", "{models}/no-config"), ["no-config", "no config.json"]),
    (TRAIN.replace("{model}", "{models}/config-not-json"), ["config.json", "not valid JSON"]),
    (TRAIN.replace("{model}", "{models}/config-list"), ["config.json", "expected a JSON object", "list"]),
    (TRAIN.replace("{model}", "{models}/config-binary"), ["config.json", "not a text file"]),
    (TRAIN.replace("{model}", "{models}/shard-missing"), ["names shards that are missing", "00002-of-00002"]),
    (TRAIN.replace("{model}", "{models}/index-not-json"), ["model.safetensors.index.json", "not valid JSON"]),
    (TRAIN.replace("{model}", "{models}/a-file"), ["a-file", "a file, not a model directory"]),
    (TRAIN.replace("{model}", "{tmp}/nowhere/model"), ["nowhere/model", "no such directory"]),
    ("train --model {models}/truncated --data {data} --recipe 8gb", ["model.safetensors is truncated"]),
    ("plan --vram 8 --model {models}/no-config", ["no-config", "no config.json"]),
    ("plan --vram 8 --model {models}/config-not-json", ["config.json", "not valid JSON"]),
    ("plan --vram 8 --model {models}/a-file", ["a file, not a model directory"]),
    ("plan --vram 8 --model ./no/such/model", ["./no/such/model", "no such directory"]),
    (GEN + " --base {models}/truncated", ["--base", "model.safetensors is truncated"]),
    (GEN + " --base {models}/no-config", ["--base", "no config.json"]),
    (GEN + " --base {tmp}/nowhere", ["--base", "no such directory"]),
    (MERGE + " --base {models}/no-weights", ["--base", "no weights"]),
    (MERGE + " --base {models}/a-file", ["--base", "a file, not a model directory"]),
]

DATA = [
    (TRAIN.replace("{data}", "{bad}/missing.jsonl"), ["missing.jsonl does not exist"]),
    (TRAIN.replace("{data}", "{bad}/deep.jsonl"), ["deep.jsonl:2", "nested deeper"]),
    (TRAIN.replace("{data}", "{bad}/bad.jsonl"), ["bad.jsonl:2", "invalid JSON"]),
    (TRAIN.replace("{data}", "{bad}/binary.jsonl"), ["binary.jsonl:2", "UTF-8"]),
    (TRAIN.replace("{data}", "{bad}/empty.jsonl"), ["empty.jsonl", "empty"]),
    (TRAIN.replace("{data}", "{bad}/role.jsonl"), ["role.jsonl:1", "'bot'"]),
    (TRAIN.replace("{data}", "{bad}/empty-dir"), ["empty-dir holds no data files"]),
    (TRAIN + " --eval-data {bad}/missing-eval.jsonl", ["missing-eval.jsonl does not exist"]),
    ("data stats {bad}/deep.jsonl --model {model}", ["deep.jsonl:2", "nested deeper"]),
    ("data stats {bad}/bad.jsonl --model {model}", ["bad.jsonl:2", "invalid JSON"]),
    ("data stats {bad}/no-field.jsonl --model {model}", ["no-field.jsonl"]),
    ("data stats {data}", ["no model given"]),
    ("data stats {data} --model {models}/a-file", ["--model", "a-file: a file, not a model directory"]),
    ("data stats {data} --model {tmp}/nowhere/tok", ["--model", "nowhere/tok: no such directory"]),
    ("data stats {data} --model {model} --column prompt", ["--column 'prompt'", "OURS=THEIRS"]),
    ("plan --vram 8 --model {model} --data {bad}/missing.jsonl", ["missing.jsonl does not exist"]),
]

RUNS = [
    # run directories that are not (generate / merge / resume / report)
    ("generate {tmp}/no-such-run --prompt hi", ["no-such-run does not exist"]),
    ("merge {tmp}/no-such-run --output {tmp}/m", ["no-such-run does not exist"]),
    ("train --resume {tmp}/no-such-run", ["no-such-run does not exist"]),
    ("report {tmp}/no-such-run", ["no-such-run does not exist"]),
    ("generate {runs}/a-file --prompt hi", ["a-file is a file, not a run directory"]),
    ("merge {runs}/a-file --output {tmp}/m", ["a-file is a file, not a run directory"]),
    ("train --resume {runs}/a-file", ["a-file is a file, not a run directory"]),
    ("report {runs}/a-file", ["a-file", "no memory.jsonl"]),
    ("generate {runs}/not-a-run --prompt hi", ["not a run directory (no recipe.yaml)"]),
    ("merge {runs}/not-a-run --output {tmp}/m", ["not a run directory (no recipe.yaml)"]),
    ("train --resume {runs}/not-a-run", ["not a run directory (no recipe.yaml)"]),
    ("report {runs}/not-a-run", ["not-a-run", "no memory.jsonl"]),
    # a damaged recipe.yaml
    ("generate {runs}/recipe-binary --prompt hi", ["recipe.yaml", "not a text file"]),
    ("merge {runs}/recipe-binary --output {tmp}/m", ["recipe.yaml", "not a text file"]),
    ("train --resume {runs}/recipe-binary", ["recipe.yaml", "not a text file"]),
    ("generate {runs}/recipe-invalid --prompt hi", ["recipe.yaml:2", "not valid YAML"]),
    ("train --resume {runs}/recipe-unknown-key", ["recipe.yaml", "unknown section 'surprise'"]),
    # adapters
    ("generate {runs}/unfinished --prompt hi", ["has no adapter/", "did not finish", "--resume"]),
    ("merge {runs}/unfinished --output {tmp}/m", ["has no adapter/", "did not finish"]),
    # issue 32: a completed run refuses --resume, so its missing adapter/ is not advised to be resumed
    ("generate {runs}/adapter-gone --prompt hi", ["has no adapter/", "the run completed", "train the run again"]),
    ("merge {runs}/adapter-gone --output {tmp}/m", ["has no adapter/", "the run completed", "put them back"]),
    ("generate {runs}/adapter-config-not-json --prompt hi", ["adapter_config.json", "not valid JSON"]),
    ("merge {runs}/adapter-config-not-json --output {tmp}/m", ["adapter_config.json", "not valid JSON"]),
    ("generate {runs}/adapter-config-list --prompt hi", ["adapter_config.json", "expected a JSON object"]),
    ("generate {runs}/adapter-not-lora --prompt hi", ["adapter_config.json", "'PREFIX_TUNING', not 'LORA'"]),
    ("merge {runs}/adapter-rank-string --output {tmp}/m", ["adapter_config.json", "r must be a positive integer"]),
    (
        "generate {runs}/adapter-base-moved --prompt hi",
        ["base model", "moved/tiny-qwen2", "no such directory", "--base"],
    ),
    ("merge {runs}/adapter-base-moved --output {tmp}/m", ["base model", "no such directory", "--base PATH"]),
    ("generate {runs}/adapter-truncated --prompt hi", ["adapter_model.safetensors is truncated", "cut short"]),
    ("merge {runs}/adapter-truncated --output {tmp}/m", ["adapter_model.safetensors is truncated"]),
    ("generate {runs}/adapter-no-weights --prompt hi", ["holds no LoRA adapter", "adapter_model.safetensors"]),
    ("merge {runs}/adapter-empty-weights --output {tmp}/m", ["adapter_model.safetensors is truncated", "0 bytes"]),
    # checkpoints for --resume
    ("train --resume {runs}/no-checkpoints", ["no complete checkpoint", "without --resume"]),
    ("train --resume {runs}/ck-empty-newest", ["skipped checkpoint-2", "no trainer_state.json", "without --resume"]),
    (
        "train --resume {runs}/ck-truncated-newest",
        ["skipped checkpoint-2", "adapter_model.safetensors is truncated", "without --resume"],
    ),  # fmt: skip
    ("train --resume {runs}/ck-state-corrupt", ["checkpoint-2", "trainer_state.json is broken", "not valid JSON"]),
    ("train --resume {runs}/ck-state-no-step", ["checkpoint-2", "trainer_state.json has no global_step"]),
    ("train --resume {runs}/ck-optimizer-truncated", ["checkpoint-2", "optimizer.pt is truncated or corrupt"]),
    ("train --resume {runs}/ck-optimizer-garbage", ["checkpoint-2", "optimizer.pt is corrupt"]),
    ("train --resume {runs}/ck-no-optimizer", ["checkpoint-2", "no optimizer state"]),
    (
        "train --resume {runs}/ck-only-one-corrupt",
        ["checkpoint-2", "truncated", "start the run again without --resume"],
    ),
    ("train --resume {runs}/run-json-bad-choice", ["run.json", "choice record is malformed", "'lots'"]),
    ("train --resume {runs}/run-json-inf", ["run.json", "choice record is malformed", "vram_gb inf"]),
    # merge --output
    ("merge {run} --output {out}/full", ["--output", "exists and is not empty"]),
    ("merge {run} --output {runs}/a-file", ["--output", "is a file"]),
    ("merge {run} --output {runs}/a-file/merged", ["--output", "cannot write there", "Not a directory"]),
    ("merge {run} --output {run}/checkpoints/merged", ["--output", "inside the run's checkpoints/"]),
    ("merge {run} --output {run}/adapter/merged", ["--output", "inside the run's adapter/"]),
]

PLANNING = [
    (PLAN + " --seq-len 100000", ["--seq-len 100000", "beyond the 4096 positions", "use 4096 or less"]),
    (PLAN + " --set memory.max_seq_len=8192", ["--set memory.max_seq_len=8192", "4096 positions"]),
    (PLAN + " --recipe 8gb --seq-len 5000", ["--seq-len 5000", "4096 positions"]),
    (TRAIN + " --set memory.max_seq_len=8192", ["--set memory.max_seq_len=8192", "4096 positions"]),
    ("train --recipe {recipes}/long-seq.yaml --model {model} --data {data}", ["long-seq.yaml", "4096 positions"]),
    (PLAN + " --vram 0.5", ["--vram 0.5", "safety margin", "0.75 GB", "smallest sensible --vram is 1.25"]),
    (TRAIN.replace("--vram 8", "--vram 0.7"), ["--vram 0.7", "safety margin", "smallest sensible --vram"]),
    (PLAN + " --set memory.safety_margin_gb=9", ["--vram 8", "9 GB safety margin"]),
    ("plan --vram 8 --model Qwen/Qwen2.5-72B", ["needs", "smaller model"]),
    (
        "plan --vram 8 --model Qwen/Qwen2.5-7B --recipe 40gb",
        ["recipe 40gb does not fit", "over the budget", "plan on stdout shows where it goes"],
    ),
    (PLAN + " --output {tmp}", ["--output", "is a directory"]),
    (PLAN + " --output {tmp}/no/such/dir/r.yaml", ["--output", "does not exist"]),
    ("train --vram 8 --data {data}", ["no model given", "--model"]),
    (
        TRAIN + " --set training.output_dir={runs}/a-file/runs",
        ["training.output_dir", "cannot write there", "Not a directory"],
    ),
    (
        "train --model {model} --data {data} --recipe 8gb --set training.output_dir={runs}/a-file",
        ["training.output_dir", "cannot write there"],
    ),  # fmt: skip
    ("train --model {model} --data {data}", ["--vram"]),
    (TRAIN + " --nodes 2", ["--nodes 2", "main_process_ip"]),
    (TRAIN + " --gpus 2 --strategy fsdp", ["--strategy fsdp needs CUDA GPUs"]),
    (TRAIN + " --gpus 2 --strategy ddp --offload", ["--offload needs a sharded strategy", "--strategy fsdp"]),
    (PLAN + " --gpus 2 --strategy ddp --offload", ["--offload needs a sharded strategy"]),
]

CATALOGUE = [
    pytest.param(argv, words, id=f"{group}:{argv.split(' ', 1)[0]}:{index}")
    for group, cases in (
        ("flags", FLAGS),
        ("values", RECIPE_VALUES),
        ("files", RECIPE_FILES),
        ("models", MODELS),
        ("data", DATA),
        ("runs", RUNS),
        ("planning", PLANNING),
    )  # fmt: skip
    for index, (argv, words) in enumerate(cases)
]


def test_the_catalogue_is_at_least_150_cases():
    assert len(CATALOGUE) >= 150, len(CATALOGUE)


@pytest.mark.parametrize(("argv", "words"), CATALOGUE)
def test_bad_input_is_one_line_naming_the_cause(argv, words, world, capsys, caplog):
    if "--device cuda" in argv and _has_cuda():
        pytest.skip("a no-GPU case")
    _one_line_error(argv, words, world, capsys, caplog)


def _one_line_error(argv: str, words, world: dict, capsys, caplog) -> str:
    """Run `argv`: exit 2, no traceback, one `lowmem-ft ...: error:` line holding every word, no warning; the line."""
    caplog.set_level(logging.WARNING)
    code = main(argv.format(**world).split())
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert "Traceback" not in out + err
    assert code == 2, (code, err)
    assert len(lines) == 1, err
    line = lines[0]
    assert line.startswith("lowmem-ft") and ": error: " in line, line
    for word in words:
        assert word.format(**world) in line, (word, line)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [], warnings
    return line


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def test_the_catalogue_left_nothing_behind(world):
    """No case created a run directory, a merged model or a recipe: each was refused before any output."""
    tmp = Path(world["tmp"])
    assert not (tmp / "train-out").exists()
    assert not (tmp / "merged").exists() and not (tmp / "m").exists()
    assert list((Path(world["run"]) / "checkpoints").glob("merged")) == []


# -- the second catalogue (issue 32): the methods' surfaces ------------------------------------------------------
# Preference pairs and KTO samples, GRPO rewards and rounds, host RAM, names, adapter variants, compressed data and
# resumes, each refused in one line (exit 2, no traceback) before any weight is read or any rank launched.
PAIRS = str(ROOT / "tests" / "data" / "fixtures" / "preference" / "pairs_chat.jsonl")
KTO_DATA = str(ROOT / "tests" / "data" / "fixtures" / "preference" / "kto_chat.jsonl")
PROMPTS = str(ROOT / "tests" / "data" / "fixtures" / "grpo" / "gsm8k_mini.jsonl")


def _method_inputs(root: Path, run: Path) -> None:
    import gzip

    d = root / "methods"
    d.mkdir()
    rows = {
        "no-prompt.jsonl": [{"chosen": "Yes, gladly.", "rejected": "No."}] * 2,
        "identical.jsonl": [{"prompt": "Hi?", "chosen": "Hello.", "rejected": "Hello."}],
        "no-rejected.jsonl": [{"prompt": "Hi?", "chosen": "Hello."}],
        "mixed-sides.jsonl": [{"prompt": "Hi?", "chosen": "Hello.", "rejected": [{"role": "assistant", "content": "x"}]}],
        "kto-all-true.jsonl": [{"prompt": "Hi?", "completion": f"Hello {i}.", "label": True} for i in range(4)],
        "kto-all-false.jsonl": [{"prompt": "Hi?", "completion": f"Go {i}.", "label": False} for i in range(4)],
        "kto-label-text.jsonl": [{"prompt": "Hi?", "completion": "Hello.", "label": "yes"}],
        "solution.jsonl": [{"prompt": "1 + 1?", "solution": "#### 2"}] * 4,
        "prompts.jsonl": [{"prompt": f"{i} + 1?", "answer": f"#### {i + 1}"} for i in range(8)],
    }  # fmt: skip
    for name, records in rows.items():
        (d / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    (d / "exits.py").write_text("import sys\nsys.exit(3)\n")
    (d / "ok.py").write_text("def const(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    good = gzip.compress(Path(CHAT).read_bytes())
    (d / "cut.jsonl.gz").write_bytes(good[: len(good) // 2])
    _run_copy(run, d / "interrupted-sft", checkpoints=True, interrupted=True)
    shutil.copytree(run, root / "reused" / "done")  # a completed run, under the name a new run asks for


@pytest.fixture(scope="session")
def method_world(world, finished_run) -> dict[str, str]:
    root = Path(world["tmp"])
    _method_inputs(root, Path(finished_run))
    return {**world, "m": str(root / "methods"), "pairs": PAIRS, "kto": KTO_DATA, "prompts": PROMPTS}


MTRAIN = "train --vram 8 --model {model} --no-wandb --set training.output_dir={tmp}/train-out"
GRPO = MTRAIN + " --method grpo --data {m}/prompts.jsonl"
GRPO_ = MTRAIN + " --method grpo --data {prompts}"
LONG = "n" * 300

METHOD_CASES = [
    # preference pairs and KTO samples
    (MTRAIN + " --method dpo --data {m}/no-prompt.jsonl", ["no-prompt.jsonl:1", "share no prompt text", "data.columns"]),
    (MTRAIN + " --method dpo --data {m}/identical.jsonl", ["identical.jsonl:1", "identical"]),
    (MTRAIN + " --method orpo --data {m}/no-rejected.jsonl", ["no-rejected.jsonl:1", "missing field 'rejected'"]),
    (MTRAIN + " --method simpo --data {m}/mixed-sides.jsonl", ["mixed-sides.jsonl:1", "both be strings or both"]),
    (MTRAIN + " --method kto --data {m}/kto-all-true.jsonl", ["every label is true", "drop the label column"]),
    (MTRAIN + " --method kto --data {m}/kto-all-false.jsonl", ["every label is false", "label true"]),
    (MTRAIN + " --method kto --data {m}/kto-label-text.jsonl", ["kto-label-text.jsonl:1", "must be a boolean"]),
    (MTRAIN + " --method kto --data {kto} --set memory.micro_batch_size=1",
     ["--method kto needs memory.micro_batch_size of at least 2", "--set memory.micro_batch_size=1"]),
    ("train --recipe 8gb --model {model} --method kto --data {kto} --no-wandb",
     ["--method kto", "at least 2", "(recipe 8gb)", "--set memory.micro_batch_size=2"]),
    (PLAN + " --method kto --set memory.micro_batch_size=1", ["--method kto needs memory.micro_batch_size"]),
    # several processes, a recipe as given (not planned): the rows are checked before accelerate launch
    ("train --recipe 24gb --model {model} --method dpo --data {m}/no-prompt.jsonl --gpus 2 --no-wandb "
     "--set training.output_dir={tmp}/train-out", ["no-prompt.jsonl:1", "share no prompt text"]),
    ("train --recipe 24gb --model {model} --method kto --data {kto} --gpus 2 --no-wandb --set "
     "memory.micro_batch_size=1 --set training.output_dir={tmp}/train-out", ["--method kto", "at least 2"]),
    ("data stats {pairs} --model {model}", ["this is preference data", "--method dpo"]),
    ("data stats {kto} --model {model}", ["unpaired preference (KTO) data", "--method kto"]),
    ("data stats {m}/kto-all-true.jsonl --model {model} --method kto", ["every label is true"]),
    # GRPO: rewards and rounds
    (GRPO, ["--method grpo needs a reward", "--set grpo.rewards=[NAME]", "--reward-fn path.py:name"]),
    (GRPO + " --gpus 2", ["--method grpo needs a reward"]),
    (GRPO + " --reward-fn {m}/ok.py:const:abc", ["--reward-fn", "weight 'abc' is not a number"]),
    (GRPO + " --reward-fn {m}/missing.py:f", ["--reward-fn", "no such file"]),
    (GRPO + " --reward-fn {m}/exits.py:f", ["importing exits.py called sys.exit(3)"]),
    (GRPO + " --reward-fn {m}/ok.py:nope", ["ok.py has no 'nope'", "it defines: const"]),
    (MTRAIN + " --data {data} --reward-fn {m}/ok.py:const", ["--reward-fn is for --method grpo", "method is sft"]),
    (GRPO + " --set grpo.rewards=[nope]", ["unknown reward 'nope'", "exact_match"]),
    (GRPO + " --set grpo.rewards=[{m}/ok.py]", ["names a Python file", "--reward-fn"]),
    (GRPO + " --set grpo.use_vllm=true --set grpo.rewards=[format]", ["'grpo.use_vllm' is not supported"]),
    (GRPO.replace("--vram 8", "--recipe 8gb") + " --set grpo.rewards=[format] --set grpo.num_generations=3",
     ["not whole prompt groups of grpo.num_generations 3", "--set grpo.steps_per_generation=3"]),
    (PLAN + " --method grpo --gpus 2 --strategy fsdp", ["--method grpo --strategy fsdp", "--strategy ddp"]),
    (GRPO_ + " --set grpo.rewards=[format]", ["missing field 'prompt'", "data.columns={{prompt: question}}"]),
    (MTRAIN + " --method grpo --data {m}/solution.jsonl --set grpo.rewards=[numeric_match]",
     ["numeric_match needs the data column 'answer'", "--set grpo.answer_column=solution"]),
    # host RAM
    (PLAN + " --host-ram 2", ["--host-ram 2", "not above the 4 GB host margin", "memory.host_margin_gb"]),
    (PLAN + " --host-ram 4", ["--host-ram 4", "not above the 4 GB host margin"]),
    ("train --vram 8 --recipe 8gb --host-ram 2 --model {model} --data {data} --no-wandb", ["--host-ram 2", "margin"]),
    (MTRAIN + " --data {data} --host-ram 1", ["--host-ram 1", "not above the 4 GB host margin"]),
    (PLAN + " --host-ram 8 --set memory.host_margin_gb=9", ["--host-ram 8", "not above the 9 GB host margin"]),
    (PLAN + " --method dpo --host-ram 3", ["--host-ram 3", "host margin"]),
    # names
    (MTRAIN + " --data {data} --name " + LONG, ["argument --name", "300 bytes", "255 bytes"]),
    (MTRAIN + " --data {data} --name " + "é" * 200, ["argument --name", "400 bytes"]),
    # adapter variants
    (PLAN + " --set adapter.init=svd", ["'adapter.init'"]),
    # compressed data
    (MTRAIN + " --data {m}/cut.jsonl.gz", ["cut.jsonl.gz"]),
    (MTRAIN + " --method kto --data {m}/cut.jsonl.gz", ["cut.jsonl.gz"]),
    (MTRAIN + " --method grpo --data {m}/cut.jsonl.gz --set grpo.rewards=[format]", ["cut.jsonl.gz"]),
    (MTRAIN + " --method dpo --data {m}/cut.jsonl.gz", ["cut.jsonl.gz"]),
    # runs: a resume that changes the method, a name a completed run holds
    ("train --resume {m}/interrupted-sft --method dpo --data {pairs}",
     ["--resume", "the run trains --method sft, not dpo", "--adapter", "checkpoint-2"]),
    ("train --vram 8 --model {model} --data {data} --no-wandb --set training.output_dir={tmp}/reused --name done",
     ["already exists", "holds a finished run"]),
]  # fmt: skip


_KEY = re.compile(r"(?<![\w./-])(model|adapter|optimizer|memory|data|training|logging|preference|grpo)\.([a-z_]+)\b")
_SET = re.compile(r"--set ([a-z_]+\.[a-z_]+=[^\s;,)]+)")
_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z-]*)")
_FILES = ("json", "jsonl", "yaml", "py", "png", "safetensors", "pt", "gz")


def assert_the_advice_works(line: str, command: str) -> None:
    """Issue 32: every key a refusal names is a recipe key, every `--set KEY=VALUE` it advises with a concrete value
    parses and validates, and every flag it names exists on the command that printed it or on `train` (whose
    command lines the advice quotes: `continue with: lowmem-ft train --resume ...`). For the methods' catalogue,
    whose lines quote no unknown key or flag of the user's (the first catalogue's do, by design)."""
    from lowmem_ft.cli import build_parser
    from lowmem_ft.recipe.load import parse_overrides, resolve
    from lowmem_ft.recipe.schema import KEYS

    for section, name in _KEY.findall(line):
        if name not in _FILES:
            assert f"{section}.{name}" in KEYS, (f"{section}.{name}", line)
    for item in _SET.findall(line):
        if not re.search(r"[A-Z]|\.\.\.|…", item.partition("=")[2]):  # placeholders (NAME, COLUMN) are not values
            resolve(None, parse_overrides([item]))
    parser = build_parser()
    own = parser.commands[command]
    if command == "data":
        own = next(a for a in own._actions if isinstance(a, argparse._SubParsersAction)).choices["stats"]
    known = {o for p in (own, parser.commands["train"]) for a in p._actions for o in a.option_strings}
    for flag in _FLAG.findall(line):
        assert flag in known, (flag, line)


@pytest.mark.parametrize(
    ("line", "command"),
    [
        ("GRPO needs a reward: name a built-in with training.grpo.rewards or --reward (exact_match)", "train"),
        ("no pair fits; raise --seq-len or set training.dpo.prompt_truncation to keep_end", "train"),
        ("reward numeric_match needs the data column 'answer'; map it with --column answer=X", "train"),
        ("fix it with --set memory.micro_batch_size=-3", "plan"),
    ],
)
def test_the_advice_check_catches_advice_that_does_not_work(line, command):
    """The issue's advice that did not work fails the check: unknown keys, a flag no command has, a flag on another
    command than the one that printed it, a value the key refuses."""
    with pytest.raises(Exception):  # noqa: B017, PT011 — an AssertionError or the recipe's own UserError
        assert_the_advice_works(line, command)


def test_the_methods_catalogue_is_at_least_40_cases():
    assert len(METHOD_CASES) >= 40, len(METHOD_CASES)


@pytest.mark.parametrize(("argv", "words"), [pytest.param(a, w, id=f"methods:{i}") for i, (a, w) in
                                             enumerate(METHOD_CASES)])  # fmt: skip
def test_a_bad_input_to_the_methods_is_one_line(argv, words, method_world, capsys, caplog):
    line = _one_line_error(argv, words, method_world, capsys, caplog)
    assert_the_advice_works(line, argv.split()[0])
    assert not (Path(method_world["tmp"]) / "train-out").exists() or not any(
        (Path(method_world["tmp"]) / "train-out").rglob("*.safetensors")
    )  # refused before any weight was written


# -- the console a user sees: real processes ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "words"),
    [
        ("plan --vram abc --model {model}", ["argument --vram: expected a number, got 'abc'"]),
        ("plan --vram 8 --model {model} --seq-len 100000", ["beyond the 4096 positions"]),
        ("recipes show {recipes}/binary.yaml", ["not a text file"]),
        ("plan --vram 8 --model Qwen/Qwen2.5-7B --recipe 40gb", ["does not fit"]),
    ],
)
def test_the_real_console_shows_one_line(argv, words, world):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "lowmem_ft", *argv.format(**world).split()],
        capture_output=True, text=True, env=env, cwd=world["tmp"], timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    for word in words:
        assert word in lines[0]


def test_a_plan_that_does_not_fit_still_prints_its_table(capsys):
    """`plan --recipe R` over the budget exits 2, and stdout still shows where the memory goes."""
    assert main(["plan", "--vram", "8", "--model", "Qwen/Qwen2.5-7B", "--recipe", "40gb"]) == 2
    out, err = capsys.readouterr()
    assert "DOES NOT FIT" in out and "predicted peak" in out
    assert "does not fit" in err


def _read_only_mount(path: Path, fill_from: str | None = None) -> None:
    """A real read-only filesystem: a tmpfs (filled with a copy of `fill_from`), remounted ro. The tests run as
    root here; where mount is refused, the test is skipped."""
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    if fill_from:
        shutil.copytree(fill_from, path / Path(fill_from).name)
    if subprocess.run(["mount", "-o", "remount,ro", str(path)], capture_output=True).returncode != 0:
        subprocess.run(["umount", str(path)], check=True)
        pytest.skip("cannot remount the tmpfs read-only here")


def test_merge_output_on_a_read_only_mount_is_refused_before_the_merge(world, tmp_path, capsys):
    mount = tmp_path / "ro"
    _read_only_mount(mount)
    try:
        code = main(["merge", world["run"], "--output", str(mount / "merged")])
        out, err = capsys.readouterr()
    finally:
        subprocess.run(["umount", str(mount)], check=True)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "cannot write there (Read-only file system" in lines[0]
    assert "merge plan" not in out  # refused before the merge, not after it


def test_training_into_a_read_only_output_dir_is_refused_before_any_work(world, tmp_path, capsys):
    mount = tmp_path / "ro"
    _read_only_mount(mount)
    argv = ["train", "--vram", "8", "--model", world["model"], "--data", world["data"], "--no-wandb",
            "--set", f"training.output_dir={mount}/runs"]  # fmt: skip
    try:
        code = main(argv)
        out, err = capsys.readouterr()
    finally:
        subprocess.run(["umount", str(mount)], check=True)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "training.output_dir" in lines[0] and "cannot write there (Read-only file system" in lines[0]


def test_report_of_a_read_only_run_directory_is_one_line(world, tmp_path, capsys):
    mount = tmp_path / "ro"
    _read_only_mount(mount, fill_from=world["run"])
    try:
        code = main(["report", str(mount / Path(world["run"]).name)])
        err = capsys.readouterr().err
    finally:
        subprocess.run(["umount", str(mount)], check=True)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "cannot write memory.png there (Read-only file system)" in lines[0]
