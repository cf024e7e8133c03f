"""The real-size truth table: every catalog model at each tier's plan and a long-context plan per tier, the memory
model's CPU form against the traced step (`lowmem_ft.train.trace.step`: the real step at full size, no weights).

    python -m devkit.bench.real_size --out benchmarks/real_size.md                    # every row (hours on 2 cores)
    python -m devkit.bench.real_size --models meta-llama/Llama-3.1-8B --tiers 24 --out /tmp/t.md

Each row: the plan `lowmem-ft plan --model M --vram T` chooses (`--seq-len` for the long-context row), traced
(peak live tensor bytes over the yardstick's two optimizer steps and an evaluation forward) against predicted
(`phase_peak_bytes`, the CPU form: no device overheads). Rows already in `--out` are kept, so a run that stops
can be continued; a model the planner cannot fit in a tier, or the tracer cannot build, is a row saying why.
Cheap enough to re-run when a library version changes: no weights are read or allocated.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from lowmem_ft.errors import UserError
from lowmem_ft.memory.arch import catalog
from lowmem_ft.memory.estimate import GB

TIERS = (8.0, 24.0, 40.0)
LONG_SEQ = 16384  # the long-context row's --seq-len (capped at the model's positions: `_plan`)
PREAMBLE = (
    "# Real size: the memory model against the traced step\n\n"
    "Written by `python -m devkit.bench.real_size`. Each row: the plan `lowmem-ft plan --model M --vram T` chooses "
    "(rows marked long: with `--seq-len 16384`, or the model's positions when fewer), traced by `lowmem_ft.train.trace.step` (the real step at full size on the "
    "CPU, no weights: two optimizer steps with an accumulation window and an evaluation forward) against the memory "
    "model's CPU form of the same phases (live tensor bytes, no device overheads; on the CPU nothing is offloaded). "
    "`gap` = (predicted − traced) / traced of the peaks; `worst phase` the phase with the largest gap. "
    "`trace s` is wall time on a shared 2-core machine (load average 6–15). The traced bytes are kept in `real_size.json`, so "
    "`--rewrite` re-predicts every row after a change to the memory model without tracing again.\n\n"
)
HEADER = PREAMBLE + (
    "| model | vram | plan | traced GB | predicted GB | gap | worst phase | trace s |\n"
    "|---|---|---|---|---|---|---|---|\n"
)


def _plan(model: str, vram: float, seq_len: int | None):
    """(recipe, choice, what) of `lowmem-ft plan --model M --vram T [--seq-len]`, or a UserError."""
    from lowmem_ft.choosing import choose_recipe
    from lowmem_ft.train.args import eval_batch_size

    if seq_len:  # the long row at the model's own positions when it has fewer (Phi-3-mini-4k, OLMoE: 4,096)
        from lowmem_ft.memory.arch import load_architecture

        positions = load_architecture(model, False).max_position_embeddings
        seq_len = min(seq_len, positions) if positions else seq_len
    recipe, choice = choose_recipe(
        vram_gb=vram, recipe=None, overrides={"model": {"name_or_path": model}}, seq_len=seq_len
    )
    m = recipe.memory
    savers = [k for k in ("chunked_loss", "tiled_mlp", "tiled_norms", "recompute_lora", "embeddings_on_host")
              if getattr(m, k)]  # fmt: skip
    quant = "" if recipe.model.quantization == "none" else f"+{recipe.model.quantization}"
    what = (
        f"{recipe.adapter.kind}{quant} {recipe.optimizer.name}, {m.micro_batch_size}×{m.max_seq_len}"
        f"{', ckpt' if m.gradient_checkpointing else ''}{', ' + ', '.join(savers) if savers else ''}"
        f", eval {eval_batch_size(recipe)}"
    )
    return recipe, choice, what


def predicted(recipe) -> dict[str, float]:
    """The memory model's CPU form of the traced phases (`lowmem_ft.train.trace.verify.verify`'s prediction)."""
    from lowmem_ft.memory.arch import load_architecture
    from lowmem_ft.train.trace.verify import predict

    return predict(recipe, load_architecture(recipe.model.name_or_path, recipe.model.trust_remote_code))


def traced_entry(model: str, vram: float, seq_len: int | None) -> dict:
    """The row's plan and its traced phases (bytes), or why there is none: what the cache keeps."""
    from lowmem_ft.train.args import eval_batch_size
    from lowmem_ft.train.trace.step import trace

    try:
        recipe, _, what = _plan(model, vram, seq_len)
    except UserError as exc:
        return {"plan": f"no plan: {str(exc)[:90]}"}
    started = time.perf_counter()
    try:
        result = trace(recipe, eval_rows=eval_batch_size(recipe))
    except UserError as exc:
        return {"plan": what, "error": f"cannot trace: {str(exc)[:80]}"}
    return {"plan": what, "traced": result.phases, "seconds": round(time.perf_counter() - started), "how": result.how()}


