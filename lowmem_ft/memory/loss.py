"""The logits and the loss: the full-logits loss (transformers ForCausalLMLoss), the chunked loss
(`memory.chunked_loss`, lowmem_ft/train/losses.py) and its chunk sizes, TRL's fused LM head (Triton or the CPU fold).
"""

from __future__ import annotations

from lowmem_ft.memory.arch import Architecture
from lowmem_ft.memory.calibration import (
    CHUNK_BWD_BYTES_PER_LOGIT,
    CHUNK_BWD_BYTES_PER_LOGIT_SOFTCAP,
    CHUNK_BWD_BYTES_PER_TOKEN,
    CHUNK_FP32_BYTES,
    CHUNK_FWD_BYTES_PER_LOGIT,
    CHUNK_FWD_BYTES_PER_LOGIT_SOFTCAP_FP32,
    CPU_TILE_FP32_BWD,
    CPU_TILE_FP32_FWD,
    CPU_TILE_TOP1_FWD,
    HF_LOSS_BYTES_PER_LOGIT,
    HF_LOSS_FORWARD_BYTES_PER_LOGIT,
    TRL_TOKEN_CHUNK,
    TRL_VOCAB_CHUNK,
)
from lowmem_ft.memory.records import DTYPE_BYTES, Setup


def loss_positions(s: Setup) -> int:
    """Positions the chunked loss projects (losses.py `token_log_probs`: `hidden[mask]`): the micro batch's labelled
    positions when known (`Setup.loss_tokens`), else every position but each row's last, the upper bound."""
    n = s.micro_batch_size * (s.max_seq_len - 1)
    return n if s.loss_tokens is None else max(0, min(n, s.loss_tokens))


