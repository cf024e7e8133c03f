"""How the publisher's reserved figure after a bucket's lead batch moves with the lead's length: LoRA against full
fine-tuning, traced whole.

    nice -n 10 python -m devkit.bench.published_leads --out benchmarks/published_leads.md   # ~5 min, one core
    python -m devkit.bench.published_leads --explain full-finetuning--llama-3.2-3B-lr_0.00001  # the blocks

`devkit.bench.published` predicts the 99th percentile of PEFT's `memory_reserved` readings from ONE lead length
(599 tokens), solved on the LoRA r32 row, where the reserved figure rises with the length. A percentile over 5,000
readings is a statement about many bucket leads, so one length stands for them only if the figure is smooth in
the length. This traces, for one row at a time, a run of bucket leads at several lengths, each as the harness's
sequence has it (the previous bucket's median and shortest batch, an `empty_cache`, the lead, an `empty_cache`), in
one trace, and replays it: the reserved bytes after each lead. AdamW's state is made on the first step, of the
mean sample length, as in the harness's table. These are predictions (a trace and a model of the allocator).
`--explain` says what the reserved figure after each of the harness's two leads is made of.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from devkit.harness import peft_metamathqa as pub

LEADS = (300, 400, 450, 500, 550, 575, 599, 625, 650, 704)
FULL = "full-finetuning--llama-3.2-3B-lr_0.00001"
ROWS = (pub.HELD_IN, FULL)
COLUMNS = (*ROWS, f"{FULL} descending")  # full fine-tuning again, its leads run from the longest down
GB = 1e9
MiB = 1 << 20


def lead_scan(result: pub.Published, leads=LEADS, layers: int = 28) -> dict[int, int]:
    """Lead length → reserved bytes after that lead, every lead run as the harness's every-10 sequence runs its
    first (median, SHORT, `empty_cache`, lead, `empty_cache`), one after the other in one trace, in `leads`'
    order (what earlier steps leave in the segments that survive an `empty_cache` differs with it)."""
    seq, empty, at = [], set(), {}
    for lead in leads:
        seq += [result.mean_row, pub.SHORT, lead]
        empty |= {len(seq) - 2, len(seq) - 1}
        at[lead] = f"step {len(seq) - 1}"
    out = pub.replay(pub.run_log(result, pub.config_at(layers), seq, empty_after=empty))
    return {lead: out[mark][0] for lead, mark in at.items()}


def explain(result: pub.Published, lengths: tuple[int, int], lead: int) -> str:
    """What the reserved figure after lead `lead` (0: the first, 1: the second) of the harness's sequence is made
    of, traced whole with the row's loop: at the step's reserved peak, the request that opened it, the cached free
    blocks grouped by the request that last held them and the one their segment was made for, and how much of them
    lies in segments the previous step's gradients held through the `empty_cache` (`zero_grad` frees them at the
    next step's start, as in run.py)."""
    from collections import Counter

    from devkit.harness.allocator_tenants import Tenants
    from lowmem_ft.train.measure.allocator import Allocator

    seq = [result.mean_row, pub.SHORT, lengths[0], result.mean_row, pub.SHORT, lengths[1], result.mean_row]
    target = (2, 5)[lead]
    log = pub.run_log(result, pub.config_at(28), seq, empty_after=pub.emptied_after(result.empty_cache_every))
    replay, held = Tenants(Allocator()), set()
    step, zero_grad, peak = 0, False, None
    for kind, key, nbytes in log:
        if kind == "+" and nbytes:
            zero_grad = zero_grad and nbytes <= MiB  # the batch's small tensors come first; then the forward
            replay.malloc(key, nbytes, made=(nbytes, step))
            now = replay.alloc.current
            if step == target and (peak is None or now.reserved > peak[0]):
                peak = (now.reserved, now.requested, nbytes, replay.free_blocks())
        elif kind == "-":
            block = replay.free(key)
            if block is not None and zero_grad and step == target:
                held.add(replay.segment(block.addr))
        elif kind == "empty_cache":
            replay.alloc.empty_cache()
        elif kind == "mark":
            step, zero_grad = step + 1, True
    reserved, requested, trigger, free = peak
    groups: Counter = Counter()
    for f in free:
        groups[(f.last, *f.made)] += f.size
    lines = [
        f"{result.label} ({result.date}), the {seq[target]}-token lead: reserved peak {reserved / GB:.2f} GB, live "
        f"{requested / GB:.2f} GB, opened by a {trigger / MiB:.1f} MiB request; cached free "
        f"{sum(f.size for f in free) / GB:.2f} GB in {len(free)} blocks, "
        f"{sum(f.size for f in free if f.segment in held) / GB:.2f} GB of it in segments the previous step's gradients "
        "held through the empty_cache. The largest groups:"
    ]
    for (last, seg, at), size in groups.most_common(8):
        lines.append(f"  {size / GB:.3f} GB last held by {last / MiB:.1f} MiB, in segments made for {seg / MiB:.1f} "
                     f"MiB at step {at}")  # fmt: skip
    return "\n".join(lines)