def row(key: str, entry: dict) -> str:
    """One table row from a cached entry, predicted by the current memory model (re-planned: a plan that changed
    since the trace is marked stale)."""
    model, vram, long = key.split("|")
    label = f"| {model} | {'long ' if long else ''}{vram} | "
    if "traced" not in entry:
        return label + f"{entry['plan']} | {entry.get('error', '')} | | | | |"
    try:
        recipe, _, what = _plan(model, float(vram), int(long) if long else None)
    except UserError as exc:  # the memory model now finds the traced plan does not fit
        return label + f"{entry['plan']} | stale: no plan now ({str(exc).split(' even with')[0]}) | | | | |"
    if what != entry["plan"]:
        return label + f"{entry['plan']} | stale: the plan is now {what} | | | | |"
    traced, pred = entry["traced"], predicted(recipe)
    gaps = {p: (pred[p] - t) / t for p, t in traced.items()}
    worst = max(gaps, key=lambda p: abs(gaps[p]))
    t_peak, p_peak = max(traced.values()), max(pred[p] for p in traced)
    return label + (
        f"{what} | {t_peak / GB:.3f} | {p_peak / GB:.3f} | {(p_peak - t_peak) / t_peak:+.2%} "
        f"| {worst} {gaps[worst]:+.2%} | {entry['seconds']} |"
    )


def _stale(key: str, entry: dict) -> bool:
    """Whether the plan the row was traced (or refused) for is no longer the one planned (the memory model or the
    runner changed)."""
    model, vram, long = key.split("|")
    try:
        return _plan(model, float(vram), int(long) if long else None)[2] != entry["plan"]
    except UserError:
        return "traced" in entry  # still no plan: the row stands


