"""The bundled arithmetic data of the demo: SFT prompt-completion rows and DPO preference pairs.

SFT rows look like ``{"prompt": "12+7=", "completion": "19"}``: addition and subtraction of two
numbers in 0..99 and multiplication of two numbers in 0..12, each problem once (the 2000 default
rows hold 927 sums, 916 differences and 157 of the 169 possible products). Loss on the
completion alone (TRL's default for prompt-completion data) makes the model learn the answers
rather than the uniformly random operands.

DPO pairs add a wrong answer: ``{"prompt": "12+7=", "chosen": "19", "rejected": "-19"}``, the
answer with its sign flipped (a small positive number for 0). Which sign is right follows from
the operator for sums and products and from comparing the operands for differences, so a tiny
random model learns the preference within the demo's steps, where a near miss (18 for 19)
would need the arithmetic itself.

The rows live here, in the package, so that ``hf-superoffload demo`` runs from an installed
wheel; ``examples/data/make_arithmetic_*.py`` write the same rows to the bundled jsonl files,
and the tests check that those files are exactly this module's output. The only randomness used
is ``random.Random(seed).random()``, whose sequence Python guarantees across versions
(``randrange``, ``choice`` and ``shuffle`` carry no such guarantee), so the output is
byte-for-byte reproducible.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

# (operator, largest operand, relative frequency)
OPERATIONS = (("+", 99, 0.4), ("-", 99, 0.4), ("*", 12, 0.2))
SFT_ROWS, DPO_ROWS = 2000, 600
DPO_SEED = 1  # a different stream from the SFT rows', so the pairs are not the SFT prompts


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


def _problems(num_rows: int, rng: random.Random):
    """`num_rows` unique (prompt, answer) problems, in generation order."""
    max_unique = sum((hi + 1) ** 2 for _, hi, _ in OPERATIONS)
    if not 0 < num_rows <= max_unique:
        raise ValueError(f"num_rows must be in 1..{max_unique}, got {num_rows}")
    seen: set[str] = set()
    while len(seen) < num_rows:
        op, hi = _operation(rng.random())
        a, b = _pick(rng, hi + 1), _pick(rng, hi + 1)
        prompt = f"{a}{op}{b}="
        if prompt in seen:
            continue
        seen.add(prompt)
        yield prompt, a + b if op == "+" else a - b if op == "-" else a * b


def make_sft_rows(num_rows: int = SFT_ROWS, seed: int = 0) -> list[dict[str, str]]:
    """Prompt-completion rows for TRL's SFTTrainer."""
    rng = random.Random(seed)
    return [{"prompt": p, "completion": str(answer)} for p, answer in _problems(num_rows, rng)]


def make_dpo_rows(num_rows: int = DPO_ROWS, seed: int = DPO_SEED) -> list[dict[str, str]]:
    """Preference pairs for TRL's DPOTrainer: the right answer chosen, its sign flipped
    rejected."""
    rng = random.Random(seed)
    rows = []
    for prompt, answer in list(_problems(num_rows, rng)):
        wrong = -answer if answer else 1 + _pick(rng, 9)
        rows.append({"prompt": prompt, "chosen": str(answer), "rejected": str(wrong)})
    return rows


def write_jsonl(rows: list[dict[str, str]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def regenerate(
    make_rows: Callable[[int, int], list[dict[str, str]]],
    num_rows: int,
    seed: int,
    output: Path,
    description: str,
    argv: list[str] | None = None,
) -> None:
    """The command line of ``examples/data/make_arithmetic_*.py``: write ``make_rows``'s rows
    to ``--output`` (each script gives its kind's defaults)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--output", type=Path, default=output)
    parser.add_argument("--num-rows", type=int, default=num_rows)
    parser.add_argument("--seed", type=int, default=seed)
    args = parser.parse_args(argv)
    rows = make_rows(args.num_rows, args.seed)
    write_jsonl(rows, args.output)
    print(f"wrote {len(rows)} rows to {args.output}")
