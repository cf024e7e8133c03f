"""Running lm-eval's `simple_evaluate` on a loaded model and reading its metrics.

The model is wrapped in lm-eval's own `HFLM` (an in-memory model, a peft adapter included), with the planned batch
size and `max_length`, so the scores are lm-eval's: the test checks them against `simple_evaluate` called directly.
"""

from __future__ import annotations

import math


def evaluate(model, tokenizer, manager, names: list[str | dict], *, batch_size: int, max_length: int, limit: int | None,
             device: str) -> dict[str, dict[str, float]]:  # fmt: skip
    """task → metric → value (lm-eval's `results`, without aliases, sample counts and NaN stderr)."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length, device=device)
    out = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager, limit=limit, log_samples=False)
    return metrics(out["results"])


def metrics(results: dict) -> dict[str, dict[str, float]]:
    table = {}
    for task, values in results.items():
        row = {}
        for key, value in values.items():
            if key in ("alias", "name", "sample_len", "sample_count") or not isinstance(value, (int, float)):
                continue
            if isinstance(value, float) and math.isnan(value):
                continue
            row[key.replace(",none", "")] = float(value)
        table[task] = row
    return table


def deltas(tuned: dict, base: dict) -> dict[str, dict[str, float]]:
    return {
        task: {m: v - base[task][m] for m, v in row.items() if m in base.get(task, {}) and not m.endswith("_stderr")}
        for task, row in tuned.items()
    }
