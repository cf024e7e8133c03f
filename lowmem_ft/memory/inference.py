"""Generation memory: what decoding holds on the device besides the weights, and how many tokens a budget allows.

The one idea: during `generate` the only term that grows with the output is the KV cache —
2 (keys and values) × layers × kv_heads × head_dim × tokens × bytes per value — so a VRAM budget minus the
weights, the safety margin and the prefill workspace, divided by the cache bytes per token, bounds the tokens.
Pure arithmetic over the planner's `Architecture` (no torch), so the planner and `generate` share it.

Sources (transformers 5.24): `cache_utils.DynamicLayer.update` keeps one key and one value tensor per layer,
shaped [batch, kv_heads, seq, head_dim] in the model's compute dtype, and grows them with `torch.cat` — which
briefly holds one layer's old and new tensor together, hence `CAT_TRANSIENT_LAYERS`. `GenerationMixin` sets
`logits_to_keep=1` when the model accepts it (generation/utils.py), so prefill materializes the logits of one
position, not of the whole prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowmem_ft.memory.arch import Architecture
from lowmem_ft.memory.estimate import GB, MOE_FWD_INDEX_BYTES

# While DynamicLayer.update concatenates, one layer's previous key (or value) tensor and the new one coexist:
# one extra layer-slice of K or V, i.e. 1 / (2 × layers) of the whole cache.
CAT_TRANSIENT_LAYERS = 1

# Prefill workspace of one decoder layer, in hidden-sized and intermediate-sized activations per prompt token.
# Read from modeling_qwen2.py / modeling_llama.py forward (not measured): the residual, the normed input, the
# attention output and q (4 × hidden; k and v are in the cache already) and, in the MLP,
# down_proj(act(gate_proj(x)) * up_proj(x)): gate, up and their product (3 × intermediate). Layers run one at a
# time, so one layer's worth is live. With the SDPA memory-efficient/flash kernels there is no s² score matrix;
# the eager kernel would add heads × s² × bytes.
PREFILL_HIDDEN_TENSORS = 4
PREFILL_INTERMEDIATE_TENSORS = 3
LOGITS_BYTES = (
    4  # the kept logits are copied to fp32 for sampling (generation/utils.py `_sample`: `.to(dtype=torch.float32)`)
)


def human(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number ≥ 1 (tiny models have KiB-sized caches)."""
    for unit, size in (("GB", GB), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def kv_cache_bytes(arch: Architecture, tokens: int, bytes_per_value: int, batch: int = 1) -> int:
    """2 × layers × kv_heads × head_dim × tokens × bytes (× batch): keys and values of every layer."""
    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * tokens * bytes_per_value * batch


def kv_bytes_per_token(arch: Architecture, bytes_per_value: int) -> float:
    """Cache bytes one more token costs, with the concatenation transient spread over the layers."""
    return kv_cache_bytes(arch, 1, bytes_per_value) * (1 + CAT_TRANSIENT_LAYERS / (2 * arch.num_layers))


def prefill_workspace_bytes(arch: Architecture, prompt_tokens: int, bytes_per_value: int) -> int:
    """Transient activations of the prompt's forward pass (one layer at a time) plus one position's fp32 logits."""
    per_token = PREFILL_HIDDEN_TENSORS * arch.hidden_size + PREFILL_INTERMEDIATE_TENSORS * arch.intermediate_size
    if arch.moe:  # each token goes through top-k experts: per routed copy the gathered input, the c·2I up output,
        # act(gate) and the product (the up-projection moment), or the down output and two weighted copies
        # (transformers' grouped_mm_experts_forward; the training side's measured moments, lowmem_ft.memory.estimate)
        k, h, i = arch.moe.top_k, arch.hidden_size, arch.moe.intermediate_size
        per_token = PREFILL_HIDDEN_TENSORS * h + max(k * (h + 4 * i), 4 * k * h) + arch.moe.shared_intermediate * 3
        indices = k * MOE_FWD_INDEX_BYTES * prompt_tokens  # the routing's int64 / fp32 index tensors
        return per_token * prompt_tokens * bytes_per_value + indices + arch.vocab_size * LOGITS_BYTES
    return per_token * prompt_tokens * bytes_per_value + arch.vocab_size * LOGITS_BYTES


@dataclass(frozen=True)
class GenerationBudget:
    """How a device budget splits for one generation, and the longest output it allows."""

    budget_bytes: int
    weights_bytes: int
    reserve_bytes: int  # safety margin + CUDA context: what the caller keeps off the cache
    workspace_bytes: int
    kv_per_token: float
    prompt_tokens: int
    max_total_tokens: int  # prompt + output the cache can hold (also capped by the model's positions)
    max_new_tokens: int  # what generation may produce: min(requested, max_total_tokens - prompt_tokens)
    requested_new_tokens: int

    @property
    def bounded(self) -> bool:
        return self.max_new_tokens < self.requested_new_tokens

    @property
    def fixed_bytes(self) -> int:
        """What is taken before the first cached token: weights, safety margin and prefill workspace."""
        return self.weights_bytes + self.reserve_bytes + self.workspace_bytes

    def describe(self) -> str:
        fixed = (
            f"weights {human(self.weights_bytes)} + margin and CUDA context {human(self.reserve_bytes)} + prefill "
            f"{human(self.workspace_bytes)}"
        )
        free = self.budget_bytes - self.fixed_bytes
        if free <= 0:
            return f"{fixed} take {human(self.fixed_bytes)}, over the {human(self.budget_bytes)} budget"
        if self.max_total_tokens <= self.prompt_tokens:
            return (
                f"{fixed} leave {human(free)} of {human(self.budget_bytes)}, a KV cache of "
                f"{self.max_total_tokens} tokens at {human(self.kv_per_token)}/token"
            )
        kv = self.kv_per_token * self.max_total_tokens
        return (
            f"{human(self.budget_bytes)} = {fixed} + KV cache up to {human(kv)} "
            f"({human(self.kv_per_token)}/token × {self.max_total_tokens} tokens)"
        )


def plan_generation(
    arch: Architecture,
    *,
    budget_bytes: int,
    weights_bytes: int,
    reserve_bytes: int,
    prompt_tokens: int,
    requested_new_tokens: int,
    bytes_per_value: int,
) -> GenerationBudget:
    """The output length a budget allows: what is left after weights, margin and prefill, over the KV bytes/token.

    `max_new_tokens` is 0 or negative when not even the prompt fits; the caller says so.
    """
    workspace = prefill_workspace_bytes(arch, prompt_tokens, bytes_per_value)
    per_token = kv_bytes_per_token(arch, bytes_per_value)
    free = budget_bytes - weights_bytes - reserve_bytes - workspace
    total = max(0, int(free // per_token))
    if arch.max_position_embeddings:
        total = min(total, arch.max_position_embeddings)
    return GenerationBudget(
        budget_bytes=budget_bytes,
        weights_bytes=weights_bytes,
        reserve_bytes=reserve_bytes,
        workspace_bytes=workspace,
        kv_per_token=per_token,
        prompt_tokens=prompt_tokens,
        max_total_tokens=total,
        max_new_tokens=min(requested_new_tokens, total - prompt_tokens),
        requested_new_tokens=requested_new_tokens,
    )
