"""The `lowmem-ft` command line: a thin dispatcher over one module per subcommand in `lowmem_ft.commands`.

Each command module has `add_parser(subparsers)` and `run(args) -> int`. A `UserError` anywhere becomes one
line on stderr and exit code 2; `--debug` shows the traceback instead. A flag argparse refuses (a bad value, a
missing required flag) is one line too, naming the flag, instead of argparse's usage block. `--quiet` and `--debug`
are accepted before or after any command (`lowmem_ft.console` says what each shows).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys

from lowmem_ft import __version__, console
from lowmem_ft.errors import UserError

# Subcommands in the order `--help` lists them; each is lowmem_ft.commands.<module>.
COMMANDS = ["train", "plan", "recipes", "data", "report", "doctor", "generate", "merge", "export", "eval"]


def _available_commands():
    for name in COMMANDS:
        try:
            yield importlib.import_module(f"lowmem_ft.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"lowmem_ft.commands.{name}":
                raise


class Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line (the usage block it prints by default is what `--help` is for)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _console_flags(parser: argparse.ArgumentParser, default) -> None:
    """--quiet / --debug on a parser; on subcommands their default is SUPPRESS, so they never undo the global flag."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--quiet", action="store_true", default=default, help="print only errors, warnings and the final summary"
    )
    group.add_argument("--debug", action="store_true", default=default, help="show full tracebacks and library logs")


def _subparsers(parser: argparse.ArgumentParser):
    """Every subcommand parser below `parser` (`data stats` too)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                yield sub
                yield from _subparsers(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="lowmem-ft",
        description="Fine-tune large language models on small GPUs: pick settings that fit a VRAM target, "
        "explain where the memory goes, and train with QLoRA/LoRA on the Hugging Face stack.",
    )
    parser.add_argument("--version", action="version", version=f"lowmem-ft {__version__}")
    _console_flags(parser, False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _available_commands():
        module.add_parser(sub)
    parser.commands = sub.choices  # type: ignore[attr-defined]  # each command's parser, for its own errors
    for subparser in _subparsers(parser):
        _console_flags(subparser, argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # named by the command they were given to, not by the top-level parser
            parser.commands.get(args.command, parser).error(f"unrecognized arguments: {' '.join(extra)}")
        if args.quiet and args.debug:  # one before the command, the other after it
            parser.error("--quiet and --debug exclude each other")
    except SystemExit as exc:  # --help, --version, or a flag refused (already printed): a code, not an exception
        return int(exc.code or 0)
    if args.command is None:
        parser.print_help()
        return 2
    debug = console.setup(quiet=args.quiet, debug=args.debug) == "debug"
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        if debug:
            raise
        _end_progress_bars()
        print(f"lowmem-ft {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"lowmem-ft {args.command}: interrupted", file=sys.stderr)
        return 130


def _end_progress_bars() -> None:
    """Close the progress bars still open (an error mid-training): the bar's line ends, and the error line starts a
    line of its own instead of being written over the bar (tqdm redraws its line with a carriage return)."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ()) or ()):
        with contextlib.suppress(Exception):  # a bar that cannot close must not hide the error being reported
            bar.close()


if __name__ == "__main__":
    sys.exit(main())
