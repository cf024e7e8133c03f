"""The chunked loss's terms scale with the labelled positions the head projects (`Setup.loss_tokens`), pinned against
an exact PeakMemory measurement of `lowmem_ft.train.losses.token_log_probs` at two label fractions."""

from __future__ import annotations

from dataclasses import replace

import pytest

# the measuring side (PeakMemory over real tensors) needs torch; without it the module is skipped, not an error
torch = pytest.importorskip("torch")

from devkit.zoo import estimator_config  # noqa: E402
from lowmem_ft.memory.arch import Architecture  # noqa: E402
from lowmem_ft.memory.estimate import (  # noqa: E402
    Setup,
    chunk_backward_bytes,
    chunk_forward_bytes,
    estimate,
    head_saved_bytes,
    loss_chunk_tokens,
    loss_positions,
)
from lowmem_ft.train.losses import IGNORE_INDEX, token_log_probs  # noqa: E402
from lowmem_ft.train.measure.exact import labelled_positions  # noqa: E402
from lowmem_ft.train.measure.peak import PeakMemory  # noqa: E402

SEQ, CHUNK = 1024, 128


def _measure(arch: Architecture, fraction: float) -> tuple[int, dict[str, int]]:
    """(labelled positions, bytes above the start: kept after forward, forward peak, backward peak) of the chunked
    head alone on a bf16 batch of SEQ positions whose labels are kept at random with probability `fraction`."""
    gen = torch.Generator().manual_seed(0)
    h, v = arch.hidden_size, arch.vocab_size
    weight = torch.randn(v, h, generator=gen).to(torch.bfloat16)
    base = torch.randn(1, SEQ, h, generator=gen).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, v, (1, SEQ), generator=gen)
    labels[torch.rand(1, SEQ, generator=gen) >= fraction] = IGNORE_INDEX
    with PeakMemory(roots=[weight, base, labels]) as pm:
        hidden = base * 1  # the final norm's output: not a leaf
        start = pm.mark("start").live_bytes
        log_probs, entropy, is_top1, mask = token_log_probs(hidden, weight, labels, chunk_tokens=CHUNK)
        loss = -log_probs.sum() / mask.sum()
        forward = pm.mark("forward")
        loss.backward()
        backward = pm.mark("backward")
    measured = {
        "kept": forward.live_bytes - start,
        "forward": forward.peak_bytes - start,
        "backward": backward.peak_bytes - forward.live_bytes,
    }
    return labelled_positions({"labels": labels}), measured


def test_chunked_loss_scales_with_labelled_positions():
    arch = Architecture.from_config(estimator_config("llama3"))  # h 256, V 8192
    s = Setup(
        gradient_accumulation=1,
        device="cpu",
        compute_dtype="bfloat16",
        max_seq_len=SEQ,
        loss_impl="chunked",
        loss_chunk_tokens=CHUNK,
    )
    runs = {fraction: _measure(arch, fraction) for fraction in (0.5, 0.125)}
    (many, m_many), (few, m_few) = runs[0.5], runs[0.125]
    assert 400 < many < 620 and 80 < few < 180  # labelled positions after the shift
    at = {n: replace(s, loss_tokens=n) for n in (many, few)}
    assert loss_positions(at[few]) == few and loss_positions(s) == SEQ - 1
    # kept from forward to backward: the per-label share (`hidden[mask]`, its targets, log_z) is what changes
    predicted_kept = (head_saved_bytes(arch, at[many]) - head_saved_bytes(arch, at[few])) * SEQ
    assert m_many["kept"] - m_few["kept"] == pytest.approx(predicted_kept, rel=0.02)
    for n, m in ((many, m_many), (few, m_few)):
        k = loss_chunk_tokens(arch, at[n])
        assert k == CHUNK
        # the forward's chunk beside what it keeps; the backward's chunk and every projected token's gradients
        assert m["forward"] == pytest.approx(chunk_forward_bytes(arch, at[n], k) + m["kept"], rel=0.03)
        predicted_bwd = chunk_backward_bytes(arch, at[n], k)
        assert 0.97 * predicted_bwd <= m["backward"] <= predicted_bwd * 1.001
    # the backward's fixed share follows the labels: 4× the labelled positions, ~4× the bytes beyond the chunk
    chunk_bwd = chunk_backward_bytes(arch, replace(s, loss_tokens=0), CHUNK)
    assert (m_many["backward"] - chunk_bwd) / (m_few["backward"] - chunk_bwd) == pytest.approx(many / few, rel=0.05)


def test_unknown_labels_keep_the_upper_bound():
    """Without `loss_tokens` every position is counted, as with all of them labelled; fewer labels never predict
    more, and the terms of the other loss implementations do not read it."""
    arch = Architecture.from_config(estimator_config("llama3"))
    s = Setup(gradient_accumulation=1, device="cpu", max_seq_len=SEQ, loss_impl="chunked")
    full = estimate(arch, s)
    assert estimate(arch, replace(s, loss_tokens=10 * SEQ)).phases == full.phases  # never more than the positions
    every = estimate(arch, replace(s, loss_tokens=SEQ - 1)).phases  # each row's last position has no target
    assert all(0 <= full.phases[p] - every[p] <= 0.001 * full.phases[p] for p in every)
    few = estimate(arch, replace(s, loss_tokens=SEQ // 8)).phases
    assert few["forward"] < full.phases["forward"] and few["backward"] < full.phases["backward"]
    for impl in ("trl_fused", "hf_full"):
        other = replace(s, loss_impl=impl)
        assert estimate(arch, replace(other, loss_tokens=SEQ // 8)).phases == estimate(arch, other).phases
