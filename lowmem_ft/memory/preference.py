"""What preference training adds to a step's memory, and which reference a run uses: pure arithmetic (no torch).

The one idea: a preference step is an SFT step over more rows plus, for DPO and KTO, a reference pass. So the terms
are the SFT memory model's (`lowmem_ft.memory.estimate`) at the method's rows, and a reference pass on top of what
the policy's forward keeps:

- rows per micro batch (`rows_per_micro_batch`): DPO, ORPO and SimPO stack the chosen and the rejected rows
  (TRL 1.16 `DataCollatorForPreference`: `prompt_chosen_ids + prompt_rejected_ids`, one forward of 2·B rows); KTO's
  forward is its B completions — its KL estimate's B mismatched rows (the completions rotated by one within the
  batch) run apart, without gradients, before it (`kto_trainer.py` `_compute_kl_logps`), never beside the
  policy's saved tensors.
- the policy's forward and backward: `estimate` at those rows, every row padded to the longest of the micro batch
  (the pairs were fitted to max_seq_len before batching, `lowmem_ft.data.preference`).
- the reference pass (`reference_pass_bytes`): TRL's `_compute_loss` runs it after the policy's forward, under
  `torch.no_grad()` and with checkpointing switched off (`disable_gradient_checkpointing`), while the policy's saved
  activations, its fused head's saved tensors and its per-token log-probabilities are alive. Without autograd nothing
  outlives its layer: its working set is an evaluation forward's over the same rows (`eval_peak_bytes`' transient:
  one layer in flight, or the head's forward — never both). So the forward phase peaks at the larger of the
  policy's own forward peak and (what the policy keeps + the reference pass).
- the reference weights (`reference_weight_bytes`): none with a LoRA adapter (the base model with the adapter
  disabled); for a full fine-tune, a frozen copy of the model in its storage dtype (TRL's `create_model_from_path`
  with the policy's dtype and quantization config), or nothing during training when the reference log-probs are
  precomputed (one no-grad pass over the data before training: its peak is an evaluation forward's; 2 fp32 numbers
  per pair kept in the dataset, host RAM).
- ORPO and SimPO need no reference. TRL 1.16 keeps them in `trl.experimental` (`ORPOTrainer`, `CPOTrainer` with
  `loss_type="simpo"`), whose `concatenated_forward` materialises the full logits of the 2·B rows: the `hf_full`
  loss of the SFT model, not the fused head, with the loss's own working set in the backward window
  (`odds_ratio_loss_shift`: TRL's `selective_log_softmax`, and ORPO's NLL over the chosen half).
- the planner scores `method_estimate` (these terms as components of the estimate, on any device); a CPU run's
  monitor compares with `phase_peak` (the same terms per phase).

Measured: the exact CPU count of TRL's own steps per method, loss type, adapter, reference and checkpointing on
Llama-3, Qwen2.5, Gemma-2, Phi-3 and Mistral (`python -m devkit.bench.estimator_preference`,
benchmarks/estimator_preference.md), and of real runs through `train` (`lowmem_ft.train.measure.exact`, docs/methods.md,
"Preference training").
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from lowmem_ft.memory.activations import head_saved_bytes
from lowmem_ft.memory.arch import Architecture
from lowmem_ft.memory.calibration import (
    BATCH_BYTES_PER_TOKEN,
    HF_LOSS_BYTES_PER_LOGIT,
    HF_LOSS_FORWARD_BYTES_PER_LOGIT,
    IS_TOP1_TILE_BYTES,
    ODDS_RATIO_16BIT_LOGIT_COPIES,
    ORPO_NLL_COPIES,
    SOFTCAP_LOGIT_COPIES,
    TRL_TOKEN_CHUNK,
    TRL_VOCAB_CHUNK,
)
from lowmem_ft.memory.estimate import estimate, phase_peak_bytes
from lowmem_ft.memory.evaluation import eval_allocator_block, eval_peak_bytes
from lowmem_ft.memory.overheads import device_overheads, overhead_bytes, transient_without_overheads
from lowmem_ft.memory.records import DTYPE_BYTES, Component, Estimate, Setup
from lowmem_ft.memory.sharding import DeviceShare
from lowmem_ft.memory.static import weight_bytes

Method = Literal["sft", "dpo", "orpo", "simpo", "kto"]
ReferenceKind = Literal["none", "adapter_disabled", "copy", "precomputed"]
PAIRED = ("dpo", "orpo", "simpo")
WITH_REFERENCE = ("dpo", "kto")


# TRL 1.16 kto_trainer.py `KTOTrainer.__init__`: with its KL term (the default loss) "Actual (not effective) batch
# size must be > 1" — the KL estimate pairs each completion with another of the same micro batch, so one alone
# makes the KL term equal the implied reward. Per device: `per_device_train_batch_size`.
KTO_LEAST_MICRO_BATCH = 2


def least_micro_batch(method: str) -> int:
    """The smallest micro batch per device (pairs, completions) the method's trainer accepts."""
    return KTO_LEAST_MICRO_BATCH if method == "kto" else 1


