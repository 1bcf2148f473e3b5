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
    assert systems.zero_extra() == {}
    monkeypatch.setenv(systems.ZERO_EXTRA_ENV, "  ")
    assert systems.zero_extra() == {}


def test_a_json_object_gives_its_keys(monkeypatch):
    monkeypatch.setenv(
        systems.ZERO_EXTRA_ENV,
        '{"stage3_param_persistence_threshold": 1000000000, "overlap_comm": false}',
    )
    assert systems.zero_extra() == {
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
        systems.zero_extra()


def test_the_suite_keeps_the_keys_in_each_rows_config_and_refuses_bad_ones(tmp_path):
    import csv
    import json
    import os

    from launched import ONE_PROCESS, run_launched

    suite = Path(__file__).resolve().parents[1] / "benchmarks" / "suite.py"
    small = ["--hidden", "64", "--layers", "1", "--seq", "16", "--batch", "1", "--steps", "1"]
    cmd = [sys.executable, str(suite), "--systems", "no_offload", *small]
    env = {**os.environ, systems.ZERO_EXTRA_ENV: '{"stage3_param_persistence_threshold": 7}'}
    out = tmp_path / "results"
    done = run_launched([*cmd, "--out-dir", str(out)], timeout=ONE_PROCESS, env=env)
    assert done.returncode == 0, done.stderr
    with open(out / "suite.csv", newline="") as handle:
        (row,) = csv.DictReader(handle)  # failed here (no GPU), with its config all the same
    assert json.loads(row["config"])["zero_extra"] == {"stage3_param_persistence_threshold": 7}
    env[systems.ZERO_EXTRA_ENV] = "[7]"
    refused = run_launched([*cmd, "--out-dir", str(tmp_path / "r")], timeout=ONE_PROCESS, env=env)
    assert refused.returncode != 0 and "BENCH_ZERO_EXTRA must be a JSON object" in refused.stderr
    assert not (tmp_path / "r" / "suite.csv").exists()