NOTES = """
## Gaps found

Fixed (each traced on the model cut to one to six layers, the peak located by stack):

- **Evaluation forward** (Llama-3.1-8B: +3.0 % at 24 GB, +14.8 % at 40 GB; over-predicted): the eval peak took
  one layer's training-saved tensors as its bound. The in-flight peak is the MLP moment (or the output projection),
  and the head's eval moment keeps only the final norm's output and the loss input. Fixed in
  `lowmem_ft/memory/evaluation.py` (`eval_layer_bytes`): 8B 24 GB eval at 4 rows 19.02 → 18.48 GB predicted
  against 18.46 traced.
- **Eager attention in evaluation** (gemma-2-9b: its 16 × 2,048 eval batch holds 10.7 GB of softmax scores in
  flight): not counted at all before; now counted (`eval_layer_bytes`).
- **Eager attention in a checkpointed forward** (gemma-2-9b 24 GB: −7.2 %, under-predicted): eager softmax holds
  the c-byte scores, their fp32 upcast and fp32 output beside q and k/v repeated, and the decoder layer holds the
  c-byte probabilities through the MLP. Fixed in `lowmem_ft/memory/transients.py`: forward 11.34 → 12.23 GB
  predicted against 12.22 traced.
- **Eval at wide eval batches** (Llama-3.1-8B −0.6 % / −1.6 % at 8 / 32 rows; under-predicted): past the first
  layer the model's forward still holds `inputs_embeds` beside the MLP moment. Fixed in `eval_layer_bytes`.
- **Eager softmax in evaluation, again** (gemma-2-9b 24 GB eval −0.67 %, −129.5 MB at 16 × 2,048; under-predicted):
  the softmax moment holds three c·h tensors (the layer's input, its normed input and `inputs_embeds`), not two,
  and no dequantized NF4 weight (the memory model added it to every eval moment). Fixed in `eval_layer_bytes`
  (the dequantized weight beside the linears' moments only): 19.114 → 19.246 GB predicted against 19.243 traced
  (+0.01 %).
- **One key/value head** (gemma-3-1b-pt 24 GB forward +1.41 %, backward +1.33 %, +334 MB at 2 × 2,048;
  over-predicted): with one key/value head `repeat_kv`'s expand + reshape is a view, so a masked layer keeps k and
  v one head wide, not repeated (3,072 B/token per layer less). Fixed in `lowmem_ft/memory/activations.py`
  (`repeats_kv_copy`): forward 24.073 → 23.746 GB against 23.738 traced (+0.03 %), backward +0.07 %.
- **Eager softmax backward** (gemma-2-9b long 24 GB backward −10.4 %, −2.66 GB at 1 × 8,192, NF4, checkpointing;
  under-predicted): once the scores outweigh the MLP's tensors, the recomputed layer's backward peaks at its softmax
  backward, not at its MLP: `_softmax_backward_data` holds the saved fp32 output, the incoming gradient's fp32
  upcast and its fp32 result beside tanh's saved output (14 B per score, where the model had 8 at the MLP moment),
  the bf16 additive masks (one per kind of layer), and per token only what the layer saved before its attention
  (140,534 B/token traced at 1 × 2,048, 4,096 and 8,192 on the model cut to one layer, each live storage named by
  the op that made it; the MLP's and the head's tensors are freed by then). Fixed in
  `lowmem_ft/memory/activations.py` (`eager_softmax_backward_bytes`, a backward moment of its own): backward
  22.868 → 25.533 GB predicted against 25.532 traced (+0.00 %; one layer at 8,192: 18.269 against 18.268). The plan
  no longer fits 24 GB at 8,192 tokens (24.5 GB even with every saver: that row now says no plan); on a row it
  was not fitted on, gemma-2-9b long at 40 GB (1 × 8,192), the peak is +0.01 %.
- **A fused qkv_proj's v with as many key/value heads as heads** (Phi-3-mini-4k 40 GB −3.5 %, forward −3.7 %, at
  2 × 2,048 without checkpointing; under-predicted, the largest unsafe gap): `repeat_kv` returns its input when
  there is one query head per key/value head, so a masked layer's SDPA (a padded batch, or Phi-3's 2,047-token
  window) keeps v as a view of qkv_proj's output, all c·(q + 2·kv) of it, where the memory model counted a repeated
  copy one head-set wide: 12,288 B/token per layer (traced on the model cut to one and two layers, located by
  stack). Fixed in `lowmem_ft/memory/activations.py` (`repeats_kv_copy`): the traced plan's forward 41.868 →
  43.478 GB predicted against 43.494 traced (−0.04 %), backward 44.019 → 45.629 against 45.619 (+0.02 %). That plan
  no longer fits 40 GB: the row's plan is now 8 × 2,048 with checkpointing, traced at 34.525 GB (its 64-row eval)
  against 34.587 predicted (+0.18 %; forward +0.04 %, backward +0.14 %).
- **A wide projection's LoRA output side under checkpointing** (Phi-3-mini-4k long 24 GB forward −5.6 %, −803 MB
  at 4 × 4,096): the checkpointed layer's forward peaks on the output side of the fused gate_up_proj's LoRA branch
  (2·i wide): the base output, lora_B's fp32 output and its scaled copy, the input and its fp32 cast and the
  residual sum, 188,416 B/token on the model cut to one layer, where the memory model took the moment of the
  widest input (down_proj's). The dropout's share is none: in the checkpoint's no-grad forward its noise and
  dropped copy are freed once lora_A has read them (peft 0.21 lora/layer.py `Linear.forward`); the term tried
  before also counted the layer's checkpointed input, which is kept already. Fixed in
  `lowmem_ft/memory/transients.py` (`lora_output_side_bytes`, FWD_INPUT_CAST_FP32): forward 13.469 → 14.278 GB
  predicted against 14.272 traced (+0.04 %). Its backward (−1.04 %, the peak) was the fused v above in the
  recomputed layer (+201 MB): 17.053 GB predicted against 17.029 traced again (+0.14 %). The same form, with
  act(gate) alive beside up_proj, is the moment of a separate gate/up pair once dropout 0 makes no dropped copy
  (Llama-3.2-1B cut to one layer, 1 × 2,048: 898.3 MB predicted against 898.0 traced, 864.7 before), and on CUDA,
  whose dropout masks are 1 byte (read from the code, not measured on a GPU; the other families' planned peaks, at
  the backward, do not move).
- **The fused head's input copy at batches of several rows** (the forward of every row with two or more rows,
  −0.1 to −0.8 %, not the peak; Phi-3-mini-4k long 8 GB −0.77 %, 24 GB −0.41 %; under-predicted): TRL's fused head
  scores `hidden_states[:, :-1].reshape(-1, h)`, a copy when the batch has several rows (a view for one; on CUDA
  `hidden_states[mask]`, always a copy), so the final norm's c-byte output stays alive beside it through the loss's
  forward (50.3 MB on Phi-3-mini-4k cut to one layer at 4 × 2,048, located by stack), where the memory model
  counted it only with the chunked loss or the tiled norms. Fixed in `lowmem_ft/memory/activations.py`
  (`head_input_copied`): those rows' forward now +0.01 to +0.09 % (Phi-3-mini-4k long 8 GB +0.04 %, 24 GB +0.02 %,
  Mistral-Nemo 24 GB −0.55 → +0.02 %), no peak moved.

- **The checkpointed backward** (+0.4 to +1.0 % at 2,048 tokens on the dense models, +2.0 to +3.6 % on the long
  rows, +1.6 / +1.9 % with NF4 on Qwen2.5-14B / Mistral-Nemo; over-predicted): the layer's peak is the end of its
  recomputed forward — torch's non-reentrant checkpoint stops at the last saved tensor, down_proj's lora_A output —
  with the head's saved tensors (final norm, loss input) already freed; the 8·i + 5·h of gradients had been fitted on
  the backbone alone (no head) and was added beside them. Now read from the code and traced per live storage
  (`lowmem_ft/memory/recompute.py`): down_proj's c-byte input and fp32 cast, the base output, the MLP input and the
  residual sum, the layer output's gradient, peft's scaled fp32 gradient and (unquantized) the base output's
  gradient; without dropout up_proj's output side instead; with NF4 at few tokens the base backward's dequantized
  weight. One layer: Llama-3.1-8B 24 GB 7.779 → 7.644 GB against 7.641 traced (+0.05 %), long 24 GB (NF4)
  12.503 → 11.983 against 11.977 (+0.05 %), Qwen2.5-14B 24 GB (NF4) 9.194 → 8.868 against 8.864 (+0.04 %), NF4 at
  1 × 512 +0.02 %.
  Every dense row it covers is now +0.00 to +0.10 % (Qwen2.5-7B long 24 GB +3.57 → +0.03 %, Qwen2.5-0.5B long
  24 GB +2.65 → +0.10 %, Mistral-Nemo 24 GB +1.94 → +0.02 %), none under; no traced row's plan changed. Not
  covered (their measured terms kept): gemma-2/3's sandwich norms (this form under-predicted gemma-2-9b's cut layer
  by 1.6 %), parallel blocks, fused projections (Phi-3), DoRA, LoRA recompute, the tiled MLP, full fine-tuning.

- **The evaluation forward of the long-context rows** (Llama-3.2-3B long 8 GB eval −3.63 %, under; Qwen2.5-3B long
  8 GB +5.03 %, Mistral-7B-v0.3 / Llama-3.1-8B / Qwen2.5-7B long 8 GB +2.2 / +2.0 / +1.9 %, Phi-3-mini-4k long
  8 GB +1.9 %, Qwen1.5-MoE-A2.7B 40 GB +2.7 %, over; the peak of none): traced on each plan cut to two layers,
  every live storage at each moment named by the op that made it. (1) An eval batch of several rows is padded, so
  every layer's SDPA gets the bool mask, and torch turns it into a c-byte additive one (b × s × s: 1,074 MB at
  2 × 16,384) beside q and k after RoPE, v, the repeated k/v, the output and three c·h tensors — Llama-3.2-3B's eval
  peak, 2,628.8 MB beside the bool mask and static, which the memory model had no moment for. (2) The bool mask
  (537 MB there) is the base model's local, freed before the head runs; the memory model added it to the head's
  moment too. That is why the two 3B models went opposite ways on the same knobs: on Qwen2.5-3B (152k vocabulary,
  h 2,048, 2 kv heads) the head and loss (2,282 MB) outweighed its SDPA moment (2,049 MB), and carried the mask;
  on Llama-3.2-3B (h 3,072, 8 kv heads) the SDPA moment (2,629 MB) was the peak and was missing. (3) With one row
  TRL's fused head scores a view of the final norm's output, not a copy (`head_input_copied`): one c·h (134 MB at
  16,384 tokens) less at the head's moment — the eval-1 rows' +2 %. (4) A quantized linear's dequantized weight is
  freed before peft's LoRA branch runs (bitsandbytes MatMul4Bit, peft bnb.py), so it is not beside the branch's
  fp32 tensors (Phi-3's gate_up_proj: 100.7 MB; the NF4 rows' +0.7 to +1.0 %). (5) Qwen2-MoE's shared expert runs
  before the routed experts and its MLP is freed by then (the memory model added its 3·c·i beside them: +868 MB at
  16 × 2,048); its own LoRA up_proj moment is the peak, beside both bool masks (the unused sliding one too). Fixed
  in `lowmem_ft/memory/evaluation.py` (`eval_masked_sdpa_bytes`, `eval_peak_bytes`, `eval_layer_bytes`),
  `experts.moe_eval_bytes` and `activations.head_saved_bytes`: eval Llama-3.2-3B long 8 GB −3.63 → +0.41 %,
  Qwen2.5-3B +5.03 → +0.47 %, Mistral-7B-v0.3 / Llama-3.1-8B / Qwen2.5-7B +0.10 / +0.09 / +0.10 %, Phi-3-mini long
  8 GB +0.15 %, Qwen1.5-MoE 40 GB +0.06 % and long 40 GB +2.06 → +0.06 % (at their traced eval batches). Every
  other traced row's eval is unchanged or closer (now −0.67 to +0.82 %, the one under gemma-2-9b's eager row, not
  touched); no training phase moved. Five plans now take another eval batch (stale above), each traced at two layers
  at the new one: Qwen1.5-MoE 40 GB 16 → 32 rows (+0.39 %), long 40 GB 4 → 8 (+0.42 %), Qwen2.5-32B 24 GB 2 → 4
  (+0.13 %), Qwen3-8B 8 GB 2 → 4 (+0.02 %), gemma-3-4b-pt long 8 GB 2 → 1 (+0.17 %; its 2 × 16,384 eval, now with
  the additive mask, no longer fits on CUDA; its traced eval 2: +1.20 → +0.21 %).

Explained, not a memory-model error:

- **static** +6.3 MB on the long rows (+0.8 MB at 2,048 tokens): the trace's warm-up micro batches (steps 1.1 and
  2.1) are 8 tokens long, where the model counts the loader's batches at the plan's length.
- Qwen v1 (Qwen-1_8B / 7B / 14B / 72B): loaded as the native Qwen2 (`lowmem_ft.native.qwen_v1`), traced like any
  Qwen2 row; the 1.8B rows at +0.48–0.49 % are its eval phase at 16–32 rows (the largest gap of the Qwen v1 rows), and
  the 7B 8 GB eval −1.40 % (not the row's peak) is not located. 72B has no plan up to 40 GB; 14B none at 8 GB.

The allocator's term for expandable segments, derived from replays (`benchmarks/allocator_term.md`: 34 MiB + 3.8 %
of the transient peak and gradients for adapters, where 10 % of the transient was assumed), changed 13 plans here:
larger micro or eval batches where the transient is large, another saver where it is small (the 34 MiB base is more
than 10 % of a short step's transient). Each was traced again at its new plan: −0.10 to +0.29 % at the peak, save
gemma-2-9b 8 GB (below) and gemma-3-1b-pt long 8 GB (+1.55 %, the checkpointed backward over-predicted below).

Open, under-predicted (the unsafe side):

- **gemma-2-9b 8 GB eval −1.70 %** (−127 MB, its eval of 4 × 512 tokens, NF4, the tiled MLP, tiled norms and LoRA recompute; the
  row's peak): the new plan turns tiled norms on (its traced training phases agree); the eval moment with tiled
  norms under eager attention is not located.

- **gemma-3-4b-pt long 8 GB backward −0.10 %** (−11 MB at 1 × 16,384, NF4, the tiled MLP, tiled norms and LoRA
  recompute; the row's peak; traced once, for the plan whose eval batch the eval fix changed): not located. Its
  checkpointed backward keeps the older measured terms (sandwich norms, the savers).
- **gemma-2-9b long 40 GB forward −0.59 %, eval −0.67 %** (−198 / −206 MB at 1 × 8,192; not the peak, the backward
  is +0.01 %): eager attention's bf16 additive masks (b × s², one per kind of layer, alive from the forward to the
  end of the backward) are counted at the softmax backward only (`eager_masks_bytes`); on the long 24 GB row, traced
  before its plan went (−0.98 % there), 134 MB of the 200 at one layer. Adding them to every moment moves the
  2,048-token rows by +67 MB, so not done before a trace of those.

Open, over-predicted (the safe side):

- **gemma-3-1b-pt long 8 / 24 / 40 GB backward +2.0 to +2.2 %** (the largest peak gaps left): its checkpointed
  backward keeps the older measured recompute term (`transients.backward_transient_bytes`, 8·i + 5·h B/token with the
  head alive). Gemma-2/3's sandwich norms put the recompute's end after the MLP's post-norm, so the dense form
  (`recompute.recompute_end_bytes`) under-predicted gemma-2-9b cut to one layer by 17.5 / 10.4 kB/token; the
  sandwich form is not derived yet (the gemma-2-9b and gemma-3-4b rows are within +0.9 %).
- Llama-3.1-8B / Mistral-7B-v0.3 / Qwen2.5-7B long 8 GB forward +1.2 / +1.3 / +1.2 % (not the peak; ~140 MB, one
  c·h tensor at 16,384 tokens, with the tiled MLP, tiled norms and LoRA recompute; their eval, the same size, is
  fixed above): not located; Mistral-7B-v0.3 cut to two layers shows the same +139.6 MB in its forward.
- Llama-3.1-70B at 80 GB backward +1.4 % (`plan --verify`, not a tier here): the checkpointed backward (fixed
  above); not traced again.

Not in the table: Mixtral-8x7B has no plan up to 40 GB (93 GB at 2,048 tokens even with NF4); Qwen3-30B-A3B
needs 60.5 GB, so its row is at 80 GB (`--models Qwen/Qwen3-30B-A3B --tiers 80 --long-seq 0`).

Rows marked stale were traced for a plan the planner no longer chooses; their traced bytes stay in
`real_size.json`, and the next run traces them again.
"""


