"""The token budget: what happens to samples longer than `memory.max_seq_len`, and an account of what it cost.

`data.truncate` decides: `keep_start` (documents: keep the beginning), `keep_end` (dialogue: keep the latest
turns), `drop` (leave the sample out), or `chunk` (plain-text documents only: a sliding window of `max_len`
tokens, consecutive windows sharing `overlap` tokens, so no token is lost; the shared tokens are context in the
later window and carry label -100 there, so each token is learned once). Chunking chat or prompt/completion data
would cut a conversation into pieces whose later parts have lost their prompt, so it is refused with a message.

A sample left with no loss tokens (e.g. `keep_start` cut away the whole completion) teaches nothing; TRL would
drop it silently, so we drop it here and count it. Every sample's fate goes into the report, which the run
directory keeps as `data_report.json`. A stream (`data.streaming`) is fitted lazily by the same rules
(`fit_stream`); its report is counted on its first samples (`lowmem_ft.data.prepare`).
"""

from __future__ import annotations

from typing import Any

from lowmem_ft.errors import UserError

TRUNCATE_MODES = ("keep_start", "keep_end", "drop", "chunk")
FATES = ("kept", "truncated", "dropped", "chunked", "no_loss")


def check_budget(max_len: int, truncate: str, overlap: int, fmt: str | None = None) -> None:
    """Reject settings that cannot work, naming the recipe key."""
    if max_len < 1:
        raise UserError(f"memory.max_seq_len must be at least 1, got {max_len}")
    if truncate not in TRUNCATE_MODES:
        raise UserError(f"data.truncate={truncate!r}; use one of {', '.join(TRUNCATE_MODES)}")
    if truncate == "chunk":
        if not 0 <= overlap < max_len:
            raise UserError(
                f"data.overlap={overlap} must be at least 0 and smaller than the chunk length "
                f"memory.max_seq_len={max_len}; lower --set data.overlap"
            )
        if fmt is not None and fmt != "text":
            raise UserError(
                f"data.truncate=chunk splits plain-text documents only, and this data is {fmt}: a chunk of a "
                "conversation would lose its prompt; use keep_end (dialogue keeps its latest turns), keep_start or drop"
            )


def _fit_batch(batch: dict, max_len: int, truncate: str, overlap: int) -> dict:
    out: dict[str, list] = {"input_ids": [], "labels": [], "fate": [], "lost": [], "piece": []}

    def emit(ids, labels, fate, lost, piece=0):
        out["input_ids"].append(ids)
        out["labels"].append(labels)
        out["fate"].append(fate)
        out["lost"].append(lost)
        out["piece"].append(piece)

    for ids, labels in zip(batch["input_ids"], batch["labels"], strict=True):
        n = len(ids)
        if n <= max_len:
            fate = "kept" if any(x != -100 for x in labels) else "no_loss"
            emit(ids, labels, fate, 0 if fate == "kept" else n)
        elif truncate == "drop":
            emit([], [], "dropped", n)
        elif truncate == "chunk":
            stride = max_len - overlap
            start, piece = 0, 0
            while True:
                window_labels = list(labels[start : start + max_len])
                if piece:  # the overlap is context here; its tokens were learned in the previous window
                    window_labels[:overlap] = [-100] * min(overlap, len(window_labels))
                emit(ids[start : start + max_len], window_labels, "chunked", 0, piece)
                if start + max_len >= n:
                    break
                start += stride
                piece += 1
        else:
            sl = slice(None, max_len) if truncate == "keep_start" else slice(n - max_len, None)
            cut_labels = labels[sl]
            if any(x != -100 for x in cut_labels):
                emit(ids[sl], cut_labels, "truncated", n - max_len)
            else:
                emit(ids[sl], cut_labels, "no_loss", n)
    return out


def apply_budget(dataset, max_len: int, truncate: str, overlap: int, fmt: str) -> tuple[Any, dict[str, Any]]:
    """Fit every sample into `max_len` tokens per `truncate`; returns the dataset TRL gets and the report."""
    import numpy as np
    import pyarrow.compute as pc

    from lowmem_ft.data.profile import lengths_of

    check_budget(max_len, truncate, overlap, fmt)
    tokens_in = sum(lengths_of(dataset))  # of this dataset's rows (a held-out split is a view over a larger table)
    fitted = dataset.map(
        _fit_batch,
        batched=True,
        fn_kwargs={"max_len": max_len, "truncate": truncate, "overlap": overlap},
        remove_columns=dataset.column_names,
        load_from_cache_file=False,
        desc=f"Fitting samples into {max_len} tokens ({truncate})",
    )
    fate = np.asarray(fitted["fate"])
    lost = np.asarray(fitted["lost"], dtype=np.int64)
    piece = np.asarray(fitted["piece"])
    kept_rows = np.flatnonzero(np.isin(fate, ("kept", "truncated", "chunked")))
    chunked_samples = int(((fate == "chunked") & (piece == 0)).sum())
    chunks = int((fate == "chunked").sum())
    report = {
        "max_len": max_len,
        "truncate": truncate,
        "overlap": overlap if truncate == "chunk" else None,
        "samples_in": len(dataset),
        "tokens_in": tokens_in,
        "kept_whole": int((fate == "kept").sum()),
        "truncated": int((fate == "truncated").sum()),
        "chunked": chunked_samples,
        "chunks_out": chunks,
        "dropped_too_long": int((fate == "dropped").sum()),
        "dropped_no_loss_tokens": int((fate == "no_loss").sum()),
        "tokens_lost": int(lost.sum()),
        "samples_out": len(kept_rows),
    }
    out = (
        fitted.select(kept_rows).remove_columns(["fate", "lost", "piece"]).flatten_indices() if len(kept_rows) else None
    )
    if out is None:
        raise UserError(
            f"no sample is left after fitting the data into memory.max_seq_len={max_len} with data.truncate={truncate} "
            f"({report['dropped_too_long']} too long, {report['dropped_no_loss_tokens']} with no loss tokens left); "
            "raise memory.max_seq_len or use another data.truncate"
        )
    report["tokens_out"] = int(pc.sum(pc.list_value_length(out.data.column("input_ids"))).as_py() or 0)
    return out, report


def describe(report: dict[str, Any]) -> str:
    """One line for the log: what the budget did."""
    parts = [f"{report['samples_in']} samples → {report['samples_out']} sequences of ≤{report['max_len']} tokens"]
    for key, label in (
        ("truncated", "truncated"),
        ("chunked", "chunked"),
        ("dropped_too_long", "dropped (too long)"),
        ("dropped_no_loss_tokens", "dropped (no loss tokens left)"),
    ):
        if report[key]:
            parts.append(f"{report[key]} {label}")
    parts.append(f"{report['tokens_lost']} tokens lost")
    return ", ".join(parts)


def _kept(batch: dict) -> list[bool]:
    return [fate in ("kept", "truncated", "chunked") for fate in batch["fate"]]


def fit_stream(dataset, max_len: int, truncate: str, overlap: int, fmt: str):
    """A stream (IterableDataset) fitted lazily by the same rules; what it cuts is counted on its head (prepare)."""
    check_budget(max_len, truncate, overlap, fmt)
    fitted = dataset.map(
        _fit_batch,
        batched=True,
        fn_kwargs={"max_len": max_len, "truncate": truncate, "overlap": overlap},
        remove_columns=["input_ids", "labels"],
    )
    return fitted.filter(_kept, batched=True).remove_columns(["fate", "lost", "piece"])
