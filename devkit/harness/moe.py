"""Checking the memory model on mixtures of experts: real training steps on tiny random MoE models, measured exactly.

The same steps as `devkit.harness.estimator.measure` (the `train` build path, TRL's fused LM head, the Trainer's
optimizer, two optimizer steps under `PeakMemory`), with two more windows in the full-size micro-step: the decoder
layers' forward (until a forward pre-hook on the final norm) and their backward (from a backward pre-hook on the
final norm to the end). On the CPU the fused LM head's tile buffer (min(tokens, 4096) × 32,768 in the compute
dtype) is the step's peak at these sizes, so the whole-step peak alone would hide the experts' terms; the windows
compare them with the layer moments the estimate is made of (`lowmem_ft.memory.estimate.layer_moments`).
Used by `devkit/bench/estimator_moe.py` (benchmarks/estimator_moe.md) and `tests/devkit/test_harness_moe.py`.
"""

from __future__ import annotations

import gc
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devkit.harness.estimator import Point, predict, recipe_for, trainer_batches
from lowmem_ft.memory.arch import Architecture

# Tiny replicas of each supported family's MoE block (transformers 5.24 classes), widths chosen so the experts'
# per-token terms are large beside attention: top-k and expert counts as in the real models' ratios.
MOE_SHAPES: dict[str, dict[str, Any]] = {
    "mixtral": {  # Mixtral-8x7B: 8 experts, top-2, fp32 renormalised routing
        "model_type": "mixtral", "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 448,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 8,
        "num_experts_per_tok": 2,
    },
    "qwen3_moe": {  # Qwen3-30B-A3B: 128 experts, top-8, norm_topk_prob, q/k norm, head_dim ≠ h / heads
        "model_type": "qwen3_moe", "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512,
        "moe_intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 96, "num_experts": 32, "num_experts_per_tok": 8, "norm_topk_prob": True,
    },
    "qwen2_moe": {  # Qwen1.5-MoE-A2.7B: 60 experts, top-4, a shared expert, q/k/v bias
        "model_type": "qwen2_moe", "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512,
        "moe_intermediate_size": 128, "shared_expert_intermediate_size": 512, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 4, "num_experts": 15, "num_experts_per_tok": 4,
    },
    "olmoe": {  # OLMoE-1B-7B: 64 experts, top-8, q/k norm over all heads
        "model_type": "olmoe", "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "num_experts": 16,
        "num_experts_per_tok": 8,
    },
    "granitemoe": {  # Granite-3.0-1B-A400M: 32 experts, top-8, softmax over the top-k logits, multipliers, tied
        "model_type": "granitemoe", "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 16,
        "num_experts_per_tok": 8, "tie_word_embeddings": True, "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22, "attention_multiplier": 0.015625, "logits_scaling": 6.0,
    },
    "phimoe": {  # Phi-3.5-MoE: 16 experts, top-2 through the sparsemixer router (an nn.Linear), LayerNorms, biases
        "model_type": "phimoe", "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 448,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 16,
        "num_experts_per_tok": 2, "attention_bias": True, "lm_head_bias": True,
    },
}  # fmt: skip


@dataclass
class MoePoint(Point):
    windows: dict[str, tuple[float, float]] = field(default_factory=dict)  # window → (measured, predicted)


def measure(model_dir: Path, p: Point, warmup_seq: int = 8) -> dict[str, tuple[int, int]]:
    """`harness.estimator.measure` with the layers' forward and backward windows of micro-step 2.2 ("layers forward",
    "layers backward"; "head forward" and "loss backward" between them). Returns label → (peak, live at its end)."""
    import torch
    from transformers import TrainingArguments
    from trl.trainer.utils import add_fused_lm_head

    from lowmem_ft.train.measure.peak import PeakMemory, trainer_optimizer
    from lowmem_ft.train.model import build_model

    recipe = recipe_for(model_dir, p)
    torch.manual_seed(0)
    model = build_model(recipe)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    add_fused_lm_head(base, outputs=("log_probs", "entropy", "is_top1"))
    model.train()
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), optim=_optim(p.optimizer), use_cpu=True)
    optimizer = trainer_optimizer(model, args)
    trainable = [q for q in model.parameters() if q.requires_grad]
    vocab = base.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    norm = base.model.norm
    windows = {"on": False}
    with PeakMemory(roots=[model, optimizer.state]) as pm:

        def before_norm(*_):
            if windows["on"]:
                pm.mark("layers forward")

        def before_norm_backward(*_):
            if windows["on"]:
                pm.mark("loss backward")

        hooks = [
            norm.register_forward_pre_hook(before_norm),
            norm.register_full_backward_pre_hook(before_norm_backward),
        ]
        pm.mark("static")
        steps = ((1, 1), (2, 1), (2, 2))
        lengths = [p.seq if (step, micro) == (2, 2) else warmup_seq for step, micro in steps]
        for (step, micro), (ids, mask, labels) in zip(
            steps, trainer_batches(vocab, p.batch, lengths, gen), strict=True
        ):
            windows["on"] = (step, micro) == (2, 2)
            if windows["on"]:
                pm.mark("before 2.2")
            out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
            loss = -out.log_probs.sum() / out.label_mask.sum().clamp(min=1)
            pm.mark(f"forward {step}.{micro}" if not windows["on"] else "head forward")
            loss.backward()
            del out, loss
            pm.mark(f"backward {step}.{micro}" if not windows["on"] else "layers backward")
            if micro == step:
                torch.nn.utils.clip_grad_norm_(trainable, 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                pm.mark(f"optimizer {step}")
        for hook in hooks:
            hook.remove()
        phases = {m.label: (m.peak_bytes, m.live_bytes) for m in pm.marks}
        phases["peak"] = (pm.peak_bytes, pm.live_bytes)
    del model, base, optimizer, trainable, hooks
    gc.collect()
    return phases


def _optim(name: str) -> str:
    from lowmem_ft.train.args import OPTIM_NAMES

    return OPTIM_NAMES[name]


def run_point(model_dir: Path, p: Point) -> MoePoint:
    """Measure a point and compare: the whole step's peak and the layers' two windows."""
    from lowmem_ft.memory.estimate import layer_moments

    q = MoePoint(**{k: getattr(p, k) for k in ("arch", "adapter", "optimizer", "checkpointing", "batch", "seq")})
    q.phases = measure(model_dir, q)
    q.measured = q.phases["peak"][0]
    est = predict(model_dir, q)
    arch = Architecture.from_config(json.loads((model_dir / "lowmem_config.json").read_text()))
    q.predicted = est.steady_peak_bytes  # micro-step 2.2 accumulates into the gradients
    q.predicted_phases = est.phases
    fwd, bwd = layer_moments(arch, est)
    q.windows = {"layers forward": (q.phases["layers forward"][0], fwd),
                 "layers backward": (q.phases["layers backward"][0], bwd)}  # fmt: skip
    return q