def least_rows(method: str) -> int:
    """`least_micro_batch` in rows, the planner's unit (`planner._options`: it never tries fewer)."""
    return rows_per_micro_batch(method, least_micro_batch(method))  # type: ignore[arg-type]


def micro_batch_problem(method: str, micro_batch: int, where: str) -> str | None:
    """The method's rule on `memory.micro_batch_size` (`where`: how the user set it), or None when it holds."""
    least = least_micro_batch(method)
    if micro_batch >= least:
        return None
    return (
        f"--method {method} needs memory.micro_batch_size of at least {least} per device, got {micro_batch} "
        f"({where}): TRL's KTOTrainer estimates its KL term from the other completions of a micro batch; "
        f"set --set memory.micro_batch_size={least}, or drop the setting and give --vram to let the planner choose"
    )


def rows_per_micro_batch(method: Method, micro_batch: int) -> int:
    """Rows one forward runs for a micro batch of `micro_batch` pairs (or KTO completions)."""
    # KTO's KL batch runs apart, without gradients, before the policy's forward: its forward has B rows
    return micro_batch if method in ("sft", "kto") else 2 * micro_batch


def method_setup(method: Method, s: Setup) -> Setup:
    """The SFT setup of the policy's forward and backward for `method`, `s.micro_batch_size` being pairs: the rows
    stacked, no dropout (TRL's preference configs default `disable_dropout=True`), and ORPO / SimPO's full logits."""
    if method == "sft":
        return s
    out = replace(s, micro_batch_size=rows_per_micro_batch(method, s.micro_batch_size), lora_dropout=0.0)
    if method in ("orpo", "simpo"):
        out = replace(out, loss_impl="hf_full")
    return out


def reference_pass_bytes(arch: Architecture, rows_setup: Setup) -> float:
    """The reference forward's working set above what is alive before it, for a micro batch of
    `rows_setup.micro_batch_size` rows: an evaluation forward's transient (`eval_peak_bytes` without its static
    memory and its batch tensors, which the training step holds already)."""
    s = replace(rows_setup, gradient_checkpointing=False)
    train = estimate(arch, s)
    static = sum(c.bytes for c in train.components if c.phase == "static" and c.name != "gradients")
    batch = BATCH_BYTES_PER_TOKEN * s.tokens * (2 if s.device == "cpu" else 1)
    transient = eval_peak_bytes(arch, s, s.micro_batch_size) - static
    # eval_peak_bytes' own: context, workspaces, allocator
    transient = transient_without_overheads(s, transient, block=eval_allocator_block(arch, s, s.micro_batch_size))
    return max(0.0, transient - batch)


