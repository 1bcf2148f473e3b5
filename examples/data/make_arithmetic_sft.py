# Regenerate the bundled data (writes examples/data/arithmetic_sft.jsonl):
#   python examples/data/make_arithmetic_sft.py
"""Write the small arithmetic SFT dataset that `examples/sft.py` trains on.

Rows are TRL prompt-completion pairs such as ``{"prompt": "12+7=", "completion": "19"}``; the
rows themselves come from ``hf_superoffload.recipes.arithmetic`` (so that ``hf-superoffload
demo`` has them in an installed package too), whose docstring says how they are drawn.
``tests/test_example_sft.py`` checks the bundled file against a fresh run of this script.
"""

from __future__ import annotations

from pathlib import Path

from hf_superoffload.recipes.arithmetic import SFT_ROWS, make_sft_rows, regenerate

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "arithmetic_sft.jsonl"


def main(argv: list[str] | None = None) -> None:
    regenerate(make_sft_rows, SFT_ROWS, 0, DEFAULT_OUTPUT, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
