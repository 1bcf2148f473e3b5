# Regenerate the bundled data (writes examples/data/arithmetic_sft.jsonl):
#   python examples/data/make_arithmetic_sft.py
"""Generate the small arithmetic SFT dataset that `examples/sft.py` trains on.

Each row is a TRL prompt-completion pair such as ``{"prompt": "12+7=", "completion": "19"}``:
addition and subtraction of two numbers in 0..99 and multiplication of two numbers in 0..12.
Problems are unique (so the 2000 default rows hold 927 sums, 916 differences and 157 of the 169
possible products). Loss on the completion alone (TRL's default for prompt-completion data)
makes the model learn the answers rather than the uniformly random operands.

The output is byte-for-byte reproducible: the only randomness used is ``random.Random(seed)
.random()``, whose sequence Python guarantees across versions (``randrange``, ``choice`` and
``shuffle`` carry no such guarantee). ``tests/test_example_sft.py`` checks the bundled file
against a fresh run of this script.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "arithmetic_sft.jsonl"
# (operator, largest operand, relative frequency)
OPERATIONS = (("+", 99, 0.4), ("-", 99, 0.4), ("*", 12, 0.2))


def _pick(rng: random.Random, n: int) -> int:
    """A uniform integer in [0, n), from `random()` only (see the module docstring)."""
    return min(int(rng.random() * n), n - 1)


def _operation(u: float) -> tuple[str, int]:
    """The (operator, largest operand) that a uniform `u` in [0, 1) falls on."""
    for op, hi, freq in OPERATIONS:
        if u < freq:
            return op, hi
        u -= freq
    return OPERATIONS[-1][:2]  # only reachable through float rounding


def make_rows(num_rows: int = 2000, seed: int = 0) -> list[dict[str, str]]:
    """`num_rows` unique prompt-completion rows, in generation order."""
    max_unique = sum((hi + 1) ** 2 for _, hi, _ in OPERATIONS)
    if not 0 < num_rows <= max_unique:
        raise ValueError(f"num_rows must be in 1..{max_unique}, got {num_rows}")
    rng = random.Random(seed)
    seen: set[str] = set()
    rows = []
    while len(rows) < num_rows:
        op, hi = _operation(rng.random())
        a, b = _pick(rng, hi + 1), _pick(rng, hi + 1)
        prompt = f"{a}{op}{b}="
        if prompt in seen:
            continue
        seen.add(prompt)
        answer = a + b if op == "+" else a - b if op == "-" else a * b
        rows.append({"prompt": prompt, "completion": str(answer)})
    return rows


def write_jsonl(rows: list[dict[str, str]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--num-rows", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rows = make_rows(args.num_rows, args.seed)
    write_jsonl(rows, args.output)
    print(f"wrote {len(rows)} rows to {args.output}")


if __name__ == "__main__":
    main()