def policy_kept_bytes(arch: Architecture, rows_setup: Setup) -> float:
    """What the policy's forward keeps for backward when the reference pass starts (above static memory): the
    forward's peak minus its largest transient is not exposed by `estimate`, so it is bounded from its parts —
    the head's saved tensors and the per-token log-probabilities (fp32) of every row, plus the layers' saved
    activations as the backward peak holds them (the backward's peak minus its own gradient buffers and loss)."""
    est = estimate(arch, rows_setup)
    by = est.by_name()
    t = rows_setup.tokens
    head = head_saved_bytes(arch, rows_setup) * t
    layers = by.get("activations, all layers", 0.0) + by.get("checkpointed layer inputs", 0.0)
    layers += by.get("attention masks (s², bool)", 0.0)
    return layers + head + 4 * t


def reference_kind(method: Method, adapter: str, given: str = "auto") -> ReferenceKind:
    """The reference a run uses: none for SFT, ORPO, SimPO; for DPO (and KTO) `preference.reference`, where auto is
    the adapter disabled (LoRA) or log-probs precomputed before training (full fine-tuning: `choose_reference`)."""
    if method not in WITH_REFERENCE:
        return "none"
    if adapter == "lora":
        return "adapter_disabled" if given in ("auto", "adapter_disabled") else given  # type: ignore[return-value]
    return "precomputed" if given in ("auto", "adapter_disabled") else given  # type: ignore[return-value]


def reference_weight_bytes(arch: Architecture, s: Setup, kind: ReferenceKind) -> float:
    """Device bytes of the reference model itself: a frozen copy of the weights for `copy` (full fine-tuning)."""
    if kind != "copy":
        return 0.0
    linears, rest, _ = weight_bytes(arch, replace(s, adapter="lora", lora_targets=()))
    return linears + rest


def device_phases(arch: Architecture, device_est: Estimate) -> dict[str, float]:
    """The phase peaks of a per-device estimate (`sharding.device_estimate`, which keeps none): the single-device
    phases with the device's static state in place of the whole model's — the transients are per device already
    (the micro batch is); adapter.init's start-up moment comes before the model is divided and stays whole. FSDP2's
    estimate keeps its own phases (`sharding.fsdp2_phases`: what it gathers differs by phase), returned as they are."""
    if device_est.phases:
        return dict(device_est.phases)
    one = estimate(arch, device_est.setup)
    shift = sum(c.bytes for c in device_est.components if c.phase == "static") - one.phases["static"]
    return {name: b if name == "start-up" else b + shift for name, b in one.phases.items()}


def reference_share_bytes(arch: Architecture, s: Setup, kind: ReferenceKind, share: DeviceShare | None) -> float:
    """A reference copy's bytes on one device. TRL 1.16 wraps the copy like the policy (`DPOTrainer.__init__`:
    `prepare_fsdp` under FSDP, `prepare_deepspeed` under ZeRO-3, which keeps stage 3 and drops it to 0 otherwise;
    `accelerator.prepare_model(evaluation_mode=True)` else): divided by N and one layer gathered at a time under full
    sharding (FSDP, ZeRO-3), whole on every device under DDP, ZeRO-1/2 or on one device."""
    whole = reference_weight_bytes(arch, s, kind)
    if not whole or share is None or share.strategy not in ("fsdp", "zero3"):
        return whole
    return whole / share.gpus + whole / arch.num_layers  # its shard, and one decoder layer gathered for its forward


