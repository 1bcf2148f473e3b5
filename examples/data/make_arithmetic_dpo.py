# Regenerate the bundled preference pairs (writes examples/data/arithmetic_dpo.jsonl):
#   python examples/data/make_arithmetic_dpo.py
"""Write the small arithmetic DPO dataset that `examples/dpo.py` trains on.

Rows are TRL preference pairs such as ``{"prompt": "12+7=", "chosen": "19", "rejected":
"-19"}``: the right answer is chosen, the answer with its sign flipped rejected. The rows come from
``hf_superoffload.recipes.arithmetic``; ``tests/test_recipes.py`` checks the bundled file
against a fresh run of this script.
"""

from __future__ import annotations

from pathlib import Path

from hf_superoffload.recipes.arithmetic import DPO_ROWS, DPO_SEED, make_dpo_rows, regenerate

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "arithmetic_dpo.jsonl"


def main(argv: list[str] | None = None) -> None:
    regenerate(make_dpo_rows, DPO_ROWS, DPO_SEED, DEFAULT_OUTPUT, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
