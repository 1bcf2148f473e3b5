# Regenerate the bundled data (writes examples/data/arithmetic_sft.jsonl):
#   python examples/data/make_arithmetic_sft.py
"""Write the small arithmetic SFT dataset that `examples/sft.py` trains on.

Rows are TRL prompt-completion pairs such as ``{"prompt": "12+7=", "completion": "19"}``; the
rows themselves come from ``hf_superoffload.recipes.arithmetic`` (so that ``hf-superoffload
demo`` has them in an installed package too), whose docstring says how they are drawn.
``tests/test_example_sft.py`` checks the bundled file against a fresh run of this script.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_superoffload.recipes.arithmetic import SFT_ROWS, make_sft_rows, write_jsonl

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "arithmetic_sft.jsonl"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--num-rows", type=int, default=SFT_ROWS)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = make_sft_rows(args.num_rows, args.seed)
    write_jsonl(rows, args.output)
    print(f"wrote {len(rows)} rows to {args.output}")


if __name__ == "__main__":
    main()
