"""docs/troubleshooting.md has a row for these refusals and warnings, quoting them as the code
raises or logs them: the standalone engine's refused step and ZeRO-3's refused hand-set
accumulation boundary (both when the host cannot hold an accumulation buffer nobody declared),
and the skipped checkpoint that lacks DeepSpeed's ``latest`` file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hf_superoffload.integrations import save

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_superoffload"


def _rows() -> list[str]:
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    return [line for line in text.splitlines() if line.startswith("| `") or "| WARNING" in line]


def _quoted(fragment: str) -> bool:
    """Whether a row's message (its first cell) quotes ``fragment``."""
    return any(fragment in row.split(" | ")[0] for row in _rows())


@pytest.mark.parametrize(
    "source, fragment",
    [
        ("engine/grad_arrival.py", "SuperOffloadOptimizer refused the step: "),
        ("engine/grad_arrival.py", "The step's gradients so far were dropped and its early updates undone."),
        (
            "zero3/backward_offload.py",
            "SuperOffload on ZeRO-3 refused set_gradient_accumulation_boundary(False): ",
        ),
    ],
)  # fmt: skip
def test_a_refusal_the_code_raises_has_a_row(source, fragment):
    code = (PACKAGE / source).read_text()
    assert fragment in re.sub(r'"\s*\n\s*f?"', "", code), f"{source} no longer says {fragment!r}"
    assert _quoted(fragment.strip()), f"no row of docs/troubleshooting.md quotes {fragment!r}"


def test_the_skipped_checkpoint_row_quotes_deepspeeds_missing_latest_file(tmp_path):
    folder = tmp_path / "checkpoint-5"
    folder.mkdir()
    (folder / save.TRAINER_STATE_NAME).write_text(json.dumps({"global_step": 5}))
    missing = save._unfinished_part(str(folder), deepspeed=True)
    assert missing is not None and "latest" in missing
    assert _quoted(f"({missing})"), missing
    assert _quoted("skipping …/checkpoint-N: its save did not finish")
