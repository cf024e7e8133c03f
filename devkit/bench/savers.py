"""Peak memory and step time with and without each memory saver, on a 152k-vocabulary model (CPU yardstick).

    python -m devkit.bench.savers                    # seq 2048, batch 1, QLoRA NF4, float32 compute
    python -m devkit.bench.savers --seq 4096 --dtype bfloat16 --out benchmarks/savers_cpu.md

A Qwen2 config with Qwen2.5's vocabulary (151,936) and a small body (hidden 64, 2 layers) — so the LM head and
the loss, the part the savers act on, dominate and one step fits a few seconds on two cores — is written with
random weights and built through `lowmem_ft.train.model.build_model` (NF4 + lean preparation + LoRA +
checkpointing). Each row runs one real step (forward, backward, AdamW step on the LoRA weights) under
`PeakMemory`, then times further steps without the tracker. The loss variants are called the way TRL 1.16's
`SFTTrainer.compute_loss` calls them (`model(..., labels=, fused_lm_head=True)`).

The logits/loss term of a row is its peak minus the peak of the same step with a loss that needs no LM head
(the mean square of the last hidden states): what the LM head, the logits and the loss add on top of the body.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from lowmem_ft.recipe.load import resolve
from lowmem_ft.train.losses import chunk_tokens_for, install_loss_head
from lowmem_ft.train.measure.peak import PeakMemory
from lowmem_ft.train.model import build_model

VOCAB = 151_936  # Qwen2 / Qwen2.5 tokenizer vocabulary (config.json vocab_size)
GB = 1e9


def write_model(out: Path, hidden: int, layers: int) -> Path:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return out


def body_only_loss(model, ids, labels):
    """A loss that needs no LM head: isolates the body's share of the peak."""
    base = model.get_base_model()
    hidden = base.base_model(input_ids=ids, use_cache=False).last_hidden_state
    return hidden.float().pow(2).mean()


def run_row(path: str, args, *, loss: str, offload: bool = False) -> dict:
    recipe = resolve(
        "8gb",
        {
            "model": {"name_or_path": path, "compute_dtype": args.dtype},
            "memory": {"max_seq_len": args.seq, "activation_offloading": offload, "chunked_loss": loss == "chunked"},
        },
    )
    torch.manual_seed(0)
    model = build_model(recipe)
    model.train()
    if loss in ("chunked", "full"):
        install_loss_head(model, chunked=loss == "chunked")
    elif loss == "trl":
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model.get_base_model(), outputs=("log_probs", "entropy", "is_top1"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, VOCAB, (1, args.seq))
    labels = ids.clone()

    def step():
        if loss == "body":
            value = body_only_loss(model, ids, labels)
        elif loss == "hf":
            value = model(input_ids=ids, labels=labels).loss
        else:
            value = model(input_ids=ids, labels=labels, fused_lm_head=True).loss
        value.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return value.item()

    with PeakMemory(device="cpu") as pm:
        start = pm.live_bytes
        value = step()
    # CPU seconds of this process (all threads), not wall time: the yardstick machine is shared, and other
    # processes' load would otherwise show up as our cost.
    times = []
    for _ in range(args.steps):
        t = time.process_time()
        step()
        times.append(time.process_time() - t)
    return {"peak": pm.peak_bytes - start, "loss": value, "seconds": min(times) if times else float("nan")}


def offloaded_bytes(path: str, args) -> int:
    """Bytes transformers' offload hands to save_on_cpu per step (recorded; nothing leaves a CPU)."""
    import transformers.modeling_utils as mu

    seen: list[int] = []

    class Recording(torch.autograd.graph.saved_tensors_hooks):
        def __init__(self, pin_memory=False, device_type="cuda"):
            super().__init__(lambda t: seen.append(t.numel() * t.element_size()) or t, lambda t: t)

    real_save, real_available = mu.save_on_cpu, torch.accelerator.is_available
    mu.save_on_cpu, torch.accelerator.is_available = Recording, lambda: True
    try:
        recipe = resolve(
            "8gb",
            {
                "model": {"name_or_path": path, "compute_dtype": args.dtype},
                "memory": {"activation_offloading": True},
            },
        )
        model = build_model(recipe)
        model.train()
        ids = torch.randint(0, VOCAB, (1, args.seq))
        body_only_loss(model, ids, ids).backward()
    finally:
        mu.save_on_cpu, torch.accelerator.is_available = real_save, real_available
    return sum(seen)


