"""`pivotrl-pipeline`: the command line.

Each sub-command lives in the module that implements it and exposes two functions,
``add_arguments(parser)`` and ``run(args) -> int``; only the chosen one is imported, so `--help` and the
cheap commands never pay for importing dask or torch. A `UserError` anywhere becomes one line on stderr and
exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

from pivotrl.errors import UserError

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "submit": ("pivotrl.submit", "run a pipeline on a Dask cluster"),
    "validate": ("pivotrl.validate", "dry run: dataset, split, tokenizers, rendered prompts (no weights)"),
    "bootstrap": ("pivotrl.engines.bootstrap", "build the version-0 policy and GenRM judge"),
    "simulate": ("pivotrl.sim.cli", "simulate a workload under every deployment paradigm"),
    "plan": ("pivotrl.sim.plan_cli", "what-if table over paradigms and splits for a workload"),
}


class OneLineParser(argparse.ArgumentParser):
    """argparse, except that a usage error is one line plus a hint to `--help` (exit 2), not the usage
    block: the mistake is what a user needs to see. Subcommand parsers inherit the class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = OneLineParser(prog="pivotrl-pipeline", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == only:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    if chosen is not None and chosen not in SUBCOMMANDS:
        print(
            f"pivotrl-pipeline: unknown command {chosen!r}; choose from {', '.join(SUBCOMMANDS)}",
            file=sys.stderr,
        )
        return 2
    parser = build_parser(only=chosen)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed its one-line usage error
        return int(exc.code or 0) and 2
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(importlib.import_module(SUBCOMMANDS[args.command][0]).run(args) or 0)
    except UserError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)  # one line, whatever raised it
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