# One model per family first (the smallest that shows the family's architecture), so a partial run covers every
# family before it fills every tier.
FAMILY_FIRST = (
    "Qwen/Qwen2.5-0.5B",
    "meta-llama/Llama-3.2-1B",
    "google/gemma-3-1b-pt",
    "allenai/OLMoE-1B-7B-0924",
    "microsoft/Phi-3-mini-4k-instruct",
    "Qwen/Qwen1.5-MoE-A2.7B",
    "Qwen/Qwen-7B",
    "mistralai/Mistral-7B-v0.3",
    "Qwen/Qwen3-8B",
    "meta-llama/Llama-3.1-8B",
    "google/gemma-2-9b",
    "mistralai/Mistral-Nemo-Base-2407",
    "Qwen/Qwen3-30B-A3B",
    "mistralai/Mixtral-8x7B-v0.1",
)


def keys(models: list[str], tiers: list[float], long_seq: int) -> list[str]:
    """The rows in the order they are traced: breadth first — every family at the middle tier, plain and long;
    then every other model there; then the other tiers, plain before long."""
    ordered = [m for m in FAMILY_FIRST if m in models] + [m for m in models if m not in FAMILY_FIRST]
    first_tier = 24.0 if 24.0 in tiers else tiers[0]
    seqs = (None, long_seq) if long_seq else (None,)

    def key(model, vram, seq):
        return f"{model}|{vram:g}|{seq or ''}"

    out = [key(m, first_tier, s) for m in ordered if m in FAMILY_FIRST for s in seqs]
    out += [key(m, first_tier, s) for m in ordered if m not in FAMILY_FIRST for s in seqs]
    for seq in seqs:
        out += [key(m, v, seq) for v in tiers if v != first_tier for m in ordered]
    return out


