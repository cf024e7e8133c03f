"""The language-model loss, with or without the full logits: what `memory.chunked_loss` switches.

The one idea: for a 152k vocabulary the `(tokens, vocab)` logits, their fp32 copy and their gradient — not the
weights — set the peak at long sequences. `ChunkedLinearCrossEntropy` never holds more than one chunk of them: it
projects `chunk_tokens` hidden states through the LM head at a time, keeps only per-token statistics (the
log-sum-exp), and recomputes each chunk's logits in backward to form the gradients. Pure PyTorch, so it runs on
every device; on CUDA, Liger's or cut-cross-entropy's fused kernels are used when installed (untested here: neither
is installed on the CPU yardstick).

Where it plugs in. TRL 1.16's `SFTTrainer.compute_loss` calls `model(**inputs, fused_lm_head=True)` and reads
per-token `log_probs` / `entropy` / `is_top1` / `label_mask` (`trl.trainer.utils.add_fused_lm_head` and
`FusedCausalLMOutput`); it normalises `-log_probs.sum()` by `num_items_in_batch` (the token count of the whole
accumulated batch) exactly as transformers 5's `ForCausalLMLoss` does with `reduction="sum"`. TRL answers that call
with its own fused head, tiled at 4096 tokens × 32768 vocab (`trl/kernels/chunked_logprob.py`; Triton on CUDA, several
fp32 copies of each tile in its torch fallback elsewhere): that is the `memory.chunked_loss: false` loss, and what
the estimator's "trl_fused" term models. With `chunked_loss: true`, `install_loss_head` answers the call with ours, so
TRL's loss normalisation and metrics stay TRL's; entropy and top-1 accuracy are computed per chunk (no full logits).
`install_loss_head(chunked=False)` gives the standard transformers loss over full logits (the reference of the
tests and of devkit/bench/savers.py; not used in training).
"""

from __future__ import annotations

import functools
import importlib.util
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100  # transformers' `ForCausalLMLoss` and TRL's label masks
# Bytes of fp32 logits one chunk may hold. A chunk's transient peak is about 3× this (its logits in the compute
# dtype, their fp32 copy, exp()), measured with PeakMemory in devkit/bench/savers.py: 64 MiB keeps the loss
# term near 0.25 GB for any vocabulary while the chunk's matmul stays large enough to be efficient
# (110 tokens × 151,936 vocab).
CHUNK_FP32_BYTES = 64 * 2**20


