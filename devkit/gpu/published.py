"""The GPU check's `published` step: PEFT's MetaMathQA step run on the GPU, beside what the harness predicts for it.

`devkit.bench.published` predicts PEFT's published reserved bytes without a GPU. It traces the publisher's step on
the CPU and replays it through a model of torch's caching allocator (`devkit.harness.peft_metamathqa`). On a lent
GPU this step runs the same loop for real: Llama-3.2-3B random-initialized on the GPU (memory does not depend on the
weights), the harness's own step (`peft_metamathqa.step`) over its batch sequence (`lead_sequence`: AdamW's state,
then a bucket's lead at each solved length after the previous bucket's median and shortest batches, with
`empty_cache` where run.py calls it). Each configuration runs once per allocator setting, in a fresh process:
PYTORCH_CUDA_ALLOC_CONF is read when CUDA starts. torch's default settings are PEFT's; expandable segments are what
`train` sets. Each run writes one record: `memory_reserved` and `memory_allocated` after every step, the peaks, the
libraries, and the harness's predictions from benchmarks/published.json for the default settings. The report then
sets the allocator model against the GPU on the publisher's own loop, and the GPU against PEFT's published L40S
figures.

On the CPU (`--cpu-smoke`) the same code runs a tiny Llama at short lengths; its readings are zero.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / "benchmarks" / "published.json"
SETTINGS = {"default": "expandable_segments:False", "expandable": "expandable_segments:True"}
LORA, FULL = "lora--llama-3.2-3B-rank32", "full-finetuning--llama-3.2-3B-lr_0.00001"
# (configuration, allocator setting) runs: right after the probe, LoRA r32 on q,v (the held-in row) under PEFT's
# setting, the one the harness predicts; at the end of the check, the rest: full fine-tuning, whose reserved figure
# the harness explains least (benchmarks/published.md), and both under expandable segments
FIRST = ((LORA, "default"),)
LAST = ((FULL, "default"), (LORA, "expandable"), (FULL, "expandable"))
SMOKE_CONFIG = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": True, "max_position_embeddings": 256,
}  # fmt: skip
SMOKE_LENGTHS = (64, 56)


def measure(name: str, setting: str, smoke: bool) -> dict[str, Any]:
    """Run the publisher's loop for `name` under the allocator `setting` (set by the caller in this process's
    environment before CUDA started): its record."""
    import peft
    import torch
    import transformers
    from transformers import LlamaConfig

    from devkit.harness import peft_metamathqa as pub

    device = "cuda" if torch.cuda.is_available() else "cpu"
    result, cache = pub.newest(name), json.loads(CACHE.read_text())
    lengths = SMOKE_LENGTHS if smoke else tuple(cache["lengths"])
    config = LlamaConfig(**SMOKE_CONFIG) if smoke else pub.config_at(28)
    seq, empty = pub.lead_sequence(result, lengths)
    if smoke:
        seq = [min(length, max(SMOKE_LENGTHS)) for length in seq]
    torch.manual_seed(0)
    model = pub.build(result, config, device=device)
    optimizer = pub.optimizer_for(model)
    model.train()
    cuda = torch.cuda if device == "cuda" else None
    if cuda:
        cuda.reset_peak_memory_stats()
    kept: list = [None, None]
    reserved, allocated = [], []
    for i, length in enumerate(seq):
        pub.step(model, optimizer, kept, length, seed=i, device=device)
        reserved.append(cuda.memory_reserved() if cuda else 0)  # where run.py reads it: before the empty_cache
        allocated.append(cuda.memory_allocated() if cuda else 0)
        if cuda and i in empty:
            cuda.empty_cache()
    row = cache["rows"][name]
    return {
        "kind": "published",
        "name": name,
        "label": result.label,
        "allocator": setting,
        "device": device,
        "libraries": f"{torch.__version__} / {transformers.__version__} / {peft.__version__}",
        "lengths": seq,
        "reserved": reserved,
        "allocated": allocated,
        "max_reserved": cuda.max_memory_reserved() if cuda else 0,
        "max_allocated": cuda.max_memory_allocated() if cuda else 0,
        # the harness's replay, for torch's default settings: reserved after each lead, allocated after the mean
        "predicted": {} if smoke or setting != "default" else {k: row[k] for k in ("first", "second", "allocated")},
        "published": {"max": result.max_reserved, "p99": result.reserved_p99, "gpu": "L40S"},
    }


def environment(setting: str) -> dict[str, str]:
    """The child's environment: the allocator setting it runs under."""
    return {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": SETTINGS[setting]}


# the steps of `lead_sequence` whose readings the harness predicts: after each lead, and the allocated bytes after
# the last step (a batch of the mean sample length)
LEADS = {"first": 2, "second": 5}


def section(records: list[dict[str, Any]]) -> list[str]:
    """The report's section: each run's readings after the two leads and its peak, against the harness's replay
    (torch's default settings) and PEFT's published figures."""
    runs = [r for r in records if r["kind"] == "published"]
    if not runs:
        return []
    gb = 1e9
    lines = [
        "## PEFT's MetaMathQA step on this GPU",
        "",
        "`devkit.gpu.published`: the publisher's loop over the harness's batch sequence (lengths in tokens), "
        "Llama-3.2-3B random-initialized. `after lead`: `memory_reserved` after each lead batch, where run.py reads "
        "it; `predicted`: the harness's CPU trace replayed through the allocator model (benchmarks/published.json, "
        "torch's default settings only); `published`: PEFT's max reserved on an L40S.",
        "",
        "| configuration | allocator | libraries | lengths | after lead 1 GB | predicted | gap | after lead 2 GB | "
        "predicted | gap | allocated after the last GB | predicted | max reserved GB | published max GB | gap |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in runs:
        p = r["predicted"]
        cells = []
        for key, i in (*LEADS.items(), ("allocated", len(r["reserved"]) - 1)):
            got = (r["allocated"] if key == "allocated" else r["reserved"])[i]
            want = p.get(key)
            cells.append(f"{got / gb:.2f} | {'—' if want is None else f'{want / gb:.2f}'}")
            if key != "allocated":
                cells[-1] += f" | {_gap(want, got)}"
        pub = r["published"]["max"]
        lines.append(
            f"| {r['label']} | {r['allocator']} | {r['libraries']} | {', '.join(map(str, r['lengths']))} | "
            f"{' | '.join(cells)} | {r['max_reserved'] / gb:.2f} | {pub / gb:.2f} | "
            f"{_gap(r['max_reserved'] or None, pub)} |"
        )
    return [*lines, ""]


def _gap(value: float | None, against: float) -> str:
    """(value − against) / against; "—" without both (a CPU smoke reads no CUDA bytes)."""
    return "—" if value is None or not against else f"{(value - against) / against:+.2%}"
