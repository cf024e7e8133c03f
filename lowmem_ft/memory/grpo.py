"""A GRPO step's memory, phase by phase: pure arithmetic (no torch). The peak is the largest phase, not a sum.

The one idea: TRL 1.16's `GRPOTrainer` runs four phases one after the other, each over its own rows —

- generation: one `generate` call for the whole round (`_generate_single_turn`): the b × steps_per_generation
  completions (R rows, `num_generations` per prompt) of `steps_per_generation` micro-steps, unchunked, on TRL's HF
  path. Beside the static state (weights; the LoRA parameters and optimizer states; gradients only when a round
  starts inside an optimizer step, i.e. gradient_accumulation is not a multiple of steps_per_generation — the
  Trainer frees them after each step): the KV cache over the R rows, `2·L·kv_heads·head_dim·c·R·(P+C−1)` (the
  last token is sampled, never cached), the ids and attention mask of every row-token, the sampling's per-row
  vocabulary tensors, and the prefill's one layer in flight over R·P tokens (a QLoRA linear's dequantized weight
  beside it);
- scoring: no-grad passes of b rows at a time (`_get_per_token_logps_and_entropies` with batch_size b) over the
  round — the old policy's when steps_per_generation does not divide gradient_accumulation (importance sampling),
  the reference's when beta > 0 (LoRA: the same model with the adapter disabled; full fine-tuning: a second copy
  of the weights, alive through every phase);
- training: the SFT micro-step the memory model knows (`estimate.phase_peak_bytes`) at b rows × (P + C) tokens
  with TRL's fused head (log-probs and entropies of the completion tokens only);
- the optimizer step, as for SFT.

Between phases the round's buffered inputs (`_buffered_inputs`: prompt and completion ids and masks, int64, for
the R rows; the per-token old / reference log-probs, fp32) stay alive — under TRL's own trainer the previous round's
through the next round's generation and scoring too (it replaces the buffer once the new round is made; lowmem-ft's
trainer frees it first, `GrpoShape.frees_spent_round`); SFT's batch term (its
micro batches held for accumulation) is replaced by them. Under beta > 0 the reference is kept beside every phase
(`reference_copy_bytes`); under QLoRA TRL trains the adapter in bf16 (`_adapter_cast`).

Every constant is in `lowmem_ft.memory.calibration` (GRPO_*), with the measurement it comes from. A vLLM generation
phase (its own memory share, sleep mode) would be one more `GenerationPhase` kind: the phases are a dict, the peak
their max.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lowmem_ft.memory.activations import attention_mask_bytes
from lowmem_ft.memory.arch import Architecture
from lowmem_ft.memory.calibration import (
    BATCH_BYTES_PER_TOKEN,
    GRPO_EAGER_PREFILL_SCORES,
    GRPO_IDS_BYTES_PER_TOKEN,
    GRPO_PREFILL_HIDDEN,
    GRPO_PROMPT_BYTES_PER_TOKEN,
    GRPO_ROUND_BYTES_PER_TOKEN,
    GRPO_SAMPLING_FP32_PER_VOCAB,
    GRPO_SAMPLING_FP32_VOCAB_FIXED,
)
from lowmem_ft.memory.estimate import (
    DTYPE_BYTES,
    Setup,
    effective_setup,
    estimate,
    eval_peak_bytes,
    layer_moments,
    phase_peak_bytes,
)
from lowmem_ft.memory.evaluation import eval_allocator_block, eval_mlp_bytes
from lowmem_ft.memory.inference import human, kv_cache_bytes
from lowmem_ft.memory.linears import is_mlp_linear, lora_linears
from lowmem_ft.memory.overheads import transient_without_overheads
from lowmem_ft.memory.static import (
    _trainable_tensors,
    optimizer_step_temp,
    trainer_fp32_states,
    weight_bytes,
)

PHASES = ("generation", "scoring", "forward", "backward", "optimizer step")


@dataclass(frozen=True)
class GrpoShape:
    """What a GRPO round is made of, beside the SFT setup (whose micro_batch_size is b, completions per micro-step)."""

    prompt_len: int  # P: the round's longest prompt (prompts are left-padded to it)
    completion_len: int  # C: max_completion_length
    num_generations: int = 8  # G: completions per prompt
    steps_per_generation: int | None = None  # micro-steps one round covers; None: gradient_accumulation (TRL)
    beta: float = 0.0  # > 0: a reference pass (TRL's default is 0)
    # lowmem-ft's trainer drops the spent round before it generates the next (train/methods/grpo.py); TRL's own keeps it
    # until the new one is made, beside the next generation and scoring (devkit/harness/grpo.py measures that)
    frees_spent_round: bool = True
    # TRL's own GRPOTrainer casts a quantized model's adapter to bf16 (`_adapter_cast`); lowmem-ft undoes that and
    # trains it in fp32 (train/model.py `keep_adapters_fp32`); devkit/harness/grpo.py runs TRL's as it is
    adapter_bf16: bool = False

    def rows(self, s: Setup) -> int:
        """R: completions one generation round makes (TRL's generation_batch_size)."""
        return s.micro_batch_size * (self.steps_per_generation or s.gradient_accumulation)


def method_setup(s: Setup) -> Setup:
    """The SFT setup of a GRPO run's policy: no dropout (lowmem-ft sets TRL's `disable_dropout`: the scoring and
    training passes must see the same weights) and TRL's own loss (`_get_per_token_logps_and_entropies`)."""
    return replace(s, lora_dropout=0.0, loss_impl="trl_fused")


def training_setup(s: Setup, g: GrpoShape) -> Setup:
    """The SFT setup of a GRPO micro-step: b rows of P + C tokens, the loss on the b·C completion tokens."""
    width, loss_tokens = g.prompt_len + g.completion_len, s.micro_batch_size * g.completion_len
    loss_impl = "trl_fused_logps" if s.loss_impl == "trl_fused" else s.loss_impl
    return replace(s, max_seq_len=width, loss_tokens=loss_tokens, loss_impl=loss_impl)


def grads_alive_at_generation(s: Setup, g: GrpoShape) -> bool:
    """Rounds start every steps_per_generation micro-steps, optimizer steps every gradient_accumulation; a round
    that starts inside an optimizer step (steps_per_generation not a multiple of gradient_accumulation) generates
    beside the step's gradients and the previous round's buffered inputs (the Trainer frees the gradients after
    each optimizer step, TRL replaces the buffer only when the new round is made)."""
    spg = g.steps_per_generation or s.gradient_accumulation
    return spg % s.gradient_accumulation != 0


def old_policy_pass(s: Setup, g: GrpoShape) -> bool:
    """TRL scores the old policy when generation and optimizer steps are misaligned (grpo_trainer.py:
    `gradient_accumulation_steps % generate_every != 0`); otherwise it reuses the training pass's log-probs."""
    return s.gradient_accumulation % (g.steps_per_generation or s.gradient_accumulation) != 0


def _adapter_cast(arch: Architecture, s: Setup, g: GrpoShape) -> tuple[float, float]:
    """(parameter bytes, step temporaries) a QLoRA adapter gives back under GRPOTrainer: for a quantized model TRL
    casts every trainable parameter but DoRA's magnitudes to bf16 (grpo_trainer.py `__init__`, after the "ref"
    adapter is copied, so that copy stays fp32): A and B and their gradients take 2 B per element, not peft's 4
    (measured: the live bytes after `GRPOTrainer(...)` 38,912 B under the built model's on zoo llama3, r 8 = half
    its LoRA parameters), and bitsandbytes' CPU kernel then makes the 16-bit parameter's fp32 copy too
    (`optimizer_step_temp`: one more fp32 copy of the largest tensor)."""
    if s.adapter != "lora" or s.quantization == "none" or not g.adapter_bf16:
        return 0.0, 0.0
    cast: list[tuple[int, int]] = []
    for x in lora_linears(arch, s):
        cast += [(s.lora_r * x.in_features, 2), (x.out_features * s.lora_r, 2)] * arch.num_layers
        cast += [(x.out_features, 4)] * arch.num_layers if s.use_dora else []
    saved = sum(n * 2 for n, e in cast if e == 2)  # 4 B → 2 B per element of A and B
    fp32 = trainer_fp32_states(arch, s)
    temp = optimizer_step_temp(cast, s.optimizer, s.device, fp32)[0]
    return saved, temp - optimizer_step_temp(_trainable_tensors(arch, s), s.optimizer, s.device, fp32)[0]


def _static(arch: Architecture, s: Setup, *, grads: bool, states: bool, cast: float = 0.0) -> float:
    """The static state without SFT's batch term (GRPO holds its round instead), gradients and states as alive;
    `cast`: the bytes a bf16 adapter gives back per copy (`_adapter_cast`)."""
    est = estimate(arch, s)
    by = est.by_name()
    static = est.phases["static"] - sum(b for n, b in by.items() if n.startswith("batch"))
    static -= 0.0 if grads else by["gradients"]
    static -= 0.0 if states else sum(b for n, b in by.items() if n.startswith("optimizer states"))
    return static - cast * (2 if grads else 1)


def reference_copy_bytes(arch: Architecture, s: Setup, g: GrpoShape) -> float:
    """What beta > 0 keeps for the reference, alive through every phase. Full fine-tuning: a frozen copy of the
    model (TRL `create_model_from_path`). LoRA: a frozen copy of the adapter — `train` hands TRL a PeftModel, and
    GRPOTrainer then adds a "ref" adapter with the default one's weights (grpo_trainer.py `__init__`:
    `model.add_adapter("ref", ...)`, the parameters copied, in their fp32 dtype), the reference pass runs with it
    (`use_adapter(model, "ref")`). Measured: the live bytes before the first generation grow by exactly the LoRA
    parameters' bytes with beta 0.04 (77,824 B on zoo llama3, r 8; devkit/harness/grpo.py)."""
    if g.beta <= 0:
        return 0.0
    if s.adapter == "lora":
        return estimate(arch, s).by_name()["LoRA parameters (fp32)"]
    linears, rest, _ = weight_bytes(arch, replace(s, adapter="lora", lora_targets=()))
    return linears + rest


def round_bytes(arch: Architecture, s: Setup, g: GrpoShape) -> float:
    """The round's buffered inputs, alive from generation's end to the round's last micro-step."""
    rows, width = g.rows(s), g.prompt_len + g.completion_len
    logps = 4 * rows * g.completion_len * (int(old_policy_pass(s, g)) + int(g.beta > 0))
    return GRPO_ROUND_BYTES_PER_TOKEN * rows * width + logps


def generation_terms(arch: Architecture, s: Setup, g: GrpoShape) -> dict[str, float]:
    """The generation phase's transient terms above the static state (CPU form: no device overheads): the decode's
    (KV cache, ids, sampling) at the last token, and the prefill's one layer over the R·P prompt tokens."""
    c, h, i = DTYPE_BYTES[s.compute_dtype], arch.hidden_size, arch.intermediate_size
    rows, p, width = g.rows(s), g.prompt_len, g.prompt_len + g.completion_len
    kv = round_kv_bytes(arch, width - 1, c, rows)  # the last sampled token is never fed back
    prompts = GRPO_PROMPT_BYTES_PER_TOKEN * rows * p  # TRL's prompt tensors, alive through `generate`
    ids = GRPO_IDS_BYTES_PER_TOKEN * rows * width + prompts
    v = arch.vocab_size
    sampling = (c + 4 * GRPO_SAMPLING_FP32_PER_VOCAB) * v * rows + 4 * GRPO_SAMPLING_FP32_VOCAB_FIXED * v
    ps = replace(s, micro_batch_size=rows, max_seq_len=p, gradient_checkpointing=False, lora_dropout=0.0)
    lora_mlp = s.adapter == "lora" and any(is_mlp_linear(arch, x) for x in lora_linears(arch, ps))
    per_token = eval_mlp_bytes(arch, ps) + c * i + GRPO_PREFILL_HIDDEN * c * h + 2 * c * arch.head_dim
    # peft's fp32 cast of the layer input (4·h); under QLoRA TRL's bf16 adapter needs no cast, and lora_B's output and
    # its scaled copy are c-byte, not fp32 (measured: 1,024 B per prompt token less at h 64, i 192 = 4·i + 4·h)
    bf16_adapter = _adapter_cast(arch, s, g)[0] > 0
    per_token += (0 if bf16_adapter else 4 * h) - (2 * (4 - c) * i if bf16_adapter else 0) if lora_mlp else 0
    dequant = c * max(x.in_features * x.out_features for x in arch.linears) if s.quantization != "none" else 0.0
    layer = per_token * ps.tokens
    if (
        effective_setup(arch, s)[0].attn_implementation == "eager"
    ):  # the attention moment: its fp32 scores over the R·P² pairs, per head
        scores = 4 * GRPO_EAGER_PREFILL_SCORES * arch.num_heads * rows * p * p
        layer = max(layer, (per_token - c * h) * ps.tokens + scores)
    prefill = layer + dequant + attention_mask_bytes(arch, ps) + prompts  # generate's ids are TRL's
    return {"KV cache": kv, "ids and masks": ids, "logits and sampling": sampling, "prefill": prefill}


def round_kv_bytes(arch: Architecture, tokens: int, c: int, rows: int) -> float:
    """The round's KV cache after `tokens` cached tokens: a sliding-window layer keeps at most its window
    (transformers cache_utils.py `DynamicSlidingWindowLayer.update`: the last window − 1 tokens, a view of the
    window-token concatenation), every other layer all of them."""
    sliding = arch.sliding_layers if arch.sliding_window else 0
    per_layer = kv_cache_bytes(arch, 1, c, rows) / arch.num_layers
    window = min(tokens, arch.sliding_window or tokens)
    return per_layer * ((arch.num_layers - sliding) * tokens + sliding * window)


def _eval_static(arch: Architecture, s: Setup) -> float:
    """What `eval_peak_bytes` counts beside its transient: static without gradients, and its batch tensors."""
    est = estimate(arch, s)
    by = est.by_name()
    batch = BATCH_BYTES_PER_TOKEN * s.tokens * (2 if s.device == "cpu" else 1)
    return est.phases["static"] - by["gradients"] + batch


def _sft_phase(arch: Architecture, s: Setup, phase: str, *, grads: bool, states: bool) -> float:
    """`estimate.phase_peak_bytes` on either device: live tensor bytes, no device overheads."""
    if s.device == "cpu":
        return phase_peak_bytes(arch, s, phase, grads=grads, states=states)  # type: ignore[arg-type]
    est, by = estimate(arch, s), estimate(arch, s).by_name()
    absent = 0.0 if states else sum(b for n, b in by.items() if n.startswith("optimizer states"))
    absent += by["gradients"] if not grads and phase == "forward" else 0.0
    return est.phases[phase] - absent


def _scoring_transient(arch: Architecture, s: Setup, rows: int) -> float:
    """A no-grad pass's transient above its static state, without device overheads (`eval_peak_bytes` adds them:
    context, workspaces and the allocator's term, taken back out here)."""
    transient = eval_peak_bytes(arch, s, rows) - _eval_static(arch, s)
    return transient_without_overheads(s, transient, block=eval_allocator_block(arch, s, rows))


def first_backward_relief(arch: Architecture, ts: Setup) -> float:
    """What the backward of an optimizer step's first micro-step peaks below the estimate's backward: it starts with
    no gradients (the Trainer set them to None at the last step), and when its peak is the loss's backward, at its
    start, none exists yet — the layers' moment and the end (every gradient made) stay as estimated. Matters with
    gradient_accumulation 1, where every backward is a first one (measured: grid points at ga 1 over-predicted by
    exactly the gradients, 771,200 B of 759,228 on a zoo Gemma-2 full fine-tune; devkit/bench/grpo_grid.py)."""
    est = estimate(arch, ts)
    c, h = DTYPE_BYTES[ts.compute_dtype], arch.hidden_size
    end = est.phases["static"] + (2 * c * arch.vocab_size * h if ts.adapter == "full" else 0.0) + c * h * ts.tokens
    others = max(layer_moments(arch, est)[1], end)
    return max(0.0, min(est.by_name()["gradients"], est.phases["backward"] - others))


def phase_peaks(arch: Architecture, s: Setup, g: GrpoShape, *, states: bool = True) -> dict[str, float]:
    """Live tensor bytes at the peak of each phase of a GRPO step (what `PeakMemory` measures on the CPU; no device
    overheads on CUDA: `grpo_plan.grpo_estimate`), for `s` = the run's SFT setup (micro_batch_size = b completions).
    `states`: the optimizer states exist yet (not before the first optimizer step)."""
    ts = training_setup(s, g)
    ref = reference_copy_bytes(arch, s, g)
    held = round_bytes(arch, s, g)
    no_batch = sum(b for n, b in estimate(arch, ts).by_name().items() if n.startswith("batch"))
    terms = generation_terms(arch, s, g)
    gen_static = _static(
        arch, ts, grads=grads_alive_at_generation(s, g), states=states, cast=_adapter_cast(arch, s, g)[0]
    )
    decode = terms["KV cache"] + terms["ids and masks"] + terms["logits and sampling"]
    previous = 0.0 if g.frees_spent_round else held  # the spent round, from the second round on
    out = {"generation": gen_static + ref + previous + max(decode, terms["prefill"])}
    if old_policy_pass(s, g) or g.beta > 0:
        score_s = replace(ts, gradient_checkpointing=False)
        scoring = _scoring_transient(arch, score_s, s.micro_batch_size)
        # beside the previous round's buffer: this round's ids and masks, and their concatenation the passes read
        # (`prompt_completion_ids`, `attention_mask`: ids and mask per row-token)
        current = held + GRPO_IDS_BYTES_PER_TOKEN * g.rows(s) * (g.prompt_len + g.completion_len)
        scoring_static = _static(
            arch, ts, grads=grads_alive_at_generation(s, g), states=states, cast=_adapter_cast(arch, s, g)[0]
        )
        out["scoring"] = scoring_static + ref + previous + current
        out["scoring"] += scoring
    for phase in ("forward", "backward", "optimizer step"):
        # a forward after the first of an optimizer step's micro-steps runs beside the gradients: the phase's peak
        grads = phase != "forward" or s.gradient_accumulation > 1 or grads_alive_at_generation(s, g)
        alive = states or phase == "optimizer step"  # the first step makes the states: they exist at its end
        base = _sft_phase(arch, ts, phase, grads=grads, states=alive)
        if phase == "backward" and s.gradient_accumulation == 1:
            base -= first_backward_relief(arch, ts)
        cast, cast_temp = _adapter_cast(arch, s, g)
        base -= cast * (2 if grads or phase != "forward" else 1)
        base += cast_temp if phase == "optimizer step" else 0.0
        out[phase] = base - no_batch + held + ref
    return out


def peak_phase(peaks: dict[str, float]) -> str:
    """The phase that sets the step's peak."""
    return max(peaks, key=lambda k: peaks[k])


def describe_phases(peaks: dict[str, float]) -> list[str]:
    """The plan's lines: each phase's peak in the order the step runs them, the largest marked (for
    `plan --method grpo` once it is wired)."""
    top = peak_phase(peaks)
    return [
        f"{phase:<15} {human(peaks[phase])}" + ("   ← peak" if phase == top else "")
        for phase in PHASES
        if phase in peaks
    ]
