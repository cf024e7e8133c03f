"""Other people's GPU measurements, reproduced by tracing their own training step: PEFT's MetaMathQA comparison.

    nice -n 10 python -m devkit.bench.published --check-whole --out benchmarks/published.md   # ~20 min, 2 busy cores
    python -m devkit.bench.published --rewrite --out benchmarks/published.md      # re-render from the cache
    nice -n 10 python -m devkit.bench.published --whole --out /tmp/whole.md       # every trace 28 layers deep
    nice -n 10 .venv-2025-07/bin/python -m devkit.bench.published --generation 2025-07-22 \
        --only full-finetuning--llama-3.2-3B-lr_0.00001      # one generation, in its libraries' environment

The table of `devkit.harness.peft_metamathqa`'s predictions against PEFT's published figures (that module says
what of the publisher's loop is re-enacted, and how), with lowmem-ft's own memory model and `plan` beside them.

How each library generation is traced and how the batch lengths are solved (from one held-in result; nothing
fitted): `devkit.harness.peft_metamathqa`. What the table shows: `docs/published-gpu-runs.md`.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from devkit.harness.peft_metamathqa import (
    AFFINE_LIMIT,
    DEPTHS,
    EMPTY_CACHE_EVERY,
    GB,
    HELD_IN,
    gap,
    held_in,
    model_reserved,
    plan_reserved,
    published,
    reserved_at,
    solve_lengths,
    trace_generation,
)

HEADER = """# Published GPU runs: PEFT's MetaMathQA memory, reproduced by tracing the publisher's step

Written by `python -m devkit.bench.published --check-whole --out benchmarks/published.md` (run under `nice -n 10`; cached in
`benchmarks/published.json`; `--rewrite` re-renders without tracing). Published: `max_memory_reserved` over the
run (`max`) and the 99th percentile of `memory_reserved` after each step (`p99`), from huggingface/peft
`method_comparison/MetaMathQA/results/*.json` at the commits in `devkit/bench/peft_metamathqa.json` (Llama-3.2-3B,
bf16, 4 rows, no checkpointing, torch AdamW, the model's own loss over full logits, NVIDIA L40S). Predicted: the
publisher's step traced on the CPU on shape-only tensors (on the libraries in `traced with`: today's, torch
{torch}, transformers {transformers}, peft {peft}, unless a generation was traced on its own) and its allocations
replayed through the model of torch's caching allocator, with `empty_cache` where that loop calls it, cut to 2 and 3 decoder layers and extrapolated to 28 (`affine`: the
extrapolation's worst miss at 4 layers). These are predictions, not measurements.

The batch lengths are not published (MetaMathQA cannot be read here): the longest batch's padded length
(**{lmax}** tokens) and the length of the bucket lead that sets the 99th percentile (**{lp99}** tokens) are solved
from the held-in row only (`held in`) and kept for every other row (`held out`). The p99 of the rows run before
PEFT's commit 90d3fc05d (`empty_cache` after every step, not every 10) is set by a shorter lead, solved from that
generation's lora r32 q,v alone (**{lp99s}** tokens; its section below). `alloc`: `memory_allocated` after a step of the run's mean sample length
(published total tokens / samples; no length solved) against the mean of the published `mem allocated avg`: the
static state plus what the loop keeps alive between steps (the bf16 logits and the KV cache in `outputs`).
`memory model`: lowmem-ft's own memory model (`lowmem_ft.memory.estimate`, `loss_impl="hf_full"`, on CUDA, torch's default allocator settings, less
its CUDA context) at the longest batch, against the published max. `plan`: what `lowmem-ft plan --vram 48
--seq-len {lmax}` predicts at PEFT's settings with `--set memory.full_logits_loss=true` (the model's own loss over
full logits; every knob given, so the planner changes none) with `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False`
(torch's default allocator settings, which PEFT's runs had), less the CUDA context. Both predict lowmem-ft's own
run at these settings, which drops the model's outputs before the backward; PEFT's loop keeps them (the current
step's bf16 logits through its backward, 0.72 GB at 4 × {lmax} tokens, and the previous step's outputs until the
next forward returns). The section "The plan against lowmem-ft's own step" sets the plan against that run.

| configuration | published (torch / transformers / peft) | traced with (torch / transformers / peft), empty_cache | row | predicted max GB | published max GB | gap | predicted p99 GB | published p99 GB | gap | predicted alloc GB | published alloc GB | gap | memory model max GB | gap | plan max GB | gap | affine (miss at 4 layers) | trace s |
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|
"""


NOTES = """
## Gaps, by the term that causes them

