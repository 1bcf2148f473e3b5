"""``hf-superoffload bench [SUITE ARGS...]``: the benchmark suite, ``benchmarks/suite.py`` of a
repository checkout (the benchmarks are not part of the installed package).

The suite runs each system in its own process and writes a CSV, a plot and logs; every argument
after ``bench`` goes to it (``--suite-help`` lists them).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from .checkout import find_checkout

PASSES_THROUGH = True
SUITE = Path("benchmarks") / "suite.py"


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "bench",
        allow_abbrev=False,  # the suite's options pass through whole
        help="run the benchmark suite (benchmarks/suite.py of a repository checkout)",
        description="Run benchmarks/suite.py from the repository checkout this package was "
        "installed from (pip install -e .), or from the current directory's checkout: "
        "hf_superoffload against no offload, DeepSpeed ZeRO-Offload and SuperOffload and "
        "torchao on one model point, each in its own process. Every other argument goes to "
        "the suite; --suite-help lists them. Needs a GPU.",
    )
    parser.add_argument(
        "--suite-help", action="store_true", help="list the suite's own arguments and exit"
    )
    parser.set_defaults(run=run, passes_through=PASSES_THROUGH)


def find_suite() -> Path:
    """benchmarks/suite.py of the repository checkout (checkout.py says where it looks)."""
    return find_checkout(SUITE) / SUITE


def run(args: argparse.Namespace) -> int:
    suite = find_suite()
    suite_args = ["--help"] if args.suite_help else list(args.extra)
    # The suite's own process: it starts one process per system itself and reads sys.argv.
    # It runs in the caller's directory, where relative paths (--out-dir, --model-config) were
    # meant; the suite finds its own modules beside its file.
    return subprocess.call([sys.executable, str(suite), *suite_args])
