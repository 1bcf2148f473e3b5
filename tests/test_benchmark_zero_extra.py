"""The benchmarks' BENCH_ZERO_EXTRA (benchmarks/systems.py): the zero_optimization keys a run
adds to the DeepSpeed systems' shared config, refused with the variable's name when it is not a
JSON object."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import systems


def test_unset_or_blank_adds_nothing(monkeypatch):
    monkeypatch.delenv(systems.ZERO_EXTRA_ENV, raising=False)
    assert systems._zero_extra() == {}
    monkeypatch.setenv(systems.ZERO_EXTRA_ENV, "  ")
    assert systems._zero_extra() == {}


def test_a_json_object_gives_its_keys(monkeypatch):
    monkeypatch.setenv(
        systems.ZERO_EXTRA_ENV,
        '{"stage3_param_persistence_threshold": 1000000000, "overlap_comm": false}',
    )
    assert systems._zero_extra() == {
        "stage3_param_persistence_threshold": 1_000_000_000,
        "overlap_comm": False,
    }


@pytest.mark.parametrize(
    "text, says",
    [("{stage3: 1}", "is not JSON"), ("[1, 2]", "must be a JSON object"), ("7", "JSON object")],
)
def test_anything_else_is_refused_by_name(monkeypatch, text, says):
    monkeypatch.setenv(systems.ZERO_EXTRA_ENV, text)
    with pytest.raises(ValueError, match=f"BENCH_ZERO_EXTRA.*{says}"):
        systems._zero_extra()