def loss_chunk_tokens(arch: Architecture, s: Setup) -> int:
    """Tokens per chunk of the chunked loss: `memory.loss_chunk_tokens`, else losses.py's 64 MiB of fp32 logits; at
    most the positions it projects (`loss_positions`)."""
    n = loss_positions(s)
    return max(1, min(n, s.loss_chunk_tokens or CHUNK_FP32_BYTES // (4 * arch.vocab_size)))


def _chunk_per_logit(arch: Architecture, s: Setup) -> tuple[int, int]:
    """(forward, backward) bytes per logit of one loss chunk (CHUNK_*_BYTES_PER_LOGIT)."""
    c = DTYPE_BYTES[s.compute_dtype]
    if arch.final_logit_softcapping:
        fwd = CHUNK_FWD_BYTES_PER_LOGIT_SOFTCAP_FP32 if c == 4 else CHUNK_FWD_BYTES_PER_LOGIT
        return fwd, CHUNK_BWD_BYTES_PER_LOGIT_SOFTCAP
    return CHUNK_FWD_BYTES_PER_LOGIT, CHUNK_BWD_BYTES_PER_LOGIT + (c if c < 4 else 0)


def _chunk_backward_fixed(arch: Architecture, s: Setup) -> float:
    """The chunked loss's backward beyond its chunk: every projected token's c-byte hidden-state gradient and fp32
    ones."""
    n = loss_positions(s)
    return (DTYPE_BYTES[s.compute_dtype] * arch.hidden_size + CHUNK_BWD_BYTES_PER_TOKEN) * n


def chunk_forward_bytes(arch: Architecture, s: Setup, k: int) -> float:
    """The chunked loss's forward working set for chunks of `k` tokens."""
    return _chunk_per_logit(arch, s)[0] * k * arch.vocab_size


def chunk_backward_bytes(arch: Architecture, s: Setup, k: int) -> float:
    """The chunked loss's backward working set: one chunk of `k` tokens and every token's gradients."""
    return _chunk_per_logit(arch, s)[1] * k * arch.vocab_size + _chunk_backward_fixed(arch, s)


def largest_loss_chunk(arch: Architecture, s: Setup, budget_bytes: float) -> int:
    """The largest loss chunk (tokens) whose working set, forward and backward, fits in `budget_bytes`; 0 if even
    one token does not. At most the micro batch's tokens. Pure arithmetic, for the planner: fewer, larger chunks
    when there is room (`memory.loss_chunk_tokens`)."""
    n = loss_positions(s)
    fwd, bwd = _chunk_per_logit(arch, s)
    k = min(
        budget_bytes // (fwd * arch.vocab_size),
        (budget_bytes - _chunk_backward_fixed(arch, s)) // (bwd * arch.vocab_size),
    )
    return int(max(0, min(n, k)))


def loss_bytes(arch: Architecture, s: Setup) -> tuple[float, float, str]:
    """(forward, backward) working sets of the logits and the loss, beyond what `head_saved_bytes` keeps."""
    c = DTYPE_BYTES[s.compute_dtype]
    n = s.micro_batch_size * (s.max_seq_len - 1)
    v, h = arch.vocab_size, arch.hidden_size
    trained_head = s.adapter == "full"
    if s.loss_impl == "hf_full":
        return (
            n * v * (c + HF_LOSS_FORWARD_BYTES_PER_LOGIT),  # the logits, their fp32 upcast and log_softmax
            n * v * HF_LOSS_BYTES_PER_LOGIT,  # log_softmax and two fp32 gradients; the outputs were dropped
            "full logits + fp32 upcast and log_softmax; backward: log_softmax and its fp32 gradients (ForCausalLMLoss)",
        )
    if s.loss_impl == "chunked":
        k = loss_chunk_tokens(arch, s)
        return (
            chunk_forward_bytes(arch, s, k),
            chunk_backward_bytes(arch, s, k),
            f"one chunk of {k} tokens × vocab (lowmem_ft/train/losses.py) + the hidden-state gradient",
        )
    rows, cols = min(n, TRL_TOKEN_CHUNK), min(v, TRL_VOCAB_CHUNK)
    tile = rows * cols
    mm_buf = c * rows * TRL_VOCAB_CHUNK
    # backward accumulators, fp32 (ChunkedLogProbFunction.backward): grad_hidden N × h; grad_weight V × h if trained
    acc = 4 * n * h + (4 * v * h if trained_head else 0)
    # on return, the c-byte casts of the accumulators (`grad_hidden.to(hidden.dtype)`, `grad_weight.to(...)`)
    tail = c * n * h + (c * v * h if trained_head else 0)
    if s.device == "cpu":
        fwd = mm_buf + 4 * (CPU_TILE_FP32_FWD - (CPU_TILE_TOP1_FWD if s.loss_impl == "trl_fused_logps" else 0)) * tile
        addmm = 4 * tile + 4 * cols * h + (4 * rows * h if trained_head else 0)
        # final-logit softcapping keeps tanh's fp32 output `t` beside y and z through the fold (_backward_tile)
        tiles_bwd = CPU_TILE_FP32_BWD + (1 if arch.final_logit_softcapping else 0)
        bwd = acc + mm_buf + max(4 * tiles_bwd * tile, addmm, tail)
        where = "CPU torch fold: fp32 tile copies (3.25 fwd, 7.25 bwd)"
    else:
        fwd, bwd = mm_buf, acc + mm_buf + tail
        where = "Triton fold: no fp32 tile copies"
    return fwd, bwd, f"TRL fused LM head: {rows} × 32768 tile buffer, fp32 accumulators; {where}"


def loss_block(arch: Architecture, s: Setup, backward: bool = True) -> float:
    """The largest single tensor of the loss path, as `loss_bytes` sizes its terms: the full-logits loss's fp32
    upcast of the logits (every position × vocab: ForCausalLMLoss `logits.float()`, and log_softmax and its gradient
    the same size), the chunked loss's one chunk of fp32 logits, TRL's fused head's tile buffer or, in its backward,
    an fp32 accumulator (N × h; V × h when the head trains). `backward` False: a no-grad forward's (evaluation)."""
    c = DTYPE_BYTES[s.compute_dtype]
    v, h = arch.vocab_size, arch.hidden_size
    if s.loss_impl == "hf_full":
        return float(4 * s.micro_batch_size * s.max_seq_len * v)
    if s.loss_impl == "chunked":
        return float(4 * loss_chunk_tokens(arch, s) * v)
    n = s.micro_batch_size * (s.max_seq_len - 1)
    rows = min(n, TRL_TOKEN_CHUNK)
    # the tile buffer; on the CPU the torch fold's fp32 copies of one rows × min(V, 32768) tile (CPU_TILE_FP32_*)
    tile = max(c * rows * TRL_VOCAB_CHUNK, 4 * rows * min(v, TRL_VOCAB_CHUNK) if s.device == "cpu" else 0)
    if not backward:
        return float(tile)
    return float(max(tile, 4 * n * h, 4 * v * h if s.adapter == "full" else 0))


def largest_step_block(arch: Architecture, s: Setup) -> float:
    """The largest single tensor a training step allocates and frees: the loss path's (`loss_block`) and, in a
    full fine-tune, the embedding's gradient (V × h in the compute dtype: the largest parameter's gradient, which
    the Trainer frees after every optimizer step, and AdamW's foreach temporaries of it). What the caching
    allocator's term with torch's default settings is sized by (`lowmem_ft.memory.overheads`)."""
    c = DTYPE_BYTES[s.compute_dtype]
    embedding_grad = c * arch.vocab_size * arch.hidden_size if s.adapter == "full" else 0
    return float(max(loss_block(arch, s), embedding_grad))
