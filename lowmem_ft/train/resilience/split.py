"""Cutting a micro batch into pieces that add up to it: what an out-of-memory step-down runs.

Two shapes of batch reach the trainer. A padded batch has one sample per row: its pieces are consecutive rows, padded
length kept, so each row is computed exactly as in the whole batch. A packed or padding-free batch (TRL's collator
with `packing` / `padding_free`) is one row holding several samples, its position ids restarting at 0 at each
sample, with `cu_seq_lens_*` / `max_length_*` / `seq_idx` describing the boundaries: its pieces are cut at sample
boundaries near equal token shares, and those tensors are recomputed for each piece. Labels are untouched: TRL masks
the first label of every sample (-100), so no loss token crosses a cut, and the pieces' loss tokens add up to the
batch's (`label_count`). transformers has no such split (its `auto_find_batch_size` restarts with a smaller batch,
which changes the effective batch), hence this module.

A batch of image chats also holds inputs that are not one row per sample (Qwen-VL's pixel values, concatenated over
every image's patches; Gemma-3's crops): its collator cuts it instead (`lowmem_ft.vision.data.VisionCollator.split`,
which the trainer hands the guard), each piece with exactly its samples' images.
"""

from __future__ import annotations

from typing import Any

import torch

BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k")
MAX_LENGTH_KEYS = ("max_length_q", "max_length_k")


def sample_starts(inputs: dict[str, Any]) -> list[int] | None:
    """Where each sample starts in a packed (padding-free) row, or None for a padded batch."""
    positions = inputs.get("position_ids")
    if not isinstance(positions, torch.Tensor) or "attention_mask" in inputs:
        return None
    if positions.dim() != 2 or positions.shape[0] != 1:
        return None
    return (positions[0] == 0).nonzero().flatten().tolist()


def split_rows(inputs: dict[str, Any], rows: int) -> list[dict[str, Any]]:
    """Consecutive sub-batches of at most `rows` rows, in order.

    Every tensor whose first dimension is the batch size is sliced; anything else (scalars, flags) is shared.
    """
    batch = inputs["input_ids" if "input_ids" in inputs else "labels"].shape[0]
    if rows >= batch:
        return [inputs]
    sizes = {v.shape[0] for v in inputs.values() if isinstance(v, torch.Tensor) and v.dim() > 0}
    if sizes != {batch}:
        raise ValueError(f"cannot split a batch whose tensors disagree on the batch size: {sorted(sizes)}")
    return [
        {k: v[start : start + rows] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in inputs.items()}
        for start in range(0, batch, rows)
    ]


def _cuts(starts: list[int], length: int, parts: int) -> list[int]:
    """Up to `parts` − 1 sample starts nearest to equal token shares, strictly increasing."""
    cuts: list[int] = []
    for j in range(1, parts):
        later = [s for s in starts if s > (cuts[-1] if cuts else 0)]
        if not later:
            break
        cuts.append(min(later, key=lambda s: abs(s - j * length / parts)))
    return cuts


def _piece(inputs: dict[str, Any], starts: list[int], a: int, b: int) -> dict[str, Any]:
    """Tokens [a, b) of a packed row, with its boundary tensors recomputed."""
    length = inputs["position_ids"].shape[1]
    local = [s - a for s in starts if a <= s < b] + [b - a]
    out: dict[str, Any] = {}
    for key, value in inputs.items():
        if key in BOUNDARY_KEYS:
            out[key] = torch.tensor(local, dtype=value.dtype, device=value.device)
        elif key in MAX_LENGTH_KEYS:
            out[key] = max(y - x for x, y in zip(local, local[1:], strict=False))
        elif key == "seq_idx":
            out[key] = value[:, a:b] - value[0, a]
        elif isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (1, length):
            out[key] = value[:, a:b]
        elif isinstance(value, torch.Tensor) and value.dim() > 0:
            raise ValueError(f"cannot cut a packed batch with per-batch tensor {key!r} of shape {tuple(value.shape)}")
        else:
            out[key] = value
    return out


def split_packed(inputs: dict[str, Any], parts: int) -> list[dict[str, Any]]:
    """A packed row cut at sample boundaries into at most `parts` pieces of about equal tokens (fewer when it holds
    fewer samples); each piece is one row of whole samples."""
    starts = sample_starts(inputs) or [0]
    if parts <= 1 or len(starts) <= 1:
        return [inputs]
    length = inputs["position_ids"].shape[1]
    bounds = [0, *_cuts(starts, length, parts), length]
    return [_piece(inputs, starts, a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


def piece_spans(inputs: dict[str, Any], parts: list[dict[str, Any]]) -> tuple[int, int, list[tuple[int, int]]]:
    """Where the pieces lie in their micro batch: the dimension it was cut along (0: rows of a padded batch, 1:
    tokens of a packed row), the micro batch's size along it, and each piece's (start, size), in order."""
    dim = 1 if sample_starts(inputs) is not None else 0
    key = "input_ids" if "input_ids" in inputs else "labels"
    spans, start = [], 0
    for part in parts:
        size = part[key].shape[dim]
        spans.append((start, size))
        start += size
    return dim, inputs[key].shape[dim], spans


def samples_in(inputs: dict[str, Any]) -> int:
    """Samples a piece holds: rows of a padded batch, samples of a packed row."""
    starts = sample_starts(inputs)
    if starts is not None:
        return len(starts)
    return inputs["input_ids" if "input_ids" in inputs else "labels"].shape[0]


def label_count(inputs: dict[str, Any], shifted: bool) -> int:
    """Tokens that carry loss in a batch, counted like `Trainer._get_num_items_in_batch` (transformers trainer.py):
    `shift_labels` if the collator made them, else `labels[..., 1:]` for causal LM losses, else `labels`."""
    if "shift_labels" in inputs:
        labels = inputs["shift_labels"]
    else:
        labels = inputs["labels"][..., 1:] if shifted else inputs["labels"]
    return int(labels.ne(-100).sum())
