"""Data into training: every format trains end to end, the run directory accounts for the data, and packed
samples do not attend to each other."""

from __future__ import annotations

import json
import shutil

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


# ---- sources other than one JSONL file -------------------------------------------------------------------------

QA = [{"id": i, "question": f"What is {i} plus {i}?", "answer": f" {i} plus {i} is {2 * i}."} for i in range(6)]
QA_COLUMNS = "data.columns={prompt: question, completion: answer}"


def write_qa(tmp_path, kind: str) -> str:
    """The QA rows, with their own column names, as a Parquet / CSV file or a save_to_disk directory."""
    import pandas as pd

    df = pd.DataFrame(QA)
    path = tmp_path / {"parquet": "qa.parquet", "csv": "qa.csv", "saved": "qa_saved"}[kind]
    if kind == "parquet":
        df.to_parquet(path)
    elif kind == "csv":
        df.to_csv(path, index=False)
    else:
        from datasets import Dataset

        Dataset.from_pandas(df).save_to_disk(str(path))
    return str(path)


def run_recipe(tmp_path, tiny_model, *sets):
    """Train in-process from a recipe (the path `train` takes after its input checks)."""
    from lowmem_ft.recipe.load import resolve
    from lowmem_ft.train.run import train as run_train

    recipe = resolve("8gb", [*FAST, f"model.name_or_path={tiny_model}", *sets])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    result = run_train(recipe, run_dir)
    return json.loads((run_dir / "run.json").read_text()), result.metrics


def assert_qa_read_through_columns(data: dict, kind: str) -> None:
    (source,) = data["sources"]
    assert source["kind"] == kind and source["columns"] == {"prompt": "question", "completion": "answer"}
    assert source["format"] == data["format"] == "prompt_completion" and data["loss_on"] == "completion"
    assert source["records"] == data["profile"]["count"] == len(QA)
    assert source["unused_columns"] == ["id"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["parquet", "csv"])
def test_a_file_with_its_own_column_names_trains_through_the_cli(kind, tmp_path, tiny_model):
    run_dir, report = train(tmp_path, tiny_model, write_qa(tmp_path, kind), kind, QA_COLUMNS)
    assert_qa_read_through_columns(report, kind)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["global_step"] == 1 and metrics["first_loss"] > 0
    assert (run_dir / "adapter" / "adapter_config.json").is_file()


@pytest.mark.slow
def test_a_save_to_disk_directory_trains(tmp_path, tiny_model):
    run, metrics = run_recipe(tmp_path, tiny_model, f"data.path={write_qa(tmp_path, 'saved')}", QA_COLUMNS)
    assert_qa_read_through_columns(run["data"], "saved")
    assert metrics["global_step"] == 1 and metrics["first_loss"] > 0


@pytest.mark.slow
def test_a_directory_trains_through_the_cli(tmp_path, tiny_model):
    train(tmp_path, tiny_model, write_qa(tmp_path, "saved"), "saved", QA_COLUMNS)


@pytest.mark.slow
def test_a_mix_trains_and_run_json_records_what_each_source_gave(tmp_path, tiny_model):
    from lowmem_ft.data.mix import mix_counts

    mix = f"data.mix=[{{path: {write_qa(tmp_path, 'parquet')}, weight: 1, columns: {{prompt: question, completion: answer}}}}, {{path: {fixture('text.jsonl')}, weight: 1}}]"
    run, metrics = run_recipe(tmp_path, tiny_model, mix)
    data = run["data"]
    assert [s["kind"] for s in data["sources"]] == ["parquet", "jsonl"]
    assert data["format"] == "mixed: prompt_completion, text" and data["loss_on"] == "completion, all tokens"
    counts = [s["samples"] for s in data["mix"]["sources"]]
    assert counts == mix_counts([len(QA), 12], [1, 1], "undersample") == [6, 6]
    assert data["mix"]["seed"] == 42 and data["records"] == data["profile"]["count"] == sum(counts)
    assert metrics["global_step"] == 1


def prepare(tiny_model, *sets):
    from lowmem_ft.data.prepare import prepare_datasets
    from lowmem_ft.data.tokenize import load_tokenizer
    from lowmem_ft.recipe.load import resolve

    recipe = resolve("8gb", [*FAST, f"model.name_or_path={tiny_model}", *sets])
    return prepare_datasets(recipe, load_tokenizer(tiny_model))