HF_ROW = ("hf", "`model(labels=…)`: transformers loss, logits returned")
ROWS = [
    ("body", "no LM head (body only: reference)"),
    ("full", "standard transformers loss over full logits (plain HF Trainer)"),
    ("trl", "`chunked_loss: false`: TRL 1.16's fused LM head (torch fallback on CPU)"),
    ("chunked", "`chunked_loss: true`: lowmem-ft chunked loss"),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devkit.bench.savers", description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=1, help="timed steps after the measured one")
    parser.add_argument("--hf", action="store_true", help="also run the model's own loss (logits returned)")
    parser.add_argument("--out", help="also write the markdown table to this file")
    args = parser.parse_args(argv)
    rows = ROWS[:1] + [HF_ROW] + ROWS[1:] if args.hf else ROWS
    torch.set_num_threads(min(2, os.cpu_count() or 1))

    with tempfile.TemporaryDirectory() as tmp:
        path = str(write_model(Path(tmp) / "qwen2-152k", args.hidden, args.layers))
        results = {}
        for key, label in rows:
            print(f"running {label} …", file=sys.stderr, flush=True)
            results[key] = run_row(path, args, loss=key)
        moved = offloaded_bytes(path, args)

    body = results["body"]["peak"]
    full_term = results["full"]["peak"] - body
    full_time = results["full"]["seconds"]
    n = args.seq
    lines = [
        f"Qwen2 config, vocab {VOCAB:,}, hidden {args.hidden}, {args.layers} layers; QLoRA NF4 + LoRA r16 + "
        f"checkpointing; batch 1 × {n:,} tokens; compute {args.dtype}; chunk {chunk_tokens_for(VOCAB)} tokens. "
        f"{platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads. "
        f"Peaks by `PeakMemory` (exact live tensor bytes), step = forward + backward + AdamW step; "
        f"time = CPU seconds of the process for one step after the measured one (min of {args.steps}).",
        "",
        "| loss | peak GB | logits/loss term GB | term vs full logits | CPU s/step | time vs full logits | loss value |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key, label in rows:
        r = results[key]
        term = r["peak"] - body
        cut = "" if key == "body" else f"{100 * (term / full_term - 1):+.0f} %"
        speed = "" if key == "body" else f"{r['seconds'] / full_time:.2f}×"
        lines.append(
            f"| {label} | {r['peak'] / GB:.3f} | {term / GB:.3f} | {cut} | {r['seconds']:.2f} | {speed} "
            f"| {r['loss']:.4f} |"
        )
    logits_fp32 = n * VOCAB * 4
    lines += [
        "",
        f"One `(tokens, vocab)` fp32 logits tensor is {logits_fp32 / GB:.3f} GB at this length.",
        f"`activation_offloading: true`: the step hands {moved / 1e6:.3f} MB to `save_on_cpu` "
        f"(= {args.layers} layers × {n} tokens × hidden {args.hidden} × {torch.finfo(getattr(torch, args.dtype)).bits // 8} B: "
        "one layer input per checkpointed layer). On the CPU there is no device to free, so its peak row would equal "
        "the one without; on CUDA these bytes leave the device (`tests/train/test_model.py`, requires_cuda).",
    ]
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        command = "python -m devkit.bench.savers " + " ".join(argv if argv is not None else sys.argv[1:])
        Path(args.out).write_text(
            f"# Memory savers on the CPU yardstick\n\n`{command.strip()}`\n\n{table}\n", encoding="utf-8"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
