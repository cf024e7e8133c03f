"""`lowmem-ft data stats SOURCE --model M`: what the data is in tokens, and what a token budget would cut.

SOURCE is anything `train --data` takes (a JSONL / JSON / Parquet / CSV / TSV file, a directory of them, a
save_to_disk directory, a Hub id), and `--recipe` / `--set data.*` give the rest of the data section (a data.mix,
streaming). It is tokenized exactly as `train` does (same sources, formats, chat template, masking, mix and
content-keyed cache, so a later `train` on the same data does not tokenize again) and the command prints the sample
count, p50/p90/p99/max token lengths, a histogram, and for each candidate max length how many samples and tokens
keep_start/keep_end would cut. A stream is profiled on its first samples, and the output says so.
"""

from __future__ import annotations

import argparse
import json

from lowmem_ft.commands import flags
from lowmem_ft.data.formats import FORMATS
from lowmem_ft.recipe.schema import KEYS, METHOD_INPUTS


def add_parser(sub) -> None:
    p = sub.add_parser(
        "data",
        help="inspect training data: token-length profile and what a max length would cut",
        description="Inspect training data. `data stats SOURCE --model M` prints its token-length profile.",
    )
    dsub = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND", required=True)
    s = dsub.add_parser(
        "stats",
        help="token-length profile of a data set",
        description="Sample count, token-length p50/p90/p99/max, a histogram, and what a max length would cut. "
        "Tokenized with MODEL's tokenizer exactly as `train` does.",
    )
    s.add_argument(
        "source",
        nargs="?",
        help=f"{KEYS['data.path'].flag_help} (data.path; omit it when --recipe or --set gives data.path or data.mix)",
    )
    s.add_argument("--data", dest="data_flag", metavar="SOURCE", help="the same as SOURCE, as `train` spells it")
    s.add_argument("--model", help="hub id or local directory whose tokenizer counts the tokens (model.name_or_path)")
    s.add_argument("--max-len", type=flags.count, metavar="N", help="show what a max length of N tokens would cut")
    s.add_argument("--split", help="split of a Hub data set, saved DatasetDict or directory (data.split)")
    s.add_argument("--subset", help="configuration of a Hub data set (data.subset)")
    s.add_argument(
        "--column",
        dest="columns",
        action="append",
        default=[],
        metavar="OURS=THEIRS",
        help="map one of our fields to the data set's column, repeatable (data.columns), e.g. --column prompt=question",
    )
    s.add_argument("--streaming", action="store_true", help="read as a stream; profile its first samples")
    s.add_argument("--format", choices=FORMATS, help="force the data format (default: detect)")
    s.add_argument("--skip-bad-lines", action="store_true", help="skip malformed lines and report them")
    s.add_argument("--train-on-prompt", action="store_true", help="count loss tokens on prompts too")
    s.add_argument(
        "--chat-template",
        metavar="NAME_OR_FILE",
        help="chat template for chat data, as data.chat_template (a name such as mistral or a .jinja file)",
    )
    s.add_argument("--trust-remote-code", action="store_true", help="allow the model repository's tokenizer code")
    s.add_argument("--recipe", metavar="NAME_OR_FILE", help="take the data (and model) keys from this recipe")
    flags.add_set(
        s, "override one recipe key, repeatable (e.g. --set 'data.mix=[{path: a.jsonl, weight: 3}, {path: b.csv}]')"
    )
    flags.add_key_flags(
        s, "--method", note="; dpo / orpo / simpo / kto profile each pair's longer row, grpo the prompts, as train does"
    )
    s.add_argument("--json", action="store_true", help="print the profile as JSON")
    s.set_defaults(func=run)


def _recipe(args: argparse.Namespace):
    """The recipe whose data section the command reads: --recipe < --set < the dedicated flags."""
    from lowmem_ft.errors import UserError
    from lowmem_ft.recipe.load import merge, parse_overrides, resolve

    if args.source and args.data_flag and args.source != args.data_flag:
        raise UserError(f"two data sources given ({args.source!r} and --data {args.data_flag!r}); pass one")
    args.source = args.source or args.data_flag
    data: dict = {}
    for item in args.columns:
        ours, sep, theirs = item.partition("=")
        if not sep or not ours or not theirs:
            raise UserError(f"--column {item!r}: expected OURS=THEIRS, e.g. --column prompt=question")
        data.setdefault("columns", {})[ours] = theirs
    given = {
        "path": args.source,
        "split": args.split,
        "subset": args.subset,
        "format": args.format,
        "streaming": args.streaming or None,
        "skip_bad_lines": args.skip_bad_lines or None,
        "train_on_prompt": args.train_on_prompt or None,
        "chat_template": args.chat_template,
    }
    data.update({k: v for k, v in given.items() if v is not None})
    model = {"name_or_path": args.model} if args.model else {}
    if args.trust_remote_code:
        model["trust_remote_code"] = True
    keys, _ = flags.key_overrides(args)
    recipe = resolve(args.recipe, merge(merge(parse_overrides(args.overrides), keys), {"data": data, "model": model}))
    if not recipe.model.name_or_path:
        raise UserError("no model given; pass --model HUB_ID_OR_PATH (its tokenizer counts the tokens)")
    return recipe


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
    from lowmem_ft.checks import check_model
    from lowmem_ft.data.prepare import load_training_data
    from lowmem_ft.data.tokenize import load_tokenizer

    recipe = _recipe(args)
    # only the tokenizer is read: a directory needs no config.json or weights, but a file or a missing path is wrong
    check_model(recipe.model.name_or_path, "--model", weights=False, config=False)
    vision = _vision(recipe)
    if vision is not None:  # image chats: tokens with their image tokens, images per sample, pixel sizes
        return _print_vision(args, vision.describe(recipe))
    tokenizer = load_tokenizer(recipe.model.name_or_path, recipe.model.trust_remote_code, recipe.data.chat_template)
    if METHOD_INPUTS[recipe.training.method].data_format:  # pairs, KTO's samples, GRPO's prompts
        return _method_stats(args, recipe, tokenizer)
    data = load_training_data(recipe, tokenizer)
    profile = data.profile()
    cuts = [(n, *profile.over(n)) for n in _candidates(profile, args.max_len)]
    skipped = [line for p in data.parts for line in p.skipped]
    if args.json:
        out = {
            "file": args.source or data.label,
            "format": data.format,
            "sources": [
                {**p.source.to_dict(), "format": p.format, "unused_columns": p.unused_columns} for p in data.parts
            ],
            "mix": data.mix,
            "skipped_lines": skipped,
            **profile.to_dict(),
            "cuts": [{"max_len": n, "samples_over": s, "tokens_cut": t} for n, s, t in cuts],
        }
        print(json.dumps(out, indent=2))
        return 0
    _print_text(args.source or data.label, data, profile, skipped, cuts)
    return 0


