"""benchmarks/suite.py's bookkeeping (the timed runs themselves need a GPU): failure rows and the
ratio table."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import suite


def test_a_signal_names_itself_and_sigkill_hints_at_host_memory():
    assert suite.classify_failure(-signal.SIGKILL, "") == (
        "killed",
        "SIGKILL (host out of memory?)",
    )
    assert suite.classify_failure(-signal.SIGSEGV, "noise") == ("killed", "SIGSEGV")


def test_the_last_traceback_gives_the_error_and_cuda_oom_its_own_status():
    stderr = (
        "warning: something\n"
        "Traceback (most recent call last):\n  File x\nValueError: first\n"
        "During handling...\n"
        "Traceback (most recent call last):\n  File y\n"
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.95 GiB.\n"
    )
    status, error = suite.classify_failure(1, stderr)
    assert status == "out of memory"
    assert error.startswith("torch.OutOfMemoryError: CUDA out of memory")
    assert suite.classify_failure(1, "Traceback (most recent call last):\nKeyError: 'x'\n") == (
        "failed",
        "KeyError: 'x'",
    )
    # A warning after a clean exit is not mistaken for the error.
    assert suite.classify_failure(3, "UserWarning: leaked semaphores\n") == (
        "failed",
        "exit code 3",
    )


def test_ratio_table_gives_superoffloads_speedup_over_each_system():
    rows = [
        {"system": "no_offload", "status": "ok", "s_per_step": 1.2, "peak_gpu_gib": 54.6},
        {"system": "superoffload", "status": "ok", "s_per_step": 0.6, "peak_gpu_gib": 30.0},
        {"system": "deepspeed_superoffload", "status": "killed", "error": "SIGKILL"},
    ]
    lines = suite.ratio_table(rows).splitlines()
    assert lines[1].split() == ["no_offload", "1.200", "54.6", "2.00x"]
    assert lines[2].split() == ["superoffload", "0.600", "30.0", "1.00x"]
    assert lines[3].startswith("deepspeed_superoffload") and "killed: SIGKILL" in lines[3]


def test_suite_records_a_row_per_system_even_when_none_can_run(tmp_path):
    """On this GPU-less machine train_step.py cannot run: the suite still writes a row a
    system, in its columns, with the status and error, plus the logs and the table."""
    import csv

    from launched import ONE_PROCESS, run_launched

    out = tmp_path / "results"
    small = ["--hidden", "64", "--layers", "1", "--seq", "16", "--batch", "1", "--steps", "1"]
    cmd = [sys.executable, str(Path(suite.__file__)), "--systems", "no_offload,torchao_offload"]
    done = run_launched(cmd + small + ["--out-dir", str(out)], timeout=ONE_PROCESS)
    assert done.returncode == 0, done.stderr
    with open(out / "suite.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [r["system"] for r in rows] == ["no_offload", "torchao_offload"]
    assert all(r["status"] == "failed" and r["error"] and r["date"] for r in rows)
    assert list(rows[0]) == suite.COLUMNS
    logs = out / "logs" / "h64-l1-s16-b1-clip1"
    assert (logs / "no_offload.log").read_text()  # the failing process's own output
    assert "no_offload               failed:" in done.stdout
    # A second point appends under the same header; a file of other columns is refused.
    again = run_launched(cmd + small + ["--out-dir", str(out)], timeout=ONE_PROCESS)
    assert again.returncode == 0, again.stderr
    with open(out / "suite.csv", newline="") as handle:
        assert len(list(csv.DictReader(handle))) == 4
    (out / "suite.csv").write_text("date,gpu\n")
    refused = run_launched(cmd + small + ["--out-dir", str(out)], timeout=ONE_PROCESS)
    assert refused.returncode != 0 and "other columns" in refused.stderr


def test_each_gpu_buckets_value_is_its_own_superoffload_row_and_auto_stays_the_reference():
    plan = suite.runs(["no_offload", "superoffload", "torchao_offload"], ["auto", "12"])
    assert plan == [
        ("no_offload", "no_offload", None),
        ("superoffload", "superoffload", "auto"),
        ("superoffload_gpu_buckets_12", "superoffload", "12"),
        ("torchao_offload", "torchao_offload", None),
    ]
    rows = [
        {"system": "superoffload", "status": "ok", "s_per_step": 1.0, "peak_gpu_gib": 50.0},
        {"system": "superoffload_gpu_buckets_12", "status": "ok", "s_per_step": 1.5,
         "peak_gpu_gib": 20.0},
    ]  # fmt: skip
    assert suite.ratio_table(rows).splitlines()[2].split()[-1] == "1.50x"


def test_host_memory_peak_is_the_highest_use_above_the_start(monkeypatch):
    """The sampler's logic on a scripted host (the real one is shared: other processes' memory
    would make a real allocation test flaky)."""
    import threading
    from types import SimpleNamespace

    gib = 2**30
    script = iter([10 * gib, 12 * gib, 30 * gib, 11 * gib])  # start, then three samples
    seen_all = threading.Event()

    def virtual_memory():
        used = next(script, None)
        if used is None:
            seen_all.set()
            used = 10 * gib
        return SimpleNamespace(used=used)

    monkeypatch.setattr(suite.psutil, "virtual_memory", virtual_memory)
    with suite.HostMemoryPeak(interval=0.001) as host:
        assert seen_all.wait(timeout=10)
    assert host.peak_bytes == 20 * gib  # 30 GiB at the peak, 10 when the block started
    assert host.peak_gib == 20.0