def render(cache: dict) -> str:
    lines = [
        "# The reserved figure after a bucket's lead, by the lead's length\n\n"
        "Written by `python -m devkit.bench.published_leads --out benchmarks/published_leads.md` (cached in "
        "`benchmarks/published_leads.json`). PEFT's MetaMathQA step (Llama-3.2-3B, bf16, 4 rows) traced whole on "
        f"the CPU ({cache['libraries']}) and replayed through the model of torch's caching allocator: the reserved "
        "bytes after a bucket's lead of each length, run from an emptied cache after the previous bucket's median "
        "and shortest batches, as `devkit.bench.published` runs its leads. Predictions, not measurements.\n\n",
        "| lead tokens | " + " | ".join(f"{cache['rows'][n]['label']} GB" for n in COLUMNS) + " |\n",
        "|---|" + "---|" * len(COLUMNS) + "\n",
    ]
    for lead in LEADS:
        cells = " | ".join(f"{cache['rows'][n]['by_lead'][str(lead)] / GB:.2f}" for n in COLUMNS)
        lines.append(f"| {lead} | {cells} |\n")
    return "".join(lines) + NOTES


NOTES = """
The LoRA row's figure rises with the length (13.9 to 22.4 GB), in steps of a few hundred MB where the lead's
logits do or do not fit a cached block; at 599 and 704 tokens it is the held-in row traced whole in
`benchmarks/published.md`. Full fine-tuning's does not rise with it. It is set at the optimizer step, where
AdamW's temporaries (48 MiB per MLP weight) find the lead's blocks cached but too small. It falls from 500 to 550
tokens and jumps 1.3 to 2.5 GB between 575 and 599, by the order of the leads before. Run shortest first, the
cached free blocks at that moment grow from 3.4 GB at 575 tokens to 5.9 GB at 599: the lead's MLP activations
(35.9 and 37.4 MiB) take 17 and 36 segments of their own, beside the pieces of 48 MiB segments earlier steps
left. So the solved 599-token length, which sits on that step, cannot stand for the bucket leads a 99th
percentile counts: the full fine-tuning p99 in `benchmarks/published.md` is not a prediction of the same standing
as its max, which holds at 38.6 to 38.8 GB for the 704-token lead in either order.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/published_leads.md"))
    parser.add_argument("--rewrite", action="store_true", help="re-render the table from the cache, no tracing")
    parser.add_argument(
        "--explain", metavar="NAME", help="what the reserved figure after each lead of a row is made of"
    )
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    if args.explain:
        result = max((r for r in pub.published() if r.name == args.explain), key=lambda r: r.date)
        lengths = tuple(json.loads(Path("benchmarks/published.json").read_text())["lengths"])
        print("\n".join(explain(result, lengths, lead) for lead in (0, 1)))
        return 0
    cache_path = args.out.with_suffix(".json")
    if not args.rewrite:
        cache = (
            json.loads(cache_path.read_text()) if cache_path.exists() else {"libraries": pub.libraries(), "rows": {}}
        )
        for result in pub.published():
            if (
                result.name in ROWS
                and result.name not in cache["rows"]
                and result == max((r for r in pub.published() if r.name == result.name), key=lambda r: r.date)
            ):
                started = time.perf_counter()
                print(f"tracing {result.label} at leads {LEADS}", flush=True)
                by_lead = {str(k): v for k, v in lead_scan(result).items()}
                cache["rows"][result.name] = {"label": result.label, "by_lead": by_lead,
                                              "seconds": round(time.perf_counter() - started)}  # fmt: skip
            if result.name == FULL and f"{FULL} descending" not in cache["rows"]:
                print(f"tracing {result.label} at leads {LEADS[::-1]}", flush=True)
                by_lead = {str(k): v for k, v in lead_scan(result, LEADS[::-1]).items()}
                cache["rows"][f"{FULL} descending"] = {
                    "label": f"{result.label}, longest lead first",
                    "by_lead": by_lead,
                }
        cache_path.write_text(json.dumps(cache, indent=1))
    text = render(json.loads(cache_path.read_text()))
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
