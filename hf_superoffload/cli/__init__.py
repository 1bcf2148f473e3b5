"""The ``hf-superoffload`` command line (also ``python -m hf_superoffload``).

Subcommands: ``env`` (what this machine offers SuperOffload, like DeepSpeed's ``ds_report``),
``plan`` (whether a model's full fine-tuning fits given GPUs and host memory, part by part),
``finetune`` (a recipe of the paper's models under accelerate and DeepSpeed ZeRO-3),
``demo`` (the main job) and ``bench`` (the benchmark suite of a checkout). Each lives in its own
module and registers itself through ``add_parser``; ``finetune``, ``demo`` and ``bench`` hand
the arguments they do not know to the job they run.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from .. import __version__
from .. import env as environment
from . import bench, demo, env, finetune, plan
from .errors import EXIT_BAD_INPUT, UsageError

PROG = "hf-superoffload"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="SuperOffload for Hugging Face: check this machine, plan a run before "
        "renting one, run the demo or the benchmark suite.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    env.add_parser(commands)
    plan.add_parser(commands)
    finetune.add_parser(commands)
    demo.add_parser(commands)
    bench.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; returns its exit code (argparse itself exits 2 on bad syntax)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passes_through", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    if args.command is None:
        parser.print_help()
        return EXIT_BAD_INPUT
    args.out = sys.stdout  # where a command prints its result
    try:
        try:
            environment.check()  # a misspelled HF_SUPEROFFLOAD_* variable, before any work
        except ValueError as error:
            raise UsageError(str(error)) from None
        if not getattr(args, "json", False):
            return args.run(args)
        # Libraries print to stdout as they load (transformers does under WANDB_MODE=offline,
        # a common cluster setting): all but the command's JSON goes to stderr, so it parses.
        with contextlib.redirect_stdout(sys.stderr):
            return args.run(args)
    except UsageError as error:
        print(f"{PROG} {args.command}: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT


__all__ = ["build_parser", "main"]
