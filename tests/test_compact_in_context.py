"""benchmarks/compact_in_context.py --quick on the CPU: a row with a positive rate for every
pass under every condition that needs no GPU, and none of those that do."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from compact_in_context import CPU_CONDITIONS, CSV_FIELDS, PASSES

ROOT = Path(__file__).resolve().parents[1]


def test_quick_run_gives_every_pass_under_every_cpu_condition(tmp_path):
    from hf_superoffload import ops

    ops.prepare()  # a first build here, not under the run's timeout
    out = tmp_path / "rows.csv"
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)}
    script = ROOT / "benchmarks" / "compact_in_context.py"
    done = subprocess.run(
        [sys.executable, str(script), "--quick", "--memory", "both", "--csv", str(out)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "pinned memory is unavailable" in done.stdout  # said, not silently skipped
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == CSV_FIELDS
    got = {(r["pass"], r["condition"]): r for r in rows}
    assert len(got) == len(rows)  # one row each
    assert set(got) == {(p, c) for p in PASSES for c in CPU_CONDITIONS}
    for row in rows:
        assert row["memory"] == "pageable"
        assert float(row["melem_per_s"]) > 0 and float(row["seconds"]) > 0
        assert int(row["calls"]) >= 1 and int(row["numel"]) == 8 * 2**20
    for name in PASSES:
        assert float(got[name, "alone"]["ratio_to_alone"]) == 1.0
        assert got[name, "one call"]["calls"] == "1"
        assert int(got[name, "alone"]["calls"]) == 8  # 1M-element pieces
    assert done.stdout.rstrip().splitlines()[-1].startswith("exact adam_step")  # table last
