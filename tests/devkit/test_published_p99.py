"""devkit/bench/published_p99.py: which reading PEFT's 99th percentile is, which batch makes it, and the committed
solve of the every-step generations' p99 length (no trace)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from devkit.bench import published_p99 as p99
from devkit.harness import peft_metamathqa as pub

CACHE = Path(__file__).resolve().parents[2] / "benchmarks" / "published.json"


def test_the_p99_of_5000_readings_is_mostly_the_51st_largest():
    """np.percentile's linear interpolation: position (5000 − 1) × 0.99 = 4949.01 in the ascending order, so
    0.99 × the 51st largest + 0.01 × the 50th (counted by hand)."""
    (r1, w1), (r2, w2) = p99.p99_ranks()
    assert (r1, r2) == (51, 50)
    assert w1 == pytest.approx(0.99) and w2 == pytest.approx(0.01)


@pytest.mark.parametrize("n", [5000, 101, 7])
def test_the_ranks_and_weights_give_numpys_percentile(n):
    readings = np.random.default_rng(n).random(n) * 1e10
    ranked = sorted(readings, reverse=True)
    (r1, w1), (r2, w2) = p99.p99_ranks(n)
    assert w1 * ranked[r1 - 1] + w2 * ranked[r2 - 1] == pytest.approx(np.percentile(readings, 99), rel=1e-12)


def test_batches_are_cut_as_the_bucket_iterator_cuts_them():
    """Buckets of rows × bucket samples, each sorted longest first, a batch padded to its first (longest) row."""
    samples = [3, 9, 1, 5, 2, 8, 7, 4, 6]
    assert p99.batch_lengths(samples, rows=2, bucket=2) == [9, 3, 8, 4, 6]


def test_the_p99_step_is_the_51st_largest_reading_and_says_when_it_is_not_a_lead():
    readings = [float(i % 97) for i in range(5000)]  # ties: the earliest step of the 51st largest
    rank = sorted(range(5000), key=lambda i: (-readings[i], i))
    assert p99.p99_step(readings) == rank[50]
    # every long sample in the first 30 buckets' first 8 rows: their second batches outrank the other leads
    samples = [1000 - j if b < 30 and j < 8 else 10 + j for b in range(250) for j in range(80)]
    step = p99.p99_step(p99.batch_lengths(samples))
    assert step % p99.BUCKET == 1
    assert p99.lead_share(trials=50) == 1.0  # in an order independent of the length: a lead


def test_the_committed_every_step_p99_solve_needs_no_new_trace_and_predicts_every_every_step_row():
    """The length is solved on the held-in row alone (the traced length closest to its published p99, within the
    tolerance), and every other every-step row has a prediction at that length, traced on its own generation."""
    cache = json.loads(CACHE.read_text())
    section = cache[p99.KEY]
    held = p99.held_in()
    assert section["held_in"] == f"{held.name}@{held.date}" and held.empty_cache_every == 1
    assert p99.solve(copy.deepcopy(cache)) == section["length"]
    kept = p99.predicted(held, cache)
    assert abs(kept - held.reserved_p99) / held.reserved_p99 <= p99.SOLVE_TOLERANCE
    for result in pub.published():
        key = f"{result.name}@{result.date}"
        if result.empty_cache_every != 1 or key == section["held_in"]:
            continue
        row = section["rows"][key]
        assert row["length"] == section["length"], key
        assert row["traced_with"].split(" / ")[1] == result.transformers, key
        assert p99.p99_cells(result, cache).startswith(f"{row['reserved'] / p99.GB:.2f} |")
        assert row["second"]["length"] == section["second_length"], key  # the alternative, held out the same way
    assert p99.solve(copy.deepcopy(cache), second=True) == section["second_length"]


def test_a_generation_run_refuses_the_wrong_libraries_in_one_line(capsys):
    """`--date` traces a generation only on its own transformers (lowmem-ft's environment has today's), and names
    the every-step dates when given another; no traceback, exit code 2."""
    assert p99.main(["--date", "2025-07-22"]) == 2
    assert capsys.readouterr().out.count("\n") == 1
    assert p99.main(["--date", "2026-07-20"]) == 2  # an every-10 generation: nothing to trace here
    assert "2025-07-22, 2025-10-27" in capsys.readouterr().out
