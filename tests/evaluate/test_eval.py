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
