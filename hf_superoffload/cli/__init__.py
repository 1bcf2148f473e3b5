"""The ``hf-superoffload`` command line (also ``python -m hf_superoffload``).

Subcommands: ``env`` (what this machine offers SuperOffload, like DeepSpeed's ``ds_report``)
and ``plan`` (whether a model's full fine-tuning fits given GPUs and host memory, part by
part). Each lives in its own module and registers itself through ``add_parser``.
"""

from __future__ import annotations

import argparse
import sys

from .. import __version__
from . import env, plan
from .errors import EXIT_BAD_INPUT, UsageError

PROG = "hf-superoffload"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="SuperOffload for Hugging Face: check this machine and plan a run before "
        "renting one.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    env.add_parser(commands)
    plan.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; returns its exit code (argparse itself exits 2 on bad syntax)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_BAD_INPUT
    try:
        return args.run(args)
    except UsageError as error:
        print(f"{PROG} {args.command}: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT


__all__ = ["build_parser", "main"]
