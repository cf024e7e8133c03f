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
the R rows; the per-token old / reference log-probs, fp32) stay alive; SFT's batch term (its micro batches held for
accumulation) is replaced by them.

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
    GRPO_IDS_BYTES_PER_TOKEN,
    GRPO_PREFILL_HIDDEN,
    GRPO_ROUND_BYTES_PER_TOKEN,
    GRPO_SAMPLING_FP32_PER_VOCAB,
    GRPO_SAMPLING_FP32_VOCAB_FIXED,
)
from lowmem_ft.memory.estimate import DTYPE_BYTES, Setup, estimate, eval_peak_bytes, phase_peak_bytes
from lowmem_ft.memory.evaluation import eval_mlp_bytes
from lowmem_ft.memory.inference import human, kv_cache_bytes
from lowmem_ft.memory.linears import is_mlp_linear, lora_linears
from lowmem_ft.memory.static import weight_bytes

PHASES = ("generation", "scoring", "forward", "backward", "optimizer step")


@dataclass(frozen=True)
class GrpoShape:
    """What a GRPO round is made of, beside the SFT setup (whose micro_batch_size is b, completions per micro-step)."""

    prompt_len: int  # P: the round's longest prompt (prompts are left-padded to it)
    completion_len: int  # C: max_completion_length
    num_generations: int = 8  # G: completions per prompt
    steps_per_generation: int | None = None  # micro-steps one round covers; None: gradient_accumulation (TRL)
    beta: float = 0.0  # > 0: a reference pass (TRL's default is 0)

    def rows(self, s: Setup) -> int:
        """R: completions one generation round makes (TRL's generation_batch_size)."""
        return s.micro_batch_size * (self.steps_per_generation or s.gradient_accumulation)


def method_setup(s: Setup) -> Setup:
    """The SFT setup of a GRPO run's policy: no dropout (lowmem-ft sets TRL's `disable_dropout`: the scoring and
    training passes must see the same weights) and TRL's own loss (`_get_per_token_logps_and_entropies`)."""
    return replace(s, lora_dropout=0.0, loss_impl="trl_fused")


def training_setup(s: Setup, g: GrpoShape) -> Setup:
    """The SFT setup of a GRPO micro-step: b rows of P + C tokens, the loss on the b·C completion tokens."""
    return replace(s, max_seq_len=g.prompt_len + g.completion_len, loss_tokens=s.micro_batch_size * g.completion_len)


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


def _static(arch: Architecture, s: Setup, *, grads: bool, states: bool) -> float:
    """The static state without SFT's batch term (GRPO holds its round instead), gradients and states as alive."""
    est = estimate(arch, s)
    by = est.by_name()
    static = est.phases["static"] - sum(b for n, b in by.items() if n.startswith("batch"))
    static -= 0.0 if grads else by["gradients"]
    static -= 0.0 if states else sum(b for n, b in by.items() if n.startswith("optimizer states"))
    return static


def reference_copy_bytes(arch: Architecture, s: Setup, g: GrpoShape) -> float:
    """Full fine-tuning with beta > 0 loads a frozen copy of the model (TRL `create_model_from_path`)."""
    if g.beta <= 0 or s.adapter != "full":
        return 0.0
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
    kv = kv_cache_bytes(arch, width - 1, c, rows)  # the last sampled token is never fed back
    ids = GRPO_IDS_BYTES_PER_TOKEN * rows * width
    v = arch.vocab_size
    sampling = (c + 4 * GRPO_SAMPLING_FP32_PER_VOCAB) * v * rows + 4 * GRPO_SAMPLING_FP32_VOCAB_FIXED * v
    ps = replace(s, micro_batch_size=rows, max_seq_len=p, gradient_checkpointing=False, lora_dropout=0.0)
    lora_mlp = s.adapter == "lora" and any(is_mlp_linear(arch, x) for x in lora_linears(arch, ps))
    per_token = eval_mlp_bytes(arch, ps) + c * i + GRPO_PREFILL_HIDDEN * c * h + 2 * c * arch.head_dim
    per_token += 4 * h if lora_mlp else 0
    dequant = c * max(x.in_features * x.out_features for x in arch.linears) if s.quantization != "none" else 0.0
    prefill = per_token * ps.tokens + dequant + attention_mask_bytes(arch, ps) + GRPO_IDS_BYTES_PER_TOKEN * rows * p
    return {"KV cache": kv, "ids and masks": ids, "logits and sampling": sampling, "prefill": prefill}


def _eval_static(arch: Architecture, s: Setup) -> float:
    """What `eval_peak_bytes` counts beside its transient: static without gradients, and its batch tensors."""
    est = estimate(arch, s)
    by = est.by_name()
    batch = BATCH_BYTES_PER_TOKEN * s.tokens * (2 if s.device == "cpu" else 1)
    return est.phases["static"] - by["gradients"] + batch


def phase_peaks(arch: Architecture, s: Setup, g: GrpoShape, *, states: bool = True) -> dict[str, float]:
    """Live tensor bytes at the peak of each phase of a GRPO step (the CPU form, what `PeakMemory` measures), for
    `s` = the run's SFT setup (micro_batch_size = b completions). `states`: the optimizer states exist yet (not
    before the first optimizer step)."""
    ts = training_setup(s, g)
    ref = reference_copy_bytes(arch, s, g)
    held = round_bytes(arch, s, g)
    no_batch = sum(b for n, b in estimate(arch, ts).by_name().items() if n.startswith("batch"))
    terms = generation_terms(arch, s, g)
    gen_static = _static(arch, ts, grads=grads_alive_at_generation(s, g), states=states)
    decode = terms["KV cache"] + terms["ids and masks"] + terms["logits and sampling"]
    previous_round = held if grads_alive_at_generation(s, g) else 0.0
    out = {"generation": gen_static + ref + previous_round + max(decode, terms["prefill"])}
    if old_policy_pass(s, g) or g.beta > 0:
        score_s = replace(ts, gradient_checkpointing=False)
        scoring = eval_peak_bytes(arch, score_s, s.micro_batch_size) - _eval_static(arch, score_s)
        out["scoring"] = _static(arch, ts, grads=grads_alive_at_generation(s, g), states=states) + ref + held
        out["scoring"] += scoring
    for phase in ("forward", "backward", "optimizer step"):
        # a forward after the first of an optimizer step's micro-steps runs beside the gradients: the phase's peak
        grads = phase != "forward" or s.gradient_accumulation > 1 or grads_alive_at_generation(s, g)
        alive = states or phase == "optimizer step"  # the first step makes the states: they exist at its end
        base = phase_peak_bytes(arch, ts, phase, grads=grads, states=alive)  # type: ignore[arg-type]
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
