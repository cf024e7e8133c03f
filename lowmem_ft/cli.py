"""The `lowmem-ft` command line: a thin dispatcher over one module per subcommand in `lowmem_ft.commands`.

Each command module has `add_parser(subparsers)` and `run(args) -> int`. A `UserError` anywhere becomes one
line on stderr and exit code 2; `--debug` shows the traceback instead. A flag argparse refuses (a bad value, a
missing required flag) is one line too, naming the flag, instead of argparse's usage block.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from lowmem_ft import __version__
from lowmem_ft.errors import UserError

# Subcommands in the order `--help` lists them; each is lowmem_ft.commands.<module>.
COMMANDS = ["train", "plan", "recipes", "data", "report", "doctor", "generate", "merge"]


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


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="lowmem-ft",
        description="Fine-tune large language models on small GPUs: pick settings that fit a VRAM target, "
        "explain where the memory goes, and train with QLoRA/LoRA on the Hugging Face stack.",
    )
    parser.add_argument("--version", action="version", version=f"lowmem-ft {__version__}")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks and library logs")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _available_commands():
        module.add_parser(sub)
    parser.commands = sub.choices  # type: ignore[attr-defined]  # each command's parser, for its own errors
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # named by the command they were given to, not by the top-level parser
            parser.commands.get(args.command, parser).error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # --help, --version, or a flag refused (already printed): a code, not an exception
        return int(exc.code or 0)
    if args.command is None:
        parser.print_help()
        return 2
    debug = args.debug or bool(os.environ.get("LOWMEM_FT_DEBUG"))
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        if debug:
            raise
        print(f"lowmem-ft {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"lowmem-ft {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