- **LoRA / rsLoRA on q,v** (+0.5 to +0.7 % max, +0.0 to +0.1 % p99): within the allocator's step-like response
  to the length (the held-in row's reserved figure moves 0.5 GB between 695 and 704 tokens, as the lead step's
  logits do or do not fit a cached block), below the solve's resolution. The oldest generation, traced on its own
  libraries with its every-step loop (the section above), is −0.2 %, whatever step makes AdamW's state.
- **The p99 rests on an assumption** (`SHORT`, the previous bucket's shortest batch, 96 tokens): for the held-in
  row, cut, the p99 lead reserves 19.84 / 20.14 / 21.17 GB at SHORT = 64 / 96 / 160 (the max 22.33 / 22.41 /
  22.40), so the held-out rows' p99 tests their difference from the held-in row at the same SHORT. The previous
  bucket's median, taken as the mean sample length (208), matters less: 150 / 208 / 300 tokens give max 22.41 /
  22.41 / 22.89 GB, p99 19.92 / 20.14 / 20.33 GB.
- **LoRA r10 on the MLP** (max −1.3 %): its longest batch lands on the other side of such a step; p99 +0.2 %.
  Its every-step generation (2025-10-27), traced on its own libraries and loop: +0.3 %.
- **DoRA** (max +0.2 to +0.3 %, p99 +0.1 to +0.2 %, traced whole): cut to 2/3 layers its extrapolation missed
  the 4-layer trace by 0.95 % (its weight-norm temporaries, one fp32 weight per adapted linear, land in different
  cached blocks at each depth) and gave p99 +4.7 %, max −1.7 %; traced whole, both are within 0.3 % (−0.5 % on
  the oldest generation, traced on peft 0.15.2 and its loop).
- **Full fine-tuning** (traced whole; each generation on its own transformers and peft with its loop's
  `empty_cache`, the section above): max −0.2 % and +0.7 % on the two newer generations, +6.0 % on the oldest;
  p99 +3.0 % and +3.3 %. Cut to 2/3 layers it was meaningless (4.5 % miss at 4 layers, max −35 %). What sets the
  reserved figure, after either lead: at the optimizer step AdamW's foreach temporaries (`_foreach_sqrt`, one per
  parameter, 48 MiB per MLP weight) find no cached block that holds them, while the lead's blocks sit cached: after
  the 704-token lead 5.6 GB, mostly the MLP activations' own 44 MiB segments and the fp32 norm inputs' 33 MiB ones.
  After the 599-token lead 5.4 GB: 3.2 GB of it in segments the previous step's gradients held through the
  `empty_cache` (`zero_grad` frees them only at the next step's start, as in run.py; 2.6 GB of 48 MiB ones), split
  by the lead's 37.4 MiB activations and 28.1 MiB norm inputs into pieces under 48 MiB; 1.3 GB the activations'
  own segments. The harness reads `memory_reserved`
  where run.py does: after `optimizer.step()`, before the `empty_cache` and the next `zero_grad`, with this step's
  gradients and `outputs` (bf16 logits, KV cache) alive.
- **Why the oldest generation's full fine-tuning max is 4 % lower** is not found in the Python of torch,
  transformers or peft, nor in the loop. torch's `_multi_tensor_adam`, `Adam._init_group` and `clip_grad_norm_`'s
  foreach path allocate the same in 2.7.1, 2.9.0 and 2.13 (read from their wheels; AdamW is `Adam` with decoupled
  decay in all three, and foreach is its CUDA default in all three). run.py's step and reading are the same in
  every generation; only the `empty_cache` schedule (every step, with `gc.collect()`) differs, and the wiki-loss
  evaluation before training that the newer two run (not traced). Re-enacted: the every-step schedule leaves the
  704-token lead at 38.80 GB on today's libraries; `gc.collect()` changes nothing (the trace frees the same storages
  with the collector off); transformers 4.52.4 adds 0.69 GB (its SDPA path copies the transposed query with
  `.contiguous()`, 16.5 MiB per layer at 704 tokens, and builds a bf16 4-D mask where 4.57 builds a bool one).
  The same re-enactment puts that generation's adapter rows at −0.5 to −0.2 %, so what is left is what only full
  fine-tuning exercises, on torch 2.7's C++ side (autograd's accumulation of every weight's gradient, the caching
  allocator under them and AdamW's temporaries, the CUDA kernels' own allocations), which a CPU trace under torch
  2.13 cannot re-enact. Not resolved.
- **The step that makes AdamW's state** (run.py's first: the first bucket's longest batch, not published) moves the
  full fine-tuning figures: made on a 209 / 599 / 704-token step, the 704-token lead reserves 38.80 / 38.75 /
  38.64 GB but the 599-token lead 38.46 / 39.37 / 38.27 GB, and on a long step the state's own step reserves more
  than any lead (39.41 GB at 704 tokens). So the max holds to 0.4 %, but the p99 (+2.5 to +5.7 %) is within what
  this unknown moves, and the solved 599 tokens sit on a 1.3 to 2.5 GB step of the full fine-tuning figure
  (`benchmarks/published_leads.md`): one length cannot stand for the leads its percentile counts.
  transformers' `caching_allocator_warmup` (`device_map="cuda"` reserves the weights' bytes in one segment
  before loading) is not re-enacted: added by hand to one logged sequence, it moved the figures by 0.1 GB at
  most. Allocated after a step matches to 0.06 %.