def test_the_same_seed_gives_the_same_mix_and_another_seed_another(tmp_path, tiny_model):
    big = tmp_path / "big.jsonl"
    big.write_text("".join(json.dumps({"text": f"the cat {i}"}) + "\n" for i in range(40)))
    mix = f"data.mix=[{{path: {big}, weight: 1}}, {{path: {fixture('text.jsonl')}, weight: 1}}]"
    first, _, summary = prepare(tiny_model, mix)
    again, _, _ = prepare(tiny_model, mix)
    other, _, _ = prepare(tiny_model, mix, "training.seed=1")
    assert first["input_ids"] == again["input_ids"] and first["input_ids"] != other["input_ids"]
    assert [s["samples"] for s in summary["mix"]["sources"]] == [12, 12]
    assert summary["mix"]["sources"][0]["not_used"] == 28


def test_eval_split_of_a_directory(tmp_path, tiny_model):
    (tmp_path / "d").mkdir()
    shutil.copy(fixture("text.jsonl"), tmp_path / "d" / "train.jsonl")
    (tmp_path / "d" / "test.jsonl").write_text(json.dumps({"text": "the owl"}) + "\n")
    train_ds, eval_ds, summary = prepare(tiny_model, f"data.path={tmp_path / 'd'}", "data.eval_split=test")
    assert len(train_ds) == 12 and len(eval_ds) == 1
    assert summary["eval_source"] == f"{tmp_path / 'd'} [test]" and summary["eval_records"] == 1


def test_held_out_rows_are_counted_once(tiny_model):
    """The budget counts the rows of each split, not the table a held-out split is a view of."""
    train_ds, eval_ds, summary = prepare(tiny_model, f"data.path={fixture('text.jsonl')}", "data.eval_fraction=0.25")
    assert summary["budget"]["tokens_in"] + summary["eval_budget"]["tokens_in"] == summary["profile"]["total_tokens"]
    assert summary["budget"]["tokens_in"] == sum(len(x) for x in train_ds["input_ids"])


@pytest.mark.slow
def test_a_stream_trains_for_max_steps_and_says_its_profile_is_of_the_first_samples(tmp_path, tiny_model, monkeypatch):
    import lowmem_ft.data.tokenize as tk

    monkeypatch.setattr(tk, "STREAM_HEAD", 5)
    sets = [f"data.path={write_qa(tmp_path, 'csv')}", QA_COLUMNS, "data.streaming=true", "training.max_steps=3"]
    run, metrics = run_recipe(tmp_path, tiny_model, *sets)
    data = run["data"]
    assert data["streaming"] == {"profile_and_budget_from": 5, "shuffle_buffer": 1000}
    assert data["profile"]["sampled"] == data["profile"]["count"] == 5
    assert data["budget"]["counted_on"] == "the first 5 samples of the stream" and data["records"] is None
    assert data["sources"][0]["streaming"] is True and data["sources"][0]["unused_columns"] == ["id"]
    assert metrics["global_step"] == 3  # 3 batches of 2 rows: the stream was read past its 5-row head


def test_conversational_preference_data_mapped_onto_its_chosen_answers_prepares(tmp_path, tiny_model):
    """trl-lib/ultrafeedback_binarized's shape (prompt, chosen and rejected as lists of turns, scores), as Parquet:
    refused as preference data, then read through data.columns={completion: chosen} as TRL's conversational
    prompt/completion, with the loss on the chosen answer only and the columns not read reported."""
    import pandas as pd

    from lowmem_ft.errors import UserError

    def turns(role, text):
        return [{"role": role, "content": text}]

    rows = [
        {
            "prompt": turns("user", f"What is {i} plus 1?"),
            "chosen": turns("assistant", f"{i + 1}."),
            "rejected": turns("assistant", f"{i + 2}."),
            "score_chosen": 9.0,
            "score_rejected": 2.0,
        }
        for i in range(4)
    ]
    path = tmp_path / "train.parquet"
    pd.DataFrame(rows).to_parquet(path)
    with pytest.raises(UserError, match=r"row 0: this is preference data.*data\.columns=\{completion: chosen\}$"):
        prepare(tiny_model, f"data.path={path}")
    train_ds, _, summary = prepare(tiny_model, f"data.path={path}", "data.columns={completion: chosen}")
    (source,) = summary["sources"]
    assert source["format"] == "chat_prompt_completion" and summary["loss_on"] == "completion turns"
    assert source["unused_columns"] == ["rejected", "score_chosen", "score_rejected"]
    from lowmem_ft.data.tokenize import load_tokenizer

    tokenizer = load_tokenizer(tiny_model)
    learned = [tokenizer.decode([t for t in row["labels"] if t != -100]) for row in train_ds]
    assert sorted(learned) == sorted(f"{i + 1}.<|im_end|>" for i in range(4))
