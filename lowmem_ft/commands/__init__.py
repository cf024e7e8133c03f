"""One module per `lowmem-ft` subcommand: `add_parser(subparsers)` and `run(args) -> int`; `flags` holds the flag
types they share (values checked, in one line, while the command line is parsed)."""
