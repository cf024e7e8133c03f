"""Data into training: every format trains end to end, the run directory accounts for the data, and packed
samples do not attend to each other."""

from __future__ import annotations

import json

import pytest
import torch

from lowmem_ft.data.prepare import packing_support
from tests.data.conftest import FORMAT_FILES, fixture

FAST = [
    "model.quantization=none",
    "model.compute_dtype=float32",
    "optimizer.name=adamw_torch",
    "memory.gradient_accumulation=1",
    "memory.micro_batch_size=2",
    "memory.max_seq_len=48",
    "training.max_steps=1",
    "logging.wandb_mode=disabled",
]


def train(tmp_path, tiny_model, data, name, *sets):
    from lowmem_ft.cli import main

    argv = ["train", "--vram", "8", "--model", tiny_model, "--data", data, "--name", name]
    for item in [*FAST, f"training.output_dir={tmp_path / 'runs'}", *sets]:
        argv += ["--set", item]
    assert main(argv) == 0
    run_dir = tmp_path / "runs" / name
    return run_dir, json.loads((run_dir / "data_report.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("fmt", sorted(FORMAT_FILES))
def test_each_format_trains_end_to_end(fmt, tmp_path, tiny_model):
    run_dir, report = train(tmp_path, tiny_model, fixture(FORMAT_FILES[fmt]), fmt)
    assert report["format"] == fmt
    assert report["budget"]["samples_in"] == report["profile"]["count"] > 0
    run = json.loads((run_dir / "run.json").read_text())
    assert run["data"]["budget"] == report["budget"] and run["data"]["batching"]["batches"] == "length-grouped"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["global_step"] == 1 and metrics["first_loss"] > 0
    assert (run_dir / "adapter" / "adapter_config.json").is_file()


class RecordInputs:
    """A callback that records what the model's forward receives during training."""

    def __init__(self):
        self.calls: list[dict] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        base.register_forward_pre_hook(lambda mod, a, kw: self.calls.append(dict(kw)), with_kwargs=True)


@pytest.mark.slow
def test_chunked_documents_train_packed_and_the_report_counts_them(tmp_path, tiny_model):
    from transformers import TrainerCallback

    from lowmem_ft.recipe.load import resolve
    from lowmem_ft.train.run import train as run_train

    sets = [*FAST, "data.truncate=chunk", "data.overlap=8", "memory.max_seq_len=24", "data.packing=true"]
    sets += [f"model.name_or_path={tiny_model}", f"data.path={fixture('text.jsonl')}"]
    recipe = resolve("8gb", sets)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    recorder = type("Recorder", (RecordInputs, TrainerCallback), {})()
    run_train(recipe, run_dir, callbacks=[recorder])
    report = json.loads((run_dir / "data_report.json").read_text())
    budget = report["budget"]
    assert budget["chunked"] > 0 and budget["chunks_out"] > budget["chunked"]
    assert budget["tokens_lost"] == 0 and budget["samples_out"] == budget["kept_whole"] + budget["chunks_out"]
    assert report["batching"]["packing"] is True
    # What the model saw: one flat row of several samples, positions restarting at each, no mask, no cache.
    seen = recorder.calls[0]
    positions = seen["position_ids"][0].tolist()
    assert "attention_mask" not in seen or seen["attention_mask"] is None
    assert seen["use_cache"] is False
    assert positions.count(0) >= 2 and len(positions) <= 24 * 2


def _logits(model, **inputs):
    # use_cache=False as in training (TRL's SFTTrainer.compute_loss sets it): with a cache, transformers'
    # masking_utils skips the packed-sequence detection and the samples WOULD see each other.
    with torch.no_grad():
        return model(**inputs, use_cache=False).logits[0]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_samples_do_not_attend_to_each_other(attn, tiny_model):
    """Each sample's logits inside a packed, padding-free batch equal its logits alone."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl.data_utils import pack_dataset
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    model = AutoModelForCausalLM.from_pretrained(tiny_model, attn_implementation=attn, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    samples = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (7, 5, 11, 3)]
    packed = pack_dataset(Dataset.from_dict({"input_ids": samples, "labels": samples}), 16, "bfd")
    collate = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    seen = 0
    for row in packed:
        batch = collate([row])
        assert "attention_mask" not in batch
        positions = batch["position_ids"][0].tolist()
        logits = _logits(model, input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        start = 0
        for length in row["seq_lengths"]:
            assert positions[start : start + length] == list(range(length))  # position ids reset per sample
            ids = row["input_ids"][start : start + length]
            alone = _logits(model, input_ids=torch.tensor([ids]))
            torch.testing.assert_close(logits[start : start + length], alone, atol=1e-5, rtol=1e-4)
            if start:  # the control: with positions running on, the later sample would see the earlier one
                leaky = _logits(model, input_ids=batch["input_ids"])[start : start + length]
                assert not torch.allclose(leaky, alone, atol=1e-3)
            start += length
            seen += 1
    assert seen == len(samples) and len(packed) < len(samples)


def test_packing_falls_back_where_unsupported():
    assert packing_support("sdpa", "transformers.models.qwen2.modeling_qwen2")[0]
    assert packing_support("flash_attention_2")[0]
    ok, why = packing_support("paged|sdpa")
    assert not ok and "paged|sdpa" in why
    ok, why = packing_support("sdpa", "transformers_modules.someone.modeling_custom")
    assert not ok and "own code" in why