def phase_peak(
    arch: Architecture,
    s: Setup,
    phase: str,
    *,
    method: Method,
    reference: ReferenceKind,
    grads: bool = True,
    states: bool = True,
    ddp: bool = False,
) -> float:
    """Live tensor bytes at the peak of one phase of a preference run (the CPU form), `s.micro_batch_size` being
    the rows the forward ran (the monitor sees rows, not pairs): the SFT phase peak at those rows, the reference
    pass on top of the policy's kept tensors in the forward phase, and a reference copy's weights throughout."""
    base = phase_peak_bytes(arch, s, phase, grads=grads, states=states, ddp=ddp)  # type: ignore[arg-type]
    if method in ("orpo", "simpo"):
        return base + odds_ratio_loss_shift(arch, s, phase, method)
    ref_weights = reference_weight_bytes(arch, s, reference)
    if phase != "forward":
        return base + ref_weights
    if reference in ("none", "precomputed"):
        return base + ref_weights - head_outputs_shift(arch, s, method)
    est = estimate(arch, s)
    by = est.by_name()
    static = est.phases["static"]
    static -= 0.0 if grads else by["gradients"]
    static -= 0.0 if states else sum(b for name, b in by.items() if name.startswith("optimizer states"))
    with_ref = static + policy_kept_bytes(arch, s) + reference_pass_bytes(arch, s)
    return max(base, with_ref) + ref_weights - head_outputs_shift(arch, s, method)


def head_outputs_shift(arch: Architecture, s: Setup, method: Method) -> float:
    """What the forward holds less when the trainer's fused LM head computes no `is_top1` (KTO's: its bool tile per
    fold on the CPU, IS_TOP1_TILE_BYTES); 0 for the other methods and on CUDA (Triton folds in registers)."""
    if method != "kto" or s.device != "cpu" or s.loss_impl != "trl_fused":
        return 0.0
    n = s.micro_batch_size * (s.max_seq_len - 1)
    return IS_TOP1_TILE_BYTES * min(n, TRL_TOKEN_CHUNK) * min(arch.vocab_size, TRL_VOCAB_CHUNK)


def method_estimate(
    arch: Architecture, est: Estimate, method: Method, given: str = "auto", share: DeviceShare | None = None
) -> Estimate:
    """The estimate of a preference step (`est`: the SFT estimate of the policy's rows, any device): a reference
    copy's weights in every phase, DPO / KTO's reference pass after the policy's forward (the forward peaks at the
    larger of the two), ORPO's copy of the chosen logits in the backward — each a component the plan shows — and the
    device overheads of the new transient. What the planner's search scores (`planner._estimate`), so a plan that
    fits includes them; the CPU monitor's phase peaks (`phase_peak`) are the same terms. On several devices `est` is
    the per-device estimate (`sharding.device_estimate`) and `share` its strategy: the reference pass is per device
    (the micro batch is), and a reference copy is divided like the policy's weights (`reference_share_bytes`)."""
    s = est.setup
    if method == "sft":
        return est
    kind = reference_kind(method, s.adapter, given)
    comps = [c for c in est.components if c.phase != "overhead"]
    phases = dict(est.phases) or device_phases(arch, est)
    ref_weights = reference_share_bytes(arch, s, kind, share)
    if ref_weights:
        comps.append(Component("reference model (frozen copy)", ref_weights, "static", "TRL create_model_from_path"))
    if kind in ("adapter_disabled", "copy"):
        at = phases["static"] + policy_kept_bytes(arch, s) + reference_pass_bytes(arch, s)
        if at > phases["forward"]:
            comps.append(Component("reference pass (no grad, after the policy's forward)", at - phases["forward"],
                                   "forward", "TRL DPOTrainer._compute_loss"))  # fmt: skip
            phases["forward"] = at
    phases["forward"] -= head_outputs_shift(arch, s, method)
    if method in ("orpo", "simpo"):  # their loss runs outside the forward, ORPO's NLL copies the chosen logits
        phases["forward"] += odds_ratio_loss_shift(arch, s, "forward", method)
        shift = odds_ratio_loss_shift(arch, s, "backward", method)
        phases["backward"] += shift
        if shift > 0:
            comps.append(Component("ORPO's NLL: chosen logits copied", shift, "backward", "experimental/orpo"))
    phases = {k: v + ref_weights for k, v in phases.items()}
    static = phases["static"]
    transient = max(phases[k] for k in ("forward", "backward", "optimizer step")) - static
    peak_phase = max(("forward", "backward", "optimizer step"), key=lambda k: phases[k])
    gradients = est.by_name().get("gradients", 0.0)
    # ORPO / SimPO's trainer keeps the logits through the backward: no hole of them (`overheads.full_logits_hole`)
    kept_logits = replace(s, loss_impl="trl_fused") if method in ("orpo", "simpo") else s
    overheads = device_overheads(kept_logits, transient, gradients, block=est.allocator_block)  # none on the CPU
    return replace(
        est,
        components=comps + overheads,
        model_peak_bytes=static + transient,
        overhead_bytes=overhead_bytes(overheads),
        peak_phase=peak_phase if peak_phase == "optimizer step" else "forward/backward",
        phases=phases,
    )


