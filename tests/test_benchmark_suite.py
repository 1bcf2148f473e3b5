"""benchmarks/suite.py's bookkeeping (the timed runs themselves need a GPU): failure rows and the
ratio table."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

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


def test_baseline_systems_run_without_the_engine_variables(monkeypatch):
    """The systems hf_superoffload builds get the engine variables of the suite's environment;
    the baselines (plain DeepSpeed refuses them beside its config) run without them, and keep
    the package's other variables."""
    monkeypatch.setenv("HF_SUPEROFFLOAD_MOMENTS", "compact")
    monkeypatch.setenv("HF_SUPEROFFLOAD_CPU_THREADS", "14")
    monkeypatch.setenv("HF_SUPEROFFLOAD_HOST_MEMORY_GIB", "240")
    assert set(suite.READS_ENGINE_VARIABLES) < set(suite.ALL)
    for system in suite.ALL:
        env = suite.system_environment(system, 1)
        ours = system in suite.READS_ENGINE_VARIABLES
        assert ("HF_SUPEROFFLOAD_MOMENTS" in env) is ours, system
        assert ("HF_SUPEROFFLOAD_CPU_THREADS" in env) is ours, system
        assert env["HF_SUPEROFFLOAD_HOST_MEMORY_GIB"] == "240", system
    assert "HF_SUPEROFFLOAD_MOMENTS" not in suite.system_environment("deepspeed_zero_offload", 2)
    assert "OMP_NUM_THREADS" in suite.system_environment("deepspeed_zero_offload", 2)


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_system_past_its_timeout_is_ended_with_its_group_and_leaves_its_log(
    tmp_path, monkeypatch
):
    """A process cut at its time limit leaves what it printed so far (how far a start-up got),
    and nothing it started outlives it (a worker left behind holds the next system's memory)."""
    import os
    import time

    monkeypatch.setattr(suite, "TERM_GRACE_S", 10)
    pid_file = tmp_path / "worker.pid"
    code = (
        "import subprocess, sys, time\n"
        "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(w.pid))\n"
        "print('row so far', flush=True)\n"
        "print('loading shards', file=sys.stderr, flush=True)\n"
        "time.sleep(120)\n"
    )
    log = tmp_path / "system.log"
    returncode, stdout, stderr = suite.run_logged([sys.executable, "-c", code], None, 8, log)
    assert returncode is None
    assert (stdout, stderr) == ("row so far\n", "loading shards\n")
    assert log.read_text() == stdout + stderr
    assert not log.with_suffix(".stdout").exists()
    worker = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # gone, or a zombie its new parent has yet to reap
        try:
            stat = Path(f"/proc/{worker}/stat").read_text()
        except FileNotFoundError:
            break
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.1)
    else:
        os.kill(worker, 9)
        raise AssertionError("the system's worker outlived the timeout")


def test_a_finished_system_gives_its_exit_code_and_output(tmp_path):
    code = "import sys; print('{}'); print('warn', file=sys.stderr); sys.exit(3)"
    log = tmp_path / "system.log"
    assert suite.run_logged([sys.executable, "-c", code], None, 60, log) == (3, "{}\n", "warn\n")
    assert log.read_text() == "{}\nwarn\n"


TORCHRUN_SUMMARY = """Traceback (most recent call last):
  File "torchrun", line 8, in <module>
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
benchmarks/train_step.py FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 2 (local_rank: 2)
  exitcode  : {code} (pid: 4242)
  traceback : {why}
============================================================
"""


def test_a_torchrun_failure_names_the_workers_error_or_the_signal_that_ended_it():
    """torchrun's own traceback and summary box end its log; the row needs the rank's error."""
    worker = (
        "[rank1]: Traceback (most recent call last):\n[rank1]:   File train_step.py\n"
        "[rank1]: RuntimeError: NCCL error in: init\n"
        "W1126 04:57:39.660000 11464 torch/distributed/elastic/api.py:1028] Sending SIGTERM\n"
    )
    failed = worker + TORCHRUN_SUMMARY.format(code=1, why="To enable traceback see: ...")
    assert suite.classify_failure(1, failed) == ("failed", "RuntimeError: NCCL error in: init")
    oom = worker.replace("RuntimeError: NCCL error in: init", "torch.OutOfMemoryError: CUDA out")
    assert suite.classify_failure(1, oom + TORCHRUN_SUMMARY.format(code=1, why="..."))[0] == (
        "out of memory"
    )
    killed = "loading\n" + TORCHRUN_SUMMARY.format(
        code="-9", why="Signal 9 (SIGKILL) received by PID 4242"
    )
    assert suite.classify_failure(1, killed) == ("killed", "a rank: SIGKILL (host out of memory?)")
