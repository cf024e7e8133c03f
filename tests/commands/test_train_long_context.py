"""`lowmem-ft train --vram N --data long.jsonl`: on long documents the planner turns the long-context savers on by
itself, and the run trains with them applied (issue #13), end to end on the tiny model."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from lowmem_ft.choosing import plan_setup
from lowmem_ft.cli import main
from lowmem_ft.errors import UserError
from lowmem_ft.longest_context import SAVER_SETS
from lowmem_ft.memory.arch import load_architecture
from lowmem_ft.memory.target import Target
from lowmem_ft.recipe.load import resolve

SAVERS = ("embeddings_on_host", "tiled_norms", "tiled_mlp", "recompute_lora")
SEQ = 4096  # the tiny model's positions: documents longer than that are planned at 4,096 tokens


def _documents(path, count: int = 6) -> str:
    """Plain-text documents of ~7k tokens each (the tiny tokenizer's corpus, rotated): longer than the model's
    positions, so the planner's length is 4,096 and longer text is cut (data.truncate keep_start)."""
    from devkit.tiny import corpus

    lines = corpus()
    with open(path, "w", encoding="utf-8") as f:
        for i in range(count):
            f.write(json.dumps({"text": " ".join(lines[i * 50 :] + lines[: i * 50])}) + "\n")
    return str(path)


def _least_vram(model: str, savers: str) -> float:
    """The smallest --vram (to 0.1 MB) at which the planner fits SEQ tokens of `model` from the 8 GB tier recipe,
    with the savers `SAVER_SETS[savers]` leaves it (the others fixed off)."""
    arch = load_architecture(model)
    recipe = resolve("8gb", {"model": {"name_or_path": model}})
    fixed = SAVER_SETS[savers] | {"max_seq_len"}
    recipe = replace(recipe, memory=replace(recipe.memory, max_seq_len=SEQ))
    lo, hi = recipe.memory.safety_margin_gb, 4.0
    while hi - lo > 1e-4:
        mid = (lo + hi) / 2
        try:
            plan_setup(arch, recipe, Target(mid, recipe.memory.safety_margin_gb), fixed)
            hi = mid
        except UserError:
            lo = mid
    return hi


@pytest.fixture(scope="module")
def long_run(tmp_path_factory, tiny_model):
    """Two optimizer steps of `train --vram V --data long.jsonl` with V between what the planner needs with every
    saver and without the long-context ones: it must turn some on by itself to plan the documents' length (here
    tiled norms, tiled MLP and LoRA recompute; host embeddings would save 65 KB of this model)."""
    import lowmem_ft.train.run as run_module

    out = tmp_path_factory.mktemp("long")
    data = _documents(out / "long.jsonl")
    every, before = _least_vram(tiny_model, "all"), _least_vram(tiny_model, "previous")
    assert every < before  # the savers buy something at this length, on this model
    vram = round(every + (before - every) / 10, 4)  # near the savers' limit: several of them are needed
    captured = {}

    def train(*args, **kwargs):
        captured["result"] = result = real(*args, **kwargs)
        return result

    real = run_module.train
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(run_module, "train", train)
        code = main(
            [
                "train", "--vram", str(vram), "--model", tiny_model, "--data", data, "--no-wandb", "--name", "long",
                "--set", f"training.output_dir={out}", "--set", "training.max_steps=2",
                "--set", "memory.gradient_accumulation=1", "--set", "training.logging_steps=1",
            ]
        )  # fmt: skip
    assert code == 0
    return captured["result"], vram, (every, before)


def test_the_planner_turns_tiling_on_by_itself_for_long_documents(long_run):
    result, vram, (every, before) = long_run
    run = result.run_dir
    plan = json.loads((run / "plan.json").read_text())
    choice = json.loads((run / "run.json").read_text())["choice"]
    assert plan["vram_gb"] == vram and plan["fits"] and plan["predicted_peak_gb"] <= plan["budget_gb"]
    setup, memory = plan["setup"], plan["recipe"]["memory"]
    assert setup["max_seq_len"] == memory["max_seq_len"] == SEQ
    assert setup["tiled_mlp"] and memory["tiled_mlp"]  # at least the tiled MLP
    assert memory["loss_chunk_tokens"] == (setup["loss_chunk_tokens"] or 0)  # the sized chunk is what trains
    on = [name for name in SAVERS if setup[name]]
    for name in SAVERS:
        assert memory[name] == setup[name]
        why = plan["reasons"][name]
        assert why == choice["reasons"][name]
        assert why.startswith("on: ") if name in on else why == "off: not needed", (name, why)
        if name in on:
            assert "without it this setup needs" in why
    assert "4096 tokens: the model's 4096 positions" in plan["reasons"]["max_seq_len"]
    recipe = resolve(run / "recipe.yaml")
    assert recipe.memory.tiled_mlp and recipe.memory.max_seq_len == SEQ


def test_the_run_trains_with_the_planned_savers_applied(long_run):
    """The trained model has what the plan turned on: tiled MLPs (and norms, LoRA recompute, host embeddings where
    planned) with the planned tile; training ran its steps with a finite loss."""
    import math

    result = long_run[0]
    run = result.run_dir
    setup = json.loads((run / "plan.json").read_text())["setup"]
    tile = setup["mlp_tile_tokens"] or 64  # hidden_size 64
    model = result.model
    mlps = [m for name, m in model.named_modules() if name.endswith(".mlp")]
    assert mlps and all(m._lowmem_tile_tokens == tile for m in mlps)
    norms = [m for _, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")]
    assert all(getattr(m, "_lowmem_tile_tokens", None) == (tile if setup["tiled_norms"] else None) for m in norms)
    embed = model.get_base_model().get_input_embeddings()
    assert getattr(embed, "_lowmem_on_host", False) == setup["embeddings_on_host"]
    lora = [m for name, m in model.named_modules() if name.endswith("self_attn.q_proj")]
    assert lora and all(getattr(m, "_lowmem_recompute", False) == setup["recompute_lora"] for m in lora)
    history = [json.loads(line) for line in (run / "log_history.jsonl").read_text().splitlines()]
    losses = [h["loss"] for h in history if "loss" in h]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