def odds_ratio_loss_shift(arch: Architecture, s: Setup, phase: str, method: Method) -> float:
    """Where TRL's experimental ORPO / CPO trainers differ from the SFT model's full-logits loss (`hf_full`) at the
    same rows. Their loss runs outside the model's forward (`concatenated_forward` takes `outputs.logits`), so the
    forward phase holds the c-byte logits only, not the loss's fp32 working set (HF_LOSS_FORWARD_BYTES_PER_LOGIT); the
    loss's forward falls in the backward's window. For fp32 logits that window holds `hf_full`'s backward count
    and the logits, which the trainer keeps (c + 12 bytes; the SFT count leaves the logits out, as Trainer drops
    them); 16-bit logits take `selective_log_softmax`'s row-by-row path, ~2 c-byte copies instead
    (ODDS_RATIO_16BIT_LOGIT_COPIES). ORPO adds its NLL over the chosen half (ORPO_NLL_COPIES); Gemma-2's final-logit
    softcapping keeps tanh's output (SOFTCAP_LOGIT_COPIES). Measured (exact CPU,
    LoRA fp32, Qwen2.5 zoo V 2,688, 8 rows × 160): ORPO forward 31.71 MB / backward 79.24 MB, SimPO 31.71 / 72.40 —
    16.9 and 14.9 B per logit in the backward beyond the kept tensors, against c + 12 = 16; bf16: the grid in
    benchmarks/estimator_preference.md."""
    n = s.micro_batch_size * (s.max_seq_len - 1) * arch.vocab_size
    c = DTYPE_BYTES[s.compute_dtype]
    softcap = SOFTCAP_LOGIT_COPIES * c * n if arch.final_logit_softcapping else 0.0  # tanh's saved output
    if phase == "forward":
        return softcap - HF_LOSS_FORWARD_BYTES_PER_LOGIT * n
    if phase != "backward":
        return 0.0
    wide = s.compute_dtype == "float32"
    shift = (c if wide else ODDS_RATIO_16BIT_LOGIT_COPIES * c - HF_LOSS_BYTES_PER_LOGIT) * n
    if method == "orpo":
        shift += ORPO_NLL_COPIES["float32" if wide else "16bit"] * c * n
    return shift + softcap


@dataclass(frozen=True)
class ReferenceChoice:
    """The reference a run uses, what it costs, and why it was chosen."""

    kind: ReferenceKind
    device_bytes: float  # reference weights on the device during training
    host_bytes: float  # precomputed log-probs kept with the data
    extra_passes: float  # no-grad forwards over the data, in units of one pass
    why: str


