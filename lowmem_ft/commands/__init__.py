"""One module per `lowmem-ft` subcommand: `add_parser(subparsers)` and `run(args) -> int`."""