def _vision(recipe):
    """The run's vision side (`lowmem_ft.vision.setup.vision_of`) when the model has a config to tell; None for a
    text model or a tokenizer-only directory."""
    from pathlib import Path

    from lowmem_ft.vision.setup import vision_of

    path = Path(recipe.model.name_or_path)
    if path.is_dir() and not (path / "config.json").is_file():
        return None
    return vision_of(recipe)


def _print_vision(args: argparse.Namespace, described: dict) -> int:
    """`data stats` of image chats at the run's resolution cap (image sizes read from their headers, nothing decoded)."""
    from lowmem_ft.vision.setup import vision_lines

    if args.json:
        print(json.dumps({"file": args.source or args.data_flag, **described}, indent=2))
        return 0
    d = described["data"]
    px = d["pixels_per_image"]
    print(f"{args.source or args.data_flag}: {d['samples']} samples from {d['rows']} rows (messages + images)")
    print(
        f"  tokens per sample with their images: p50 {d['tokens_per_sample']['p50']}, max {d['tokens_per_sample']['max']}"
    )
    print(
        f"  pixels per image (as given, read from the image headers): p50 {px['p50']}, p99 {px['p99']}, max {px['max']}"
    )
    print("\n".join(vision_lines(described)))
    return 0


def _method_stats(args: argparse.Namespace, recipe, tokenizer) -> int:
    """Preference pairs (each pair's longer row: prompt + the longer answer) or GRPO prompts, profiled as `train
    --method M --vram` sizes its lengths from them (`lowmem_ft.data.prepare.length_profile`)."""
    from lowmem_ft.data.prepare import length_profile

    method = recipe.training.method
    profile = length_profile(recipe, tokenizer=tokenizer)
    one, what = {"grpo": ("prompt", "the prompt"), "kto": ("completion", "prompt + completion")}.get(
        method, ("pair", "prompt + the longer answer")
    )
    cuts = [(n, *profile.over(n)) for n in _candidates(profile, args.max_len)]
    label = args.source or recipe.data.path
    if args.json:
        out = {"file": label, "method": method, "measured": f"{one}: {what}", **profile.to_dict(),
               "cuts": [{"max_len": n, "samples_over": s, "tokens_cut": t} for n, s, t in cuts]}  # fmt: skip
        print(json.dumps(out, indent=2))
        return 0
    print(f"{label}: {profile.count} {one}s for --method {method}, {profile.total_tokens} tokens")
    print(f"tokens per {one} ({what}): p50 {profile.p50}  p90 {profile.p90}  p99 {profile.p99}  max {profile.max}  "
          f"mean {profile.mean}")  # fmt: skip
    limit = "grpo.max_prompt_length" if METHOD_INPUTS[method].data_format == "prompts" else "memory.max_seq_len"
    print(f"\nwhat {limit} would cut:")
    print(f"  {'max_len':>8} {'over':>8} {'% over':>8}")
    for n, samples, _ in cuts:
        print(f"  {n:>8} {samples:>8} {100 * samples / max(profile.count, 1):>7.1f}%")
    return 0


def _print_text(label: str, data, profile, skipped: list[str], cuts: list[tuple[int, int, int]]) -> None:
    what = f"the first {profile.sampled} samples of the stream" if profile.sampled else f"{profile.count} samples"
    print(f"{label}: {what}, format {data.format}, {profile.total_tokens} tokens")
    if data.mix:
        parts = [f"{r['source']} {r['samples']} ({100 * r['share']:.0f} %)" for r in data.mix["sources"]]
        print(f"mix ({data.mix['strategy']}, seed {data.mix['seed']}, {data.mix['counted']}): {', '.join(parts)}")
    for part in data.parts:
        if part.unused_columns:
            print(f"{part.source.label}: columns not used: {', '.join(part.unused_columns)}")
        if part.source.ignored:
            print(f"{part.source.label}: not data files, not read: {', '.join(part.source.ignored)}")
    if skipped:
        print(f"skipped {len(skipped)} bad lines:")
        for line in skipped:
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