- **Allocated after a step** (−0.7 to +0.2 % on the adapter rows): the trace's batch is padded to the mean sample
  length; the published mean is over batches padded to their longest row (a few tokens more).

What this says about lowmem-ft's own memory model is in `docs/published-gpu-runs.md`.
"""


def render_generations(cache: dict) -> str:
    """The rows traced on their own generation's libraries (`--generation`), one line per step length AdamW's
    state was made on: how far that unknown moves the reserved figures."""
    generations = cache.get("generations", {})
    if not generations:
        return ""
    lmax, lp99 = cache["lengths"]
    lines = [
        "\n## Each generation re-enacted, and what the step that makes AdamW's state does\n\n"
        "Traced whole on that generation's transformers and peft (torch is today's: see the notes), with its loop's "
        "`empty_cache` schedule. run.py makes AdamW's state (full fine-tuning: 12.85 GB of bf16 moments) in its first step, the first "
        "bucket's longest batch, whose length is not published; the state's tensors are carved from the blocks that "
        "step left cached and stay for the whole run. The table's rows make it on a step of the mean sample length; "
        f"here also on a step of the two solved lead lengths ({lp99} and {lmax} tokens).\n\n"
        "| configuration | published (torch / transformers / peft) | traced with | empty_cache | state made at (tokens) "
        f"| reserved after that step GB | after the {lmax}-token lead GB | the larger GB | published max GB | gap | "
        f"after the {lp99}-token lead GB | published p99 GB | gap |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    ]
    for result in published():
        gen = generations.get(f"{result.name}@{result.date}")
        if gen is None:
            continue
        loop = "every step" if gen["every"] == 1 else f"every {gen['every']}"
        for state, t in gen["by_state"].items():
            top = max(t["state"], t["first"])  # max_memory_reserved is over the run: the state's step included
            p99 = (
                f"{t['second'] / GB:.2f} | {result.reserved_p99 / GB:.2f} | {gap(t['second'], result.reserved_p99)}"
                if gen["every"] == EMPTY_CACHE_EVERY
                else f"{t['second'] / GB:.2f} | {result.reserved_p99 / GB:.2f} | not the p99's batch"
            )
            lines.append(
                f"| {result.label} | {result.date}: {result.torch} / {result.transformers} / {result.peft} | "
                f"{gen['traced_with']} | {loop} | {state} | {t['state'] / GB:.2f} | {t['first'] / GB:.2f} | "
                f"{top / GB:.2f} | {result.max_reserved / GB:.2f} | {gap(top, result.max_reserved)} | {p99} |\n"
            )
    return "".join(lines)


def render(cache: dict) -> str:
    from importlib.metadata import version

    from devkit.bench import published_p99 as every_step  # its section and the every-step rows' p99 cells
    from devkit.bench import published_plan as own_step  # the plan against lowmem-ft's own step

    lmax, lp99 = cache["lengths"]
    libs = {p: version(p) for p in ("torch", "transformers", "peft")}
    lines = [HEADER.format(**libs, lmax=lmax, lp99=lp99, lp99s=cache.get(every_step.KEY, {}).get("length", "—"))]
    today = f"{version('torch')} / {version('transformers')} / {version('peft')}"
    generations = cache.get("generations", {})
    for result in published():
        traced = cache["rows"].get(result.name)
        gen = generations.get(f"{result.name}@{result.date}")
        loop = f"every {EMPTY_CACHE_EVERY}"
        if gen is not None:  # traced on its own generation's transformers and peft, with its loop
            traced = gen["by_state"][str(result.mean_row)]
            loop = "every step" if gen["every"] == 1 else f"every {gen['every']}"
        traced_with = f"{gen['traced_with'] if gen else today}, {loop}"
        held = "held in" if result == held_in() else "held out"
        held = "same config, older libraries" if result.name == HELD_IN and result != held_in() else held
        held += ", p99 held in" if f"{result.name}@{result.date}" == every_step.held_in_key(cache) else ""
        libs = f"{result.date}: {result.torch} / {result.transformers} / {result.peft}"
        if traced is None:
            lines.append(f"| {result.label} | {libs} | not traced |" + " |" * 16 + "\n")
            continue
        pmax, pp99 = traced["first"], traced["second"]
        mm, plan = model_reserved(result, lmax), plan_reserved(result, lmax)
        planned = "no plan at 48 GB | —" if plan is None else f"{plan / GB:.2f} | {gap(plan, result.max_reserved)}"
        p99 = (
            f"{pp99 / GB:.2f} | {result.reserved_p99 / GB:.2f} | {gap(pp99, result.reserved_p99)}"
            if result.empty_cache_every == EMPTY_CACHE_EVERY
            else every_step.p99_cells(result, cache)
        )
        affine = (
            "whole"
            if traced["affine"] is None and "cut" not in traced
            else f"{traced['affine']:.2%}"
            if "cut" not in traced
            else f"whole ({traced['cut']['affine']:.2%} cut)"
        )
        lines.append(
            f"| {result.label} | {libs} | {traced_with} | {held} | {pmax / GB:.2f} | {result.max_reserved / GB:.2f} | "
            f"{gap(pmax, result.max_reserved)} | {p99} | {traced['allocated'] / GB:.2f} | "
            f"{result.allocated_avg / GB:.2f} | {gap(traced['allocated'], result.allocated_avg)} | "
            f"{mm / GB:.2f} | {gap(mm, result.max_reserved)} | {planned} | "
            f"{affine} | "
            f"{traced['seconds']} |\n"
        )
    check = cache.get("whole_check")
    if check is not None:  # the held-in row's cut traces, checked at full depth
        held = held_in()
        lines.append(
            f"\nThe held-in row traced whole (28 layers) at the solved lengths: max {check['first'] / GB:.2f} GB "
            f"({gap(check['first'], held.max_reserved)}), p99 {check['second'] / GB:.2f} GB "
            f"({gap(check['second'], held.reserved_p99)}), live peak {check['requested'] / GB:.3f} GB "
            f"(cut and extrapolated: {cache['rows'][HELD_IN]['requested'] / GB:.3f}).\n"
        )
    return "".join(lines) + render_generations(cache) + every_step.render(cache) + own_step.render(cache) + NOTES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/published.md"))
    parser.add_argument("--rewrite", action="store_true", help="re-render the table from the cache, no tracing")
    parser.add_argument("--only", nargs="*", default=None, help="result names to trace (default: every one)")
    parser.add_argument(
        "--check-whole", action="store_true", help="also trace the held-in row whole at the solved lengths"
    )
    parser.add_argument(
        "--whole", action="store_true", help="trace every row and the solve with all 28 layers (about 5 min each)"
    )
    parser.add_argument(
        "--generation",
        metavar="DATE",
        help="trace the rows of the generation published on DATE (with --only: those rows) with its loop, on the "
        "installed libraries (install that generation's transformers and peft first), and only write the cache",
    )
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    cache_path = args.out.with_suffix(".json")
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {"rows": {}}
    if args.generation:
        for result in published():
            if result.date == args.generation and (args.only is None or result.name in args.only):
                key = f"{result.name}@{result.date}"
                cache.setdefault("generations", {})[key] = trace_generation(result, tuple(cache["lengths"]))
                cache_path.write_text(json.dumps(cache, indent=1))
        print(
            f"traced; re-render in lowmem-ft's environment: python -m devkit.bench.published --rewrite --out {args.out}"
        )
        return 0
    if not args.rewrite:
        held = held_in()
        depths = (28,) if args.whole else DEPTHS
        cache["lengths"] = list(solve_lengths(held, cache, depths))
        cache["rows"][HELD_IN] = {k: v for k, v in cache["solve"][-1].items() if k != "lengths"}
        cache_path.write_text(json.dumps(cache, indent=1))
        for result in published():
            if result.name in cache["rows"] or (args.only is not None and result.name not in args.only):
                continue  # one trace per configuration: the generations differ in libraries only
            print(f"tracing {result.label} at lead lengths {cache['lengths']}", flush=True)
            cache["rows"][result.name] = reserved_at(result, tuple(cache["lengths"]), depths)
            cache_path.write_text(json.dumps(cache, indent=1))
        for result in published():
            row = cache["rows"].get(result.name)
            if row is None or "cut" in row or (row["affine"] or 0) <= AFFINE_LIMIT:
                continue
            print(f"tracing {result.label} whole: its extrapolation missed by {row['affine']:.2%}", flush=True)
            whole = reserved_at(result, tuple(cache["lengths"]), depths=(28,))
            cache["rows"][result.name] = {**whole, "cut": row}
            cache_path.write_text(json.dumps(cache, indent=1))
        if args.check_whole and "whole_check" not in cache:
            print(f"tracing {held.label} whole at the solved lengths", flush=True)
            cache["whole_check"] = reserved_at(held, tuple(cache["lengths"]), depths=(28,))
        cache_path.write_text(json.dumps(cache, indent=1))
    text = render(cache)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