def choose_reference(
    arch: Architecture,
    s: Setup,
    method: Method,
    *,
    given: str = "auto",
    pairs: int | None = None,
    budget_bytes: float | None = None,
    policy_peak_bytes: float = 0.0,
) -> ReferenceChoice:
    """The reference a run uses (`reference_kind`, the one `train` builds), what it costs, and why: LoRA → the base
    model with the adapter disabled (no copy); full fine-tuning → log-probs precomputed in one no-grad pass over the
    data (no device memory during training, 8 B per pair of host RAM), or a frozen copy when
    `preference.reference=copy` (its weights on the device, one more forward per step). Both cost one reference
    forward per pair seen; precomputing does it once per pair, so auto precomputes: never slower over an epoch, and
    the copy's memory stays free."""
    kind = reference_kind(method, s.adapter, given)
    if kind == "none":
        return ReferenceChoice("none", 0.0, 0.0, 0.0, f"{method} needs no reference model")
    if kind == "adapter_disabled":
        return ReferenceChoice(
            "adapter_disabled", 0.0, 0.0, 0.0,
            "LoRA: the reference is the base model with the adapter disabled (no copy, one no-grad forward per step)",
        )  # fmt: skip
    copy = reference_weight_bytes(arch, s, "copy")
    if kind == "copy":
        return ReferenceChoice(
            "copy", copy, 0.0, 0.0,
            f"a frozen copy of the model ({copy / 1e9:.2f} GB on the device, counted in the plan), as "
            "preference.reference=copy asks",
        )  # fmt: skip
    why = "preference.reference=precomputed" if given == "precomputed" else "full fine-tune (auto)"
    why = (
        f"{why}: reference log-probs precomputed in one pass before training (8 B per pair on the host); a frozen "
        f"copy would add {copy / 1e9:.2f} GB on the device"
    )
    if budget_bytes is not None and policy_peak_bytes + copy > budget_bytes:
        why += " and not fit"
    return ReferenceChoice("precomputed", 0.0, 8.0 * (pairs or 0), 1.0, why)


def lowered_length_reason(method: Method, fit: int, asked: int) -> str:
    """The plan's line for a length the planner lowered because one micro batch of the method did not fit."""
    one = "one pair (2 rows: chosen and rejected)" if method in PAIRED else "one completion"
    extra = " with the reference pass" if method in WITH_REFERENCE else ""
    return (
        f"{fit} tokens: the longest at which {one}{extra} fits; the recipe's {asked} does not (each pair is fitted "
        "to it before batching: the prompt cut first, then the answers; --seq-len fixes it)"
    )


def describe_rows(method: Method, micro_batch: int, seq_len: int) -> str:
    """The plan's line on the extra rows of a preference micro batch."""
    rows = rows_per_micro_batch(method, micro_batch)
    if method == "sft":
        return f"{rows} rows × {seq_len} tokens"
    if method == "kto":  # its KL batch (the completions rotated by one) runs apart, without gradients, before it
        return f"{rows} completions × {seq_len} tokens per forward, after a no-grad forward of their KL batch"
    pairs = f"{micro_batch} pair{'s' if micro_batch != 1 else ''}"
    return f"{pairs} = {rows} rows (chosen + rejected) × {seq_len} tokens per forward"


def plan_lines(
    arch: Architecture, s: Setup, method: Method, *, given: str = "auto", budget_bytes: float, policy_peak_bytes: float
) -> list[str]:
    """What `plan` says about a preference run (`s` in rows, as the planner planned it): the rows per micro batch,
    the reference and why, and the reference pass's working set — part of the planned peak (`method_estimate`)."""
    pairs = max(1, s.micro_batch_size // 2) if method in PAIRED else s.micro_batch_size
    lines = [f"method {method}: {describe_rows(method, pairs, s.max_seq_len)}"]
    ref = choose_reference(arch, s, method, given=given, budget_bytes=budget_bytes,
                           policy_peak_bytes=policy_peak_bytes)  # fmt: skip
    lines.append(f"reference: {ref.kind} — {ref.why}")
    if ref.kind in ("adapter_disabled", "copy"):
        lines.append(
            f"reference pass: {reference_pass_bytes(arch, s) / 1e9:.2f} GB of working set after the policy's forward "
            "(no gradients, checkpointing off), included in the planned peak"
        )
    return lines
