"""How many sequences one eval forward may hold within a device budget: pure arithmetic over `Architecture`.

lm-eval's `HFLM._loglikelihood_tokens` runs `F.log_softmax(model(batch).logits, dim=-1)` over a batch padded to its
longest sequence (at most `max_length` tokens). Per sequence of L tokens that holds (read from lm_eval 0.4.13
models/huggingface.py and transformers 5.24, not measured):
- one layer's forward activations at a time (`inference.prefill_workspace_bytes` without its one-position logits);
- the KV cache the forward fills when the config's `use_cache` is on (`inference.kv_cache_bytes`);
- the logits of every position and their log-softmax, both in the compute dtype: 2 × L × vocab × bytes.
The batch is what the budget leaves after the weights and the reserve (safety margin + CUDA context), divided by
that, capped at `MAX_BATCH`.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowmem_ft.memory.arch import Architecture
from lowmem_ft.memory.inference import LOGITS_BYTES, human, kv_cache_bytes, prefill_workspace_bytes

MAX_BATCH = 64  # more buys nothing on the small local tasks and costs padding on long ones
LOGIT_COPIES = 2  # the logits and their log-softmax (lm_eval HFLM._loglikelihood_tokens)


def per_sequence_bytes(arch: Architecture, max_length: int, bytes_per_value: int) -> int:
    forward = prefill_workspace_bytes(arch, max_length, bytes_per_value) - arch.vocab_size * LOGITS_BYTES
    cache = kv_cache_bytes(arch, max_length, bytes_per_value)
    logits = LOGIT_COPIES * max_length * arch.vocab_size * bytes_per_value
    return int(forward + cache + logits)


@dataclass(frozen=True)
class EvalBatch:
    batch_size: int
    per_sequence: int
    free: int  # budget − weights − reserve
    max_length: int

    def describe(self) -> str:
        return (
            f"batch {self.batch_size}: {human(self.free)} left after weights and margin / "
            f"{human(self.per_sequence)} per {self.max_length}-token sequence"
        )


def plan_batch(arch: Architecture, *, budget: int, weights: int, reserve: int, max_length: int,
               bytes_per_value: int) -> EvalBatch:  # fmt: skip
    """The batch size; 0 when not even one sequence fits (the caller says so)."""
    per = per_sequence_bytes(arch, max_length, bytes_per_value)
    free = budget - weights - reserve
    return EvalBatch(max(0, min(MAX_BATCH, free // per)) if free > 0 else 0, per, free, max_length)
