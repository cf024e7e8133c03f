"""Tokenization throughput: lowmem-ft's batched, cached pipeline vs TRL's own preprocessing, same data, same run.

    python -m devkit.bench.tokenization [--samples 4000] [--model DIR] [--out benchmarks/tokenize.md]

Both sides start from the same TRL records (after JSONL validation) and end with training-ready `input_ids` +
`labels` fitted to --max-len: TRL's `SFTTrainer._prepare_dataset` (its per-example map, label building and
truncation) against `lowmem_ft.data.tokenize.tokenize_records` + `lowmem_ft.data.budget.apply_budget`. A third
column is a second `tokenize_file` on the same file: the content-keyed cache hit. Best of --repeats; the ratio
column is TRL's time / ours (> 1: we are faster). The tokenizer is the embedded tiny model's unless --model.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m devkit.bench.tokenization", description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model", help="tokenizer directory (default: the embedded tiny model's)")
    parser.add_argument("--out", default="benchmarks/tokenize.md")
    args = parser.parse_args()

    import datasets
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from devkit.bench.skewed_data import write_dataset
    from lowmem_ft.data.budget import apply_budget
    from lowmem_ft.data.chat import chat_template_for, set_template
    from lowmem_ft.data.readers import load_file
    from lowmem_ft.data.tokenize import tokenize_file, tokenize_records

    datasets.disable_progress_bars()
    work = Path(tempfile.mkdtemp(prefix="bench-tok-"))
    os.environ["LOWMEM_FT_CACHE"] = str(work / "cache")
    if args.model:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    else:
        from devkit.tiny import build_tokenizer

        tokenizer = build_tokenizer()
    rows = []
    for fmt in ("text", "prompt_completion", "messages"):
        path = write_dataset(work / f"{fmt}.jsonl", fmt, args.samples)
        records = load_file(path).records
        chat = fmt == "messages"
        template = chat_template_for(tokenizer, False, set_template(tokenizer, None)) if chat else None
        sft_args = SFTConfig(
            output_dir=str(work / "trl"),
            max_length=args.max_len,
            assistant_only_loss=fmt == "messages",
            report_to=[],
            use_cpu=True,
        )
        owner = SimpleNamespace(
            _tokenizer=tokenizer, chat_template=None, completion_only_loss=fmt == "prompt_completion"
        )

        def trl(records=records, sft_args=sft_args, owner=owner):
            return SFTTrainer._prepare_dataset(owner, Dataset.from_list(records), tokenizer, sft_args, False, None, "t")

        def ours(records=records, fmt=fmt, template=template):
            ds = tokenize_records(records, fmt, tokenizer, False, template)
            return apply_budget(ds, args.max_len, "keep_start", 0, fmt)[0]

        t_trl, t_ours = best(trl, args.repeats), best(ours, args.repeats)
        a, b = trl(), ours()
        assert a["input_ids"] == b["input_ids"] and a["labels"] == b["labels"], f"{fmt}: outputs differ"
        tokenize_file(path, tokenizer)  # fill the cache
        t_cached = best(lambda path=path: tokenize_file(path, tokenizer), args.repeats)
        tokens = sum(len(x) for x in b["input_ids"])
        rows.append((fmt, len(records), tokens, t_trl, t_ours, t_cached))

    header = "| format | samples | tokens | TRL s | lowmem-ft s | cached s | TRL/ours | tokens/s ours |"
    lines = [header, "|" + "---|" * 8]
    for fmt, n, tokens, t_trl, t_ours, t_cached in rows:
        lines.append(
            f"| {fmt} | {n} | {tokens} | {t_trl:.2f} | {t_ours:.2f} | {t_cached:.3f} | "
            f"{t_trl / t_ours:.2f}× | {tokens / t_ours:,.0f} |"
        )
    table = "\n".join(lines)
    print(table)
    note = (
        f"# Tokenization: lowmem-ft vs TRL preprocessing\n\n`python -m devkit.bench.tokenization --samples {args.samples} "
        f"--max-len {args.max_len}` ({'tokenizer ' + args.model if args.model else 'embedded tiny BPE tokenizer'}, "
        f"best of {args.repeats}, same process; outputs asserted identical). Machine: shared 2-core CPU, "
        "other jobs running, so absolute times are noisy; the ratio is measured back to back.\n\n"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(note + table + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
