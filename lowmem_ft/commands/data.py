"""`lowmem-ft data stats FILE --model M`: what the data is in tokens, and what a token budget would cut.

Tokenizes FILE exactly as `train` does (same formats, chat template, masking and content-keyed cache, so a later
`train` on the same data does not tokenize again) and prints the sample count, p50/p90/p99/max token lengths, a
histogram, and for each candidate max length how many samples and tokens keep_start/keep_end would cut.
"""

from __future__ import annotations

import argparse
import json

from lowmem_ft.data.formats import FORMATS


def add_parser(sub) -> None:
    p = sub.add_parser(
        "data",
        help="inspect training data: token-length profile and what a max length would cut",
        description="Inspect JSONL training data. `data stats FILE --model M` prints its token-length profile.",
    )
    dsub = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND", required=True)
    s = dsub.add_parser(
        "stats",
        help="token-length profile of a data file",
        description="Sample count, token-length p50/p90/p99/max, a histogram, and what a max length would cut. "
        "Tokenized with MODEL's tokenizer exactly as `train` does.",
    )
    s.add_argument("file", help="JSONL data file")
    s.add_argument("--model", required=True, help="hub id or local directory whose tokenizer counts the tokens")
    s.add_argument("--max-len", type=int, metavar="N", help="show what a max length of N tokens would cut")
    s.add_argument("--format", choices=FORMATS, default="auto", help="force the data format (default: detect)")
    s.add_argument("--skip-bad-lines", action="store_true", help="skip malformed lines and report them")
    s.add_argument("--train-on-prompt", action="store_true", help="count loss tokens on prompts too")
    s.add_argument(
        "--chat-template",
        metavar="NAME_OR_FILE",
        help="chat template for chat data, as data.chat_template (a name such as mistral or a .jinja file)",
    )
    s.add_argument("--trust-remote-code", action="store_true", help="allow the model repository's tokenizer code")
    s.add_argument("--json", action="store_true", help="print the profile as JSON")
    s.set_defaults(func=run)


def _candidates(profile, max_len: int | None) -> list[int]:
    if max_len is not None:
        return [max_len]
    # Powers of two from just under p50 up to the first that holds everything: the lengths people pick.
    out, n = [], 1 << max(profile.p50.bit_length() - 1, 0)
    while True:
        out.append(n)
        if n >= profile.max:
            return out
        n *= 2


def run(args: argparse.Namespace) -> int:
    from lowmem_ft.data.profile import profile_of
    from lowmem_ft.data.tokenize import load_tokenizer, tokenize_file

    if args.max_len is not None and args.max_len < 1:
        from lowmem_ft.errors import UserError

        raise UserError(f"--max-len must be at least 1, got {args.max_len}")
    tokenizer = load_tokenizer(args.model, args.trust_remote_code, args.chat_template)
    tok = tokenize_file(
        args.file,
        tokenizer,
        fmt=args.format,
        train_on_prompt=args.train_on_prompt,
        skip_bad_lines=args.skip_bad_lines,
    )
    profile = profile_of(tok)
    cuts = [(n, *profile.over(n)) for n in _candidates(profile, args.max_len)]
    if args.json:
        out = {
            "file": args.file,
            "format": tok.format,
            "skipped_lines": tok.skipped,
            **profile.to_dict(),
            "cuts": [{"max_len": n, "samples_over": s, "tokens_cut": t} for n, s, t in cuts],
        }
        print(json.dumps(out, indent=2))
        return 0
    print(f"{args.file}: {profile.count} samples, format {tok.format}, {profile.total_tokens} tokens")
    if tok.skipped:
        print(f"skipped {len(tok.skipped)} bad lines:")
        for line in tok.skipped:
            print(f"  {line}")
    print(
        f"tokens per sample: p50 {profile.p50}  p90 {profile.p90}  p99 {profile.p99}  max {profile.max}  "
        f"mean {profile.mean}"
    )
    print("\nhistogram (tokens per sample):")
    widest = max(c for _, c in profile.histogram)
    prev = 0
    for edge, count in profile.histogram:
        bar = "█" * max(1 if count else 0, round(40 * count / widest))
        print(f"  {prev + 1:>6}–{edge:<6} {count:>8}  {bar}")
        prev = edge
    print("\nwhat a max length cuts (keep_start / keep_end; drop removes the samples instead):")
    print(f"  {'max_len':>8} {'samples over':>13} {'% samples':>10} {'tokens cut':>11} {'% tokens':>9}")
    for n, samples, tokens in cuts:
        print(
            f"  {n:>8} {samples:>13} {100 * samples / profile.count:>9.1f}% {tokens:>11} "
            f"{100 * tokens / max(profile.total_tokens, 1):>8.1f}%"
        )
    return 0
