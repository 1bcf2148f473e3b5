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

from .errors import UsageError

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
    """benchmarks/suite.py beside the package's source tree (an editable install), else in
    the current directory or one of its parents."""
    package_root = Path(__file__).resolve().parents[2]
    here = Path.cwd().resolve()
    for root in (package_root, here, *here.parents):
        if (root / SUITE).is_file():
            return root / SUITE
    raise UsageError(
        f"no {SUITE} found beside the installed package ({package_root}) nor in {here} or its "
        "parents: the benchmarks live in the repository, not the wheel. Run from a checkout "
        "(git clone ...; pip install -e .; cd into it)."
    )


def run(args: argparse.Namespace) -> int:
    suite = find_suite()
    suite_args = ["--help"] if args.suite_help else list(args.extra)
    # The suite's own process: it starts one process per system itself and reads sys.argv.
    return subprocess.call([sys.executable, str(suite), *suite_args], cwd=suite.parents[1])