def _promoted(order: list[str], cache: dict, top: float) -> list[str]:
    """The largest tier's plain row of each family's model that has no plan at a smaller one (the mixtures of
    experts at 24 GB): traced next, before the other models, so that every family has a row."""
    out = []
    for key in order:
        model, vram, long = key.split("|")
        if model in FAMILY_FIRST and not long and cache.get(key, {}).get("plan", "").startswith("no plan"):
            out.append(f"{model}|{top:g}|")
    return out


def _key_order(key: str) -> tuple:
    model, vram, long = key.split("|")
    return (model, float(vram), int(long or 0))


def write(out: Path, cache: dict) -> None:
    rows = [row(k, cache[k]) for k in sorted(cache, key=_key_order)]
    out.write_text(HEADER + "\n".join(rows) + "\n" + NOTES)


def _store(cache_file: Path, key: str, entry: dict) -> dict:
    """Add one entry to the cache file under a lock, re-reading it first: several runs may fill it at once."""
    import fcntl

    with open(cache_file, "a") as lock:  # the file itself is the lock (rewritten in place, same inode)
        fcntl.flock(lock, fcntl.LOCK_EX)
        text = cache_file.read_text()  # empty when `open` has just made it (a new --out)
        cache = json.loads(text) if text.strip() else {}
        cache[key] = entry
        cache_file.write_text(json.dumps(cache, indent=1, sort_keys=True) + "\n")
    return cache


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", help="catalog ids (default: every catalog model)")
    parser.add_argument("--tiers", nargs="*", type=float, default=list(TIERS))
    parser.add_argument("--long-seq", type=int, default=LONG_SEQ, help="the long-context rows' --seq-len (0: none)")
    parser.add_argument("--out", default="benchmarks/real_size.md")
    parser.add_argument("--rewrite", action="store_true", help="only rewrite the table from the cache (no tracing)")
    parser.add_argument("--shard", default="0/1", help="k/n: trace every n-th row from the k-th (runs at once share "
                        "the cache file)")  # fmt: skip
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    out = Path(args.out)
    cache_file = out.with_suffix(".json")
    if not args.rewrite:
        cache = json.loads(cache_file.read_text()) if cache_file.is_file() else {}
        order = keys(args.models or list(catalog()), args.tiers, args.long_seq)
        promoted = _promoted(order, cache, max(args.tiers))
        order = [k for k in order if k in promoted] + [k for k in order if k not in promoted]
        todo = [k for k in order if k not in cache or _stale(k, cache[k])]
        shard, shards = (int(x) for x in args.shard.split("/"))
        for key in todo[shard::shards]:
            model, vram, long = key.split("|")
            entry = traced_entry(model, float(vram), int(long) if long else None)
            cache = _store(cache_file, key, entry)
            print(row(key, entry), flush=True)
    write(out, json.loads(cache_file.read_text()) if cache_file.is_file() else {})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
