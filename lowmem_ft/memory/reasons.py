"""The plan's reason lines: why the planner chose each knob's value (quantization, adapter, optimizer,
checkpointing, offloading, the chunked loss, the micro batch and accumulation), and the evaluation batch with its line.

One idea: a line says what decided the value — the user (`--set`), the recipe, or what did not fit without it — so
`plan` explains itself. The long-context savers' lines are `lowmem_ft.memory.long_context.saver_reasons`.
"""

from __future__ import annotations

from typing import Protocol

from lowmem_ft.memory.arch import Architecture
from lowmem_ft.memory.estimate import GB, Setup, eval_peak_bytes
from lowmem_ft.memory.preference import rows_per_micro_batch
from lowmem_ft.memory.target import Target


class Request(Protocol):
    """What the reasons read of the planner's `Request` (`lowmem_ft.memory.planner`, which imports this module)."""

    start: Setup
    target: Target
    gradient_accumulation: int
    eval_batch_size: int
    fixed: frozenset[str]
    length_reason: str
    loss_by: str


def knob_reasons(
    request: Request, s: Setup, accumulation: int, fits_16bit: bool, savers: dict[str, str]
) -> dict[str, str]:
    """One line per knob, the long-context savers' (`savers`) after the chunked loss's."""
    start, fixed = request.start, request.fixed

    def why(key: str, text: str) -> str:
        if key == "loss_impl" and request.loss_by:  # fixed by the method's trainer, not by the user
            state = "on" if s.loss_impl == "chunked" else "off"
            return (
                f"{state}, as the recipe has it: --method {request.loss_by}'s loss is its TRL trainer's (not planned)"
            )
        return "set by you (--set)" if key in fixed else text

    if s.adapter == "full":
        quantization = "none: full fine-tuning trains the 16-bit weights themselves"
    elif s.quantization == "none":
        quantization = "16-bit weights fit: fastest"
    elif not fits_16bit:
        quantization = f"{s.quantization}: 16-bit weights do not fit"
    else:
        quantization = f"{s.quantization}: 16-bit fits only with slower savings"
    # the planner speaks rows; a paired method's recipe speaks pairs, two rows each (`memory.preference`)
    per = rows_per_micro_batch(getattr(request, "method", "sft"), 1)  # type: ignore[arg-type]
    unit = " pairs" if per > 1 else ""
    eff = s.micro_batch_size * accumulation // per
    batch = f"accumulation {accumulation} keeps the effective batch {eff}{unit}"
    if "gradient_accumulation" in fixed:
        wanted = start.micro_batch_size * request.gradient_accumulation // per
        batch = f"accumulation {accumulation} (set by you) " + (
            f"keeps the effective batch {eff}{unit}"
            if eff == wanted
            else f"makes the effective batch {eff}{unit}, not {wanted}"
        )
    micro = f"{s.micro_batch_size // per} pairs ({s.micro_batch_size} rows)" if per > 1 else f"{s.micro_batch_size}"
    chunked = s.loss_impl == "chunked"
    return {
        "quantization": why("quantization", quantization),
        "adapter": f"{s.adapter}"
        + (f", rank {s.lora_r} from the recipe" if s.adapter == "lora" else " fine-tuning (recipe)"),
        "optimizer": why(
            "optimizer",
            f"{s.optimizer}" + (" (from the recipe)" if s.optimizer == start.optimizer else ": smaller states needed"),
        ),
        "gradient_checkpointing": why(
            "gradient_checkpointing",
            "on: activations of all layers do not fit" if s.gradient_checkpointing else "off: activations fit",
        ),
        "activation_offloading": why(
            "activation_offloading",
            "on: checkpointed layer inputs do not fit on the device" if s.activation_offloading else "off: not needed",
        ),
        "chunked_loss": "off: the model's own loss over full logits (memory.full_logits_loss"
        + (", set by you)" if "loss_impl" in fixed else ")")
        if s.loss_impl == "hf_full" and not request.loss_by
        else why("loss_impl", "on: needed to fit" if chunked else "off: the loss fits without it"),
        **savers,
        "micro_batch_size": why("micro_batch_size", f"{micro}: largest that fits with the fewest savings; {batch}"),
        "max_seq_len": request.length_reason or f"{s.max_seq_len} tokens",
    }


def choose_eval_batch(arch: Architecture, request: Request, s: Setup) -> tuple[int, str]:
    """The largest of 8×, 4×, 2×, 1× the micro batch (at most 64) whose eval forward fits the budget — evaluation
    keeps no activations for backward, so it can batch wider than training."""
    if "eval_batch_size" in request.fixed and request.eval_batch_size:
        return request.eval_batch_size, f"{request.eval_batch_size} (set by you)"
    b = s.micro_batch_size
    if request.target.gpus > 1:
        return b, f"{b}: the micro batch (per-device eval planning is not modelled for sharded runs)"
    need = {n: eval_peak_bytes(arch, s, n) / GB for n in {min(64, b * f) for f in (8, 4, 2, 1)}}
    chosen = max((n for n, gb in need.items() if gb <= request.target.budget_gb), default=b)
    return chosen, f"{chosen}: eval forward needs {need[chosen]:.2f} GB (no gradients or saved activations)"


def frozen_experts_note(arch: Architecture) -> str:
    """The adapter line's note on a mixture of experts: LoRA goes on its nn.Linear layers, the experts stay frozen
    (lowmem_ft.train.model.adapter_modules keeps peft from turning the names into expert target_parameters)."""
    if arch.moe is None:
        return ""
    return f"; the {arch.moe.experts} experts per layer and the router stay frozen (LoRA on nn.Linear layers only)"


def partial_targets_note(arch: Architecture, targets: tuple[str, ...], adapted: list[str]) -> str:
    """The adapter line's note when some target names are not this model's (the recipes' Llama names on Phi-2 or
    StarCoder2 match the attention only): which are absent and which linears stay frozen, or "" when none is."""
    absent = [t for t in targets if t != "all-linear" and not arch.adapter_modules([t])]
    frozen = [name for name in arch.linear_names if name not in adapted]
    if not absent or not frozen:
        return ""
    return (
        f"; adapts {', '.join(adapted)} only: {', '.join(absent)} are absent, so {', '.join(frozen)} stay frozen "
        "(--set adapter.target_modules=all-linear adapts them too)"
    )
