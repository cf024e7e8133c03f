"""The published-runs harness (`devkit.bench.published`): its data file names where every number comes from, its
replay empties the cache where the publisher's loop does, its batches are padded as the publisher pads them, and
its trace of the publisher's step on shape-only tensors holds the bytes a real run of the same step holds."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from devkit.bench import published
from devkit.harness import peft_metamathqa as pub

MiB = 1 << 20


def test_every_published_row_names_its_commit_and_the_loop_it_ran():
    data = json.loads(pub.DATA.read_text())
    assert data["source"]["repository"] == "huggingface/peft"
    rows = pub.published()
    assert {r.name for r in rows} >= {pub.HELD_IN, "full-finetuning--llama-3.2-3B-lr_0.00001"}
    for r in rows:
        assert re.fullmatch(r"[0-9a-f]{40}", r.commit), r.name
        assert r.reserved_p99 < r.max_reserved and r.allocated_avg < r.reserved_p99
        # run.py emptied the cache after every step until PEFT's commit 90d3fc05d (2025-11-13), every 10 after
        assert r.empty_cache_every == (1 if r.date < "2025-11-13" else 10), r.name
        assert (r.method == "full") == (r.r is None)
    held = pub.held_in()  # the one row the batch lengths are solved from: the newest generation
    assert held.empty_cache_every == pub.EMPTY_CACHE_EVERY
    assert all(r.date <= held.date for r in rows if r.name == pub.HELD_IN)


def test_replay_reads_reserved_after_each_step_and_empties_the_cache_where_the_log_says():
    log = [
        ("+", "a", 12 * MiB),  # ≥ 10 MiB: its own 12 MiB segment
        ("+", "b", 4 * MiB),  # < 10 MiB: a 20 MiB segment, split
        ("-", "a", 12 * MiB),  # cached: still reserved
        ("mark", "step 0", 0),
        ("empty_cache", 0, 0),  # a's whole segment goes back; b's segment holds a live block and stays
        ("mark", "step 1", 0),
    ]
    out = pub.replay(log)
    assert out["step 0"] == (32 * MiB, 4 * MiB, 16 * MiB)  # reserved, allocated, the window's requested peak
    assert out["step 1"] == (20 * MiB, 4 * MiB, 4 * MiB)


def test_each_generation_empties_the_cache_as_its_loop_did():
    """run.py emptied the cache after every step before PEFT's 90d3fc05d, every 10 since: in the traced sequence
    (state step, short, lead, median, short, lead, median) the every-10 loop empties before each lead and after
    the short batch that follows the median; the every-step one after each step."""
    assert pub.emptied_after(pub.EMPTY_CACHE_EVERY) == {1, 2, 4}
    assert pub.emptied_after(1) == set(range(7))


def test_a_generation_trace_names_the_libraries_it_ran_on_and_its_loop():
    """A row traced with `--generation` ran on that generation's transformers and peft (torch is today's: no older
    CPU torch installs here) and with its loop's schedule, three times, AdamW's state made on a step of the mean
    sample length and of each solved lead length."""
    from pathlib import Path

    cache = json.loads((Path(__file__).resolve().parents[2] / "benchmarks" / "published.json").read_text())
    rows = {f"{r.name}@{r.date}": r for r in pub.published()}
    assert cache["generations"]
    for key, gen in cache["generations"].items():
        result = rows[key]
        torch_version, transformers_version, peft_version = gen["traced_with"].split(" / ")
        assert transformers_version == result.transformers, key
        assert peft_version.split(".")[:2] == result.peft.split(".")[:2], key
        assert gen["every"] == result.empty_cache_every, key
        assert set(gen["by_state"]) == {str(result.mean_row), *map(str, cache["lengths"])}, key


def test_batches_are_padded_on_the_right_and_keep_the_first_pad_label():
    ids, mask, labels = pub.batch(vocab=100, length=10, seed=0)
    assert ids.shape == (pub.ROWS, 10)
    for i in range(pub.ROWS):
        ends = 10 - i  # row i has 10 − i tokens (a sorted bucket), then padding
        assert mask[i].tolist() == [1] * ends + [0] * i
        # run.py: labels[i, num_tokens + 1:] = -100 — the first pad (its EOS) is still a target
        assert (labels[i, : min(ends + 1, 10)] == ids[i, : min(ends + 1, 10)]).all()
        assert (labels[i, ends + 1 :] == -100).all()


def test_solving_a_length_interpolates_between_the_traced_lengths_that_bracket_it():
    points = [(512, 18_000), (640, 21_000), (600, 20_000)]
    assert pub.interpolate(points, 20_500) == 620  # between 600 and 640
    assert pub.interpolate(points, 19_000) == 556  # between 512 and 600
    assert pub.interpolate(points, 22_000) == 680  # above every point: the last two (600, 640), 25 per token


def _tiny_llama():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, max_position_embeddings=256,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lora", "dora", "full"])
def test_the_traced_publisher_step_holds_the_bytes_of_a_real_run(method):
    """Shape-only trace against a real CPU run of the same loop on a tiny Llama: after every step the same
    requested, allocated and reserved bytes, so what the harness extrapolates is the real step's."""
    result = replace(pub.held_in(), method=method, r=None if method == "full" else 8, lora_alpha=16)
    lengths, empty = [40, 12, 64, 40, 12, 56, 30], {1, 2, 4}
    traced = pub.replay(pub.run_log(result, _tiny_llama(), lengths, empty))
    real = pub.replay(pub.run_log(result, _tiny_llama(), lengths, empty, fake=False))
    assert traced == real
    assert traced["step 2"][2] > traced["step 1"][2]  # the lead batch's live peak is the step's largest


def test_the_committed_table_is_what_its_cache_renders():
    """benchmarks/published.md is `--rewrite` of benchmarks/published.json: a change to the memory model (its
    column) or to the harness shows here until the table is re-rendered."""
    from pathlib import Path

    table = Path(__file__).resolve().parents[2] / "benchmarks" / "published.md"
    cache = json.loads(table.with_suffix(".json").read_text())
    assert published.render(cache) == table.read_text()
    assert cache["lengths"] == list(pub.solve_lengths(pub.held_in(), cache))  # the solve needs no new trace


def test_plan_with_the_models_own_loss_prices_the_publishers_step():
    """`lowmem-ft plan` at PEFT's settings with `memory.full_logits_loss` keeps every knob (the loss included) and
    predicts what the memory model's full-logits path gives the publisher's step (the table's two columns), for an
    adapter row and full fine-tuning (accumulation 1: its gradients do not exist at the loss's backward)."""
    from lowmem_ft.choosing import choose_recipe, setup_from_recipe

    for result in (pub.held_in(), next(r for r in pub.published() if r.method == "full")):
        recipe, choice = choose_recipe(vram_gb=48.0, recipe=None, overrides=pub.plan_overrides(result), seq_len=704)
        assert recipe.memory.full_logits_loss and not recipe.memory.chunked_loss
        assert setup_from_recipe(recipe).loss_impl == "hf_full"
        assert "memory.full_logits_loss" in choice.plan.reasons["chunked_loss"]
        assert pub.plan_reserved(result, 704) == pytest.approx(pub.model_reserved(result, 704), abs=1e6)
