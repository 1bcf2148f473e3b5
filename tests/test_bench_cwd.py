"""``hf-superoffload bench`` runs the suite in the caller's directory: relative paths given to it
(--out-dir, --model-config) land where the caller meant, not in the checkout."""

from __future__ import annotations

from pathlib import Path

from hf_superoffload.cli import bench, main

# A stand-in suite that writes into its --out-dir as the real one does (suite.csv).
FAKE_SUITE = """
import argparse
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("--out-dir", type=Path)
out = parser.parse_args().out_dir
out.mkdir(parents=True)
(out / "suite.csv").write_text("system\\n")
"""


def test_relative_out_dir_lands_in_callers_directory(tmp_path, monkeypatch):
    suite = tmp_path / "checkout" / "benchmarks" / "suite.py"
    suite.parent.mkdir(parents=True)
    suite.write_text(FAKE_SUITE)
    caller = tmp_path / "caller"
    caller.mkdir()
    monkeypatch.setattr(bench, "find_suite", lambda: suite)
    monkeypatch.chdir(caller)
    assert main(["bench", "--out-dir", "results"]) == 0
    assert (caller / "results" / "suite.csv").is_file()
    assert not (tmp_path / "checkout" / "results").exists()


def test_suite_finds_its_own_modules_from_elsewhere(tmp_path, monkeypatch, capfd):
    """The real suite imports its sibling modules (systems.py, clip_rate.py) from beside its
    file, whatever the working directory."""
    monkeypatch.chdir(tmp_path)
    assert Path.cwd() != bench.find_suite().parents[1]
    assert main(["bench", "--suite-help"]) == 0
    assert "--out-dir" in capfd.readouterr().out
