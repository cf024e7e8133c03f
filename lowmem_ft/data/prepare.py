"""From the recipe's data keys to the datasets `SFTTrainer` trains on, with the account of what was done to them.

read + validate (formats) → tokenize, cached (tokenize) → fit into the token budget (budget) → TRL. The eval split
is cut from the tokenized data before the budget, so train and eval are fitted the same way. The summary is what
`run.json` keeps under "data" and `data_report.json` keeps in full.
"""

from __future__ import annotations

import logging
import random
from typing import Any

from lowmem_ft.data.budget import apply_budget, check_budget, describe
from lowmem_ft.data.formats import CHAT_FORMATS
from lowmem_ft.data.profile import profile_of
from lowmem_ft.data.tokenize import tokenize_file
from lowmem_ft.errors import UserError

log = logging.getLogger(__name__)

# Attention implementations that keep packed samples apart when given reset position_ids and no attention mask
# (TRL's padding-free collator output). transformers 5.24 masking_utils.py: `_preprocess_mask_arguments` calls
# `find_packed_sequence_indices(position_ids)` when attention_mask is None and builds a block-diagonal causal mask
# for sdpa / eager / flex_attention; flash_attention_2/3 take the `cu_seq_lens_*` the collator computes (varlen
# kernels). Anything else (hub kernels, remote modeling code) is not known to, so packing falls back.
# The detection only runs without a KV cache: TRL's SFTTrainer.compute_loss passes use_cache=False; a forward with
# the model's default use_cache=True would let packed samples attend to each other (tests/data/test_prepare.py).
PACKING_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")


def packing_support(attn_implementation: str, model_module: str | None = None) -> tuple[bool, str]:
    """(packing keeps samples apart?, why) for an attention implementation and the model class's module."""
    if model_module is not None and not model_module.startswith("transformers."):
        return False, f"the model's own code ({model_module}) is not known to honour reset position ids"
    if attn_implementation not in PACKING_ATTENTION:
        return False, f"attention {attn_implementation!r} is not known to honour reset position ids"
    if attn_implementation.startswith("flash_attention"):
        return True, "flash-attention varlen kernels over cu_seq_lens (no padding, no mask)"
    return True, f"{attn_implementation} with a block-diagonal causal mask built from reset position ids"


def _loss_on(fmt: str, train_on_prompt: bool) -> str:
    if train_on_prompt or fmt == "text":
        return "all tokens"
    return "assistant turns" if fmt in CHAT_FORMATS else "completion"


def held_out_split(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, eval) indices: a seeded random `fraction` of n samples held out; the same seed, the same split.

    Random rather than the file's tail, since data files are often sorted (by source, length or date); both
    parts keep the file's order.
    """
    n_eval = max(1, int(n * fraction))
    if n_eval >= n:
        raise UserError(
            f"data.eval_fraction={fraction:g} of {n} records leaves nothing to train on; lower it or pass --eval-data FILE"
        )
    held = set(random.Random(seed).sample(range(n), n_eval))
    return [i for i in range(n) if i not in held], sorted(held)


def prepare_datasets(recipe, tokenizer) -> tuple[Any, Any, dict[str, Any]]:
    """Train dataset, eval dataset (or None) and the data summary for the run directory."""
    d, max_len = recipe.data, recipe.memory.max_seq_len
    check_budget(max_len, d.truncate, d.overlap)
    train = tokenize_file(
        d.path, tokenizer, fmt=d.format, train_on_prompt=d.train_on_prompt, skip_bad_lines=d.skip_bad_lines
    )
    for line in train.skipped:
        log.warning("skipped %s", line)
    profile = profile_of(train)
    train_ds, eval_ds, eval_skipped = train.dataset, None, []
    if d.eval_path:
        ev = tokenize_file(
            d.eval_path, tokenizer, fmt=d.format, train_on_prompt=d.train_on_prompt, skip_bad_lines=d.skip_bad_lines
        )
        eval_ds, eval_skipped = ev.dataset, ev.skipped
    elif d.eval_fraction > 0:
        keep, held = held_out_split(len(train_ds), d.eval_fraction, recipe.training.seed)
        train_ds, eval_ds = train_ds.select(keep), train_ds.select(held)
    train_ds, report = apply_budget(train_ds, max_len, d.truncate, d.overlap, train.format)
    log.info("data: %s", describe(report))
    eval_report = None
    if eval_ds is not None:
        eval_ds, eval_report = apply_budget(eval_ds, max_len, d.truncate, d.overlap, train.format)
    summary: dict[str, Any] = {
        "path": d.path,
        "eval_source": d.eval_path
        or (f"held out {d.eval_fraction:g} of {d.path} (seed {recipe.training.seed})" if d.eval_fraction else None),
        "format": train.format,
        "chat_template": train.chat_template,
        "records": len(train.dataset),
        "skipped_lines": train.skipped,
        "eval_skipped_lines": eval_skipped,
        "train_records": report["samples_in"],
        "eval_records": eval_report["samples_in"] if eval_report else 0,
        "loss_on": _loss_on(train.format, d.train_on_prompt),
        "tokenized_from_cache": train.from_cache,
        "profile": profile.to_dict(),
        "budget": report,
        "eval_budget": eval_report,
    }
    return train_ds, eval_ds, summary