def chunk_tokens_for(vocab_size: int, chunk_bytes: int = CHUNK_FP32_BYTES) -> int:
    """Tokens per chunk so that one chunk's fp32 logits take at most `chunk_bytes`."""
    return max(1, chunk_bytes // (4 * vocab_size))


@dataclass(frozen=True)
class LogitTransform:
    """What the model's forward does to `lm_head(h)` before the loss: × `scale`, then `cap · tanh(x / cap)`.

    Read from the architecture (`lowmem_ft.memory.arch.Architecture.logit_scale` / `final_logit_softcapping`), so
    the chunked loss and the model's own forward apply the same function (Granite, Gemma-2)."""

    scale: float = 1.0
    softcap: float | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Applied in the compute dtype, in the model's order (modeling_granite.py, modeling_gemma2.py)."""
        if self.scale != 1.0:
            x = x * self.scale
        if self.softcap is not None:
            x = torch.tanh(x / self.softcap) * self.softcap
        return x

    def grad(self, logits_fp32: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """d loss / d lm_head(h) from d loss / d logits (in place on `grad`): softcap' = 1 − (logits / cap)²."""
        if self.softcap is not None:
            grad.mul_(1.0 - (logits_fp32 / self.softcap).square_())
        if self.scale != 1.0:
            grad.mul_(self.scale)
        return grad

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Per-token log p(target) of `transform(hidden @ weight.T + bias)`, one token chunk at a time; logits
    recomputed in backward.

    Inputs are the valid positions only (`hidden [N, H]`, `targets [N]`, no ignore_index). Returns
    `(log_probs [N] fp32, entropy [N] fp32, is_top1 [N] bool)`; the last two carry no gradient and are
    computed only when `with_stats`. Numerics follow the standard loss: logits are computed and transformed in the
    compute dtype (as the model's forward does) before the fp32 softmax, and the logits gradient is cast back to
    it for the matmuls (as autograd does for `.float()`).
    """

    @staticmethod
    def _logits(h, weight, bias, transform: LogitTransform) -> torch.Tensor:
        x = h @ weight.t()
        if bias is not None:
            x = x + bias
        return transform(x).float()

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_tokens: int, with_stats: bool, transform: LogitTransform):
        n = hidden.shape[0]
        log_z = torch.empty(n, dtype=torch.float32, device=hidden.device)
        log_probs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.zeros(n if with_stats else 0, dtype=torch.float32, device=hidden.device)
        is_top1 = torch.zeros(n if with_stats else 0, dtype=torch.bool, device=hidden.device)
        for start in range(0, n, chunk_tokens):
            end = min(start + chunk_tokens, n)
            logits = ChunkedLinearCrossEntropy._logits(hidden[start:end], weight, bias, transform)
            lse = torch.logsumexp(logits, dim=-1)
            target_logit = logits.gather(1, targets[start:end, None]).squeeze(1)
            log_z[start:end] = lse
            log_probs[start:end] = target_logit - lse
            if with_stats:
                # in place: 8 B per logit (logits, probs) rather than 12 (logits, their difference, exp)
                probs = torch.sub(logits, lse[:, None]).exp_()
                entropy[start:end] = lse - probs.mul_(logits).sum(-1)
                del probs
                is_top1[start:end] = logits.argmax(-1) == targets[start:end]
            del logits
        ctx.save_for_backward(hidden, weight, bias, targets, log_z)
        ctx.chunk_tokens = chunk_tokens
        ctx.transform = transform
        ctx.mark_non_differentiable(entropy, is_top1)
        return log_probs, entropy, is_top1

    @staticmethod
    def backward(ctx, grad_log_probs, _grad_entropy=None, _grad_top1=None):
        hidden, weight, bias, targets, log_z = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # Accumulated over chunks in fp32, cast once (one big matmul accumulates in fp32 internally too).
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_bias else None
        n = hidden.shape[0]
        rows = torch.arange(min(ctx.chunk_tokens, n), device=hidden.device)
        for start in range(0, n, ctx.chunk_tokens):
            end = min(start + ctx.chunk_tokens, n)
            h = hidden[start:end]
            logits = ChunkedLinearCrossEntropy._logits(h, weight, bias, ctx.transform)
            # d log p_t / d z_j = 1[j = t] − p_j, scaled by the incoming per-token gradient; made in place from the
            # logits (4 B per logit, not 12) unless the softcap's derivative still needs them
            if ctx.transform.softcap is None:
                grad, logits = logits.sub_(log_z[start:end, None]).exp_().neg_(), None
            else:
                grad = torch.exp(logits - log_z[start:end, None]).neg_()
            grad[rows[: end - start], targets[start:end]] += 1.0
            grad.mul_(grad_log_probs[start:end, None])
            grad = ctx.transform.grad(logits, grad)
            del logits
            if need_bias:
                grad_bias += grad.sum(0)
            grad = grad.to(hidden.dtype)
            if need_hidden:
                grad_hidden[start:end] = grad @ weight
            if need_weight:
                grad_weight.addmm_(grad.t().float(), h.float())
            del grad
        return (
            grad_hidden,
            grad_weight.to(weight.dtype) if need_weight else None,
            grad_bias.to(bias.dtype) if need_bias else None,
            None,
            None,
            None,
            None,
        )


def _shift(labels: torch.Tensor, shift_labels: torch.Tensor | None) -> torch.Tensor:
    """Next-token targets aligned with every position (the last one ignored), as `ForCausalLMLoss` builds them."""
    if shift_labels is not None:
        return shift_labels
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def kernel_backend(device: torch.device) -> str | None:
    """'liger' or 'cce' when a fused linear-cross-entropy kernel is installed and usable here, else None."""
    if device.type != "cuda":
        return None
    if importlib.util.find_spec("liger_kernel") is not None:
        return "liger"
    if importlib.util.find_spec("cut_cross_entropy") is not None:
        return "cce"
    return None


def _kernel_loss_sum(backend: str, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):
    """Summed negative log-likelihood from an installed fused kernel (UNTESTED: no CUDA and neither library here).

    `reduction="sum"` rather than per-token: both libraries' per-token backward paths vary across versions."""
    if backend == "liger":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        out = liger_fused_linear_cross_entropy(hidden, weight, targets, reduction="sum")
        return out[0] if isinstance(out, tuple) else out  # newer versions may add z-loss / accuracy
    from cut_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(hidden, weight, targets, reduction="sum")


def token_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    transform: LogitTransform = LogitTransform(),
    shift_labels: torch.Tensor | None = None,
    chunk_tokens: int | None = None,
    with_stats: bool = True,
    use_kernels: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Chunked per-position next-token log-probs, entropy, top-1 hit and label mask, each `[B, S]`, zero where
    the (shifted) label is ignored, of the logits `transform(hidden @ weight.T + bias)`. The full `[B, S, V]` logits
    never exist."""
    targets = _shift(labels, shift_labels).to(hidden.device)
    mask = targets != IGNORE_INDEX
    valid_hidden = hidden[mask]
    valid_targets = targets[mask]
    # the fused kernels compute plain `hidden @ weight.T` logits: not used under a bias, a scale or a softcap
    plain = bias is None and transform.identity
    backend = kernel_backend(hidden.device) if use_kernels and plain else None
    n_valid = valid_targets.numel()
    if backend is not None and n_valid > 0:
        total = _kernel_loss_sum(backend, valid_hidden, weight, valid_targets).float()
        # Spread evenly: the sum (all TRL's "nll" loss reads) and its gradient are exact; per-token values are not.
        log_probs = (-total / n_valid).expand(n_valid)
        # The kernels return the loss only: entropy and accuracy are not computed (logged as NaN).
        nan = torch.full_like(log_probs, float("nan")).detach()
        entropy, is_top1 = nan, nan
    else:
        chunk = chunk_tokens or chunk_tokens_for(weight.shape[0])
        log_probs, entropy, is_top1 = ChunkedLinearCrossEntropy.apply(
            valid_hidden, weight, bias, valid_targets, chunk, with_stats, transform
        )
        if not with_stats:
            entropy = is_top1 = None

    def scatter(x: torch.Tensor | None) -> torch.Tensor | None:
        # masked_scatter keeps a batch without valid labels connected to the graph (a differentiable zero)
        return None if x is None else x.new_zeros(mask.shape).masked_scatter(mask, x)

    return scatter(log_probs), scatter(entropy), scatter(is_top1), mask


def chunked_causal_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    num_items_in_batch: torch.Tensor | int | None = None,
    *,
    bias: torch.Tensor | None = None,
    transform: LogitTransform = LogitTransform(),
    shift_labels: torch.Tensor | None = None,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """transformers' `ForCausalLMLoss(transform(lm_head(hidden)), labels, ...)` without the full logits: the mean
    over valid tokens, or the sum divided by `num_items_in_batch` when given (gradient accumulation)."""
    log_probs, _, _, mask = token_log_probs(
        hidden,
        weight,
        labels,
        bias=bias,
        transform=transform,
        shift_labels=shift_labels,
        chunk_tokens=chunk_tokens,
        with_stats=False,
    )
    if num_items_in_batch is None:
        return -log_probs.sum() / mask.sum()  # ForCausalLMLoss: "mean" (nan when no token is valid, like it)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(log_probs.device)
    return -log_probs.sum() / num_items_in_batch


def full_token_log_probs(logits: torch.Tensor, labels: torch.Tensor, shift_labels: torch.Tensor | None = None):
    """The standard per-token loss over materialized logits (`ForCausalLMLoss` with reduction none), plus entropy
    and top-1 computed without gradient one row block at a time, so they add no full-size fp32 temporary.

    A block is at most 64 MiB of fp32 logits and at most an eighth of the rows. Its working set (the fp32 copy,
    log-softmax, softmax and their product: 16 B per logit of the block) is then at most 2 B per logit of the batch,
    within the 4 B fp32 upcast `cross_entropy` has freed by then. So the forward holds what the memory model's
    full-logits forward counts (`memory.loss.loss_bytes`, `hf_full`: c + 8 B per logit) at every size, not only where
    the 64 MiB cap is small beside the logits."""
    targets = _shift(labels, shift_labels).to(logits.device)
    mask = targets != IGNORE_INDEX
    vocab = logits.shape[-1]
    flat = logits.view(-1, vocab)
    nll = F.cross_entropy(flat.float(), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none")
    entropy = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    is_top1 = torch.empty(flat.shape[0], dtype=torch.bool, device=logits.device)
    step = max(1, min(chunk_tokens_for(vocab), flat.shape[0] // 8))
    with torch.no_grad():
        for start in range(0, flat.shape[0], step):
            block = flat[start : start + step].float()
            entropy[start : start + step] = -(torch.log_softmax(block, -1) * torch.softmax(block, -1)).sum(-1)
            is_top1[start : start + step] = block.argmax(-1) == targets.reshape(-1)[start : start + step]
    shape = mask.shape
    return -nll.view(shape), entropy.view(shape) * mask, is_top1.view(shape) & mask, mask


def logit_transform(config, verified: bool = True) -> LogitTransform:
    """The logit transform of a transformers config; with `verified`, a UserError when the chunked loss is not
    verified to reproduce this architecture's logits."""
    from lowmem_ft.errors import UserError
    from lowmem_ft.memory.arch import Architecture

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    arch = Architecture.from_config(text.to_dict())
    if verified and arch.chunked_loss_refusal:
        raise UserError(arch.chunked_loss_refusal)
    return LogitTransform(arch.logit_scale, arch.final_logit_softcapping)


def install_loss_head(model, *, chunked: bool, chunk_tokens: int | None = None) -> None:
    """Answer `model(..., labels=..., fused_lm_head=True)` (TRL 1.16 SFTTrainer's loss call) with our head.

    `model` is the PEFT model or the bare causal LM; the base model's `forward` is wrapped, so the call keeps
    passing through PEFT (and DDP) wrappers. Every other call goes to the previous forward unchanged. What the
    model's forward does to the logits (scale, softcap) comes from its architecture (`Architecture.logit_scale`,
    `final_logit_softcapping`); an architecture whose logits the chunked loss is not verified to reproduce is refused
    (`Architecture.chunked_loss_refusal`), one line, before any step runs.
    """
    from trl.trainer.utils import FusedCausalLMOutput

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    transform = logit_transform(base.config, verified=chunked)
    previous = base.forward

    @functools.wraps(type(base).forward)
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kw):
        if not fused_lm_head:
            extra = {"labels": labels, "shift_labels": shift_labels, "num_items_in_batch": num_items_in_batch}
            return previous(*args, **kw, **{k: v for k, v in extra.items() if v is not None})
        if kw.get("output_router_logits"):
            raise ValueError("memory.chunked_loss does not support MoE router losses yet")
        kw["use_cache"] = False
        hidden = self.base_model(*args, **kw).last_hidden_state
        lm_head = self.get_output_embeddings()
        if chunked:
            weight, bias = lm_head.weight, lm_head.bias
            if hasattr(weight, "full_tensor"):  # FSDP2 shards it as a DTensor (as in TRL's head; untested here)
                weight = weight.full_tensor()
                bias = bias.full_tensor() if bias is not None else None
            log_probs, entropy, is_top1, mask = token_log_probs(
                hidden, weight, labels, bias=bias, transform=transform, shift_labels=shift_labels,
                chunk_tokens=chunk_tokens,
            )  # fmt: skip
        else:
            logits = transform(lm_head(hidden))
            log_probs, entropy, is_top1, mask = full_token_log_probs(logits, labels, shift_labels)
        denominator = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return FusedCausalLMOutput(
            loss=-log_probs.sum() / denominator,
            log_probs=log_probs,
            entropy=entropy,
            is_top1=is_top1,
            label_mask=mask,
        )

    base.forward = types.MethodType(forward, base)
