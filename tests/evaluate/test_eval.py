"""`lowmem-ft eval` on a finished LoRA run with a local task file: lm-eval's own scores, the base's, the deltas,
eval.json; the batch size planned from the memory model; unknown tasks in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowmem_ft.cli import main


@pytest.fixture
def task_file(tmp_path) -> Path:
    """A multiple-choice task over a local JSONL file, offline (lm-eval's `dataset_path: json`)."""
    rows = [{"question": f"What is {a} plus {b}?", "choices": [str(a + b), str(a + b + 1), str(a * b + 3)],
             "answer": (a + b) % 3} for a in range(1, 6) for b in range(1, 4)]  # fmt: skip
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = tmp_path / "tiny_qa.yaml"
    task.write_text(
        "task: tiny_qa\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "Question: {{question}}\\nAnswer:"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    return task


def _own_scores(model, tokenizer, task: Path, batch: int) -> dict:
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch, max_length=48, device="cpu")
    out = lm_eval.simple_evaluate(
        model=lm, tasks=["tiny_qa"], task_manager=TaskManager(include_path=str(task.parent), include_defaults=False),
        limit=8,
    )  # fmt: skip
    return out["results"]["tiny_qa"]


def test_scores_equal_lm_evals_own_and_compare_base(finished_run, task_file, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run, run, ignore=shutil.ignore_patterns("checkpoints"))
    assert main(["eval", str(run), "--tasks", str(task_file), "--limit", "8", "--compare-base", "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "fine-tuned" in printed and "delta" in printed
    record = json.loads((run / "eval.json").read_text())
    assert record["tasks"] == ["tiny_qa"] and record["batch_size"] == 1  # CPU without --vram
    tuned, base = record["finetuned"]["tiny_qa"], record["base"]["tiny_qa"]
    assert record["delta"]["tiny_qa"]["acc"] == pytest.approx(tuned["acc"] - base["acc"])
    from lowmem_ft.hub import model_card
    from lowmem_ft.rundir import RunDir

    card = str(model_card(RunDir(run)))  # what --push-to-hub uploads
    assert f"| tiny_qa | acc | {tuned['acc']:.4f} | {base['acc']:.4f} | {tuned['acc'] - base['acc']:+.4f} |" in card

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lowmem_ft.finetuned import open_run

    opened = open_run(run)
    plain = AutoModelForCausalLM.from_pretrained(opened.base).eval()
    tokenizer = AutoTokenizer.from_pretrained(opened.weights_dir)
    own_base = _own_scores(plain, tokenizer, task_file, 1)
    own_tuned = _own_scores(PeftModel.from_pretrained(plain, str(opened.weights_dir)).eval(), tokenizer, task_file, 1)
    for ours, theirs in ((tuned, own_tuned), (base, own_base)):
        assert ours["acc"] == pytest.approx(theirs["acc,none"]) and ours["acc_norm"] == pytest.approx(
            theirs["acc_norm,none"]
        )


def test_batch_is_planned_from_the_memory_model():
    from lowmem_ft.evaluate.batch import per_sequence_bytes, plan_batch
    from lowmem_ft.memory.arch import Architecture

    arch = Architecture.from_config({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                                     "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                                     "vocab_size": 128256, "max_position_embeddings": 8192})  # fmt: skip
    per = per_sequence_bytes(arch, 2048, 2)
    # the logits and their log-softmax dominate at a 128k vocabulary: 2 × 2048 × 128256 × 2 bytes ≈ 1.05 GB
    assert 2 * 2048 * 128256 * 2 < per < 2 * 2048 * 128256 * 2 + 0.6e9
    plan = plan_batch(arch, budget=24_000_000_000, weights=16_000_000_000, reserve=1_500_000_000, max_length=2048,
                      bytes_per_value=2)  # fmt: skip
    assert plan.batch_size == int(6.5e9 // per)
    assert plan_batch(arch, budget=16e9, weights=16e9, reserve=1e9, max_length=2048, bytes_per_value=2).batch_size == 0


def test_unknown_task_is_one_line_with_the_closest(finished_run, task_file, capsys, monkeypatch):
    import lowmem_ft.evaluate.tasks as tasks

    resolve = tasks.resolve
    # lm-eval's own ~14,000 tasks take ~45 s to index: look among the local directory's only
    monkeypatch.setattr(
        tasks, "resolve", lambda spec, include=None, include_defaults=True: resolve(spec, include, False)
    )
    assert main(["eval", finished_run, "--tasks", "tiny_qz", "--include-path", str(task_file.parent)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("lowmem-ft eval: error: --tasks: unknown task 'tiny_qz'; closest: tiny_qa")


def test_task_file_data_files_are_read_against_its_own_directory(task_file, tmp_path):
    """A relative `data_files` in a task file means the file's directory, not the working directory."""
    import yaml

    from lowmem_ft.evaluate.tasks import resolve, task_name

    folder = tmp_path / "tasks"
    folder.mkdir()
    (folder / "data").mkdir()
    (task_file.parent / "qa.jsonl").rename(folder / "data" / "qa.jsonl")
    spec = yaml.safe_load(task_file.read_text())
    spec["dataset_kwargs"]["data_files"] = {"test": "data/qa.jsonl"}
    (folder / "tiny_qa.yaml").write_text(yaml.safe_dump(spec))
    _, specs = resolve(str(folder / "tiny_qa.yaml"), include_defaults=False)
    assert task_name(specs[0]) == "tiny_qa"
    assert specs[0]["dataset_kwargs"]["data_files"] == {"test": str(folder / "data" / "qa.jsonl")}
    assert specs[0]["doc_to_text"] == spec["doc_to_text"]  # the rest of the file as lm-eval loads it


@pytest.mark.slow
def test_scores_reach_the_runs_trackers_with_a_relative_task_file(finished_run, task_file, tmp_path, monkeypatch,
                                                                  capsys):  # fmt: skip
    """eval on a run whose recipe logs to TensorBoard and offline W&B, from another working directory, with the
    task file's data path relative to the task file: the scores in eval.json are in both trackers."""
    import shutil

    import yaml

    run = tmp_path / "run"
    shutil.copytree(finished_run, run, ignore=shutil.ignore_patterns("checkpoints"))
    recipe = yaml.safe_load((run / "recipe.yaml").read_text())
    recipe["logging"] |= {"report_to": ["tensorboard", "wandb"], "wandb_mode": "offline"}
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    spec = yaml.safe_load(task_file.read_text())
    spec["dataset_kwargs"]["data_files"] = {"test": "qa.jsonl"}  # beside the task file
    task_file.write_text(yaml.safe_dump(spec))
    (run / "wandb" / "offline-run-20260101_000000-trained1").mkdir(parents=True)  # as the training run left it
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert main(["eval", str(run), "--tasks", str(task_file), "--limit", "4", "--device", "cpu"]) == 0
    assert "scores sent to the run's trackers: tensorboard, wandb" in capsys.readouterr().out
    acc = json.loads((run / "eval.json").read_text())["finetuned"]["tiny_qa"]["acc"]

    (events,) = (run / "tensorboard").glob("events.*")
    from tensorboardX.proto.event_pb2 import Event

    def scalars(path):
        import struct

        data, out = path.read_bytes(), {}
        while data:
            (length,) = struct.unpack("<Q", data[:8])
            event = Event.FromString(data[12 : 12 + length])
            data = data[12 + length + 4 :]
            out |= {v.tag: v.simple_value for v in event.summary.value}
        return out

    assert scalars(events)["eval/tiny_qa/acc"] == pytest.approx(acc)
    # W&B resumed the training run's own run (its id from its folder) and logged the score into it: the offline
    # run file holds the key and the value's JSON side by side (a summary / history item record)
    import wandb

    wandb.teardown()  # W&B's service writes the offline run file through to disk when it stops (at exit otherwise)
    (record,) = (run / "wandb").glob("offline-run-*-trained1/run-trained1.wandb")
    data = record.read_bytes()
    at = data.find(b"eval/tiny_qa/acc")
    assert at >= 0 and json.dumps(acc).encode() in data[at : at + 32]
