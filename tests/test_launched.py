"""tests/launched.py: a launch that runs out of time leaves no process behind, the child it
started included (``subprocess.run(timeout=...)`` kills only the launcher)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from launched import run_launched

# A launcher that starts a child (as accelerate launch starts the training script), writes
# its pid and waits for it; the child sleeps for far longer than the test allows.
LAUNCHER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
open(sys.argv[1], "w").write(str(child.pid))
child.wait()
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def _wait_for_pid(path) -> int:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return int(path.read_text())
        time.sleep(0.05)
    raise AssertionError("the launcher did not start its child")


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_timed_out_launch_kills_the_child_too(tmp_path):
    pid_file = tmp_path / "child.pid"
    with pytest.raises(subprocess.TimeoutExpired):
        run_launched([sys.executable, "-c", LAUNCHER, str(pid_file)], timeout=3)
    child = _wait_for_pid(pid_file)
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), f"the launched child {child} outlived the timed-out launch"


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_a_finished_launch_leaves_no_child_behind(tmp_path):
    pid_file = tmp_path / "child.pid"
    orphaning = LAUNCHER.replace("child.wait()", "")  # the launcher exits, its child runs on
    done = run_launched([sys.executable, "-c", orphaning, str(pid_file)], timeout=60)
    assert done.returncode == 0, done.stderr
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)


def test_output_and_exit_code_come_back():
    done = run_launched([sys.executable, "-c", "print('out'); raise SystemExit(3)"], timeout=60)
    assert (done.returncode, done.stdout.strip()) == (3, "out")
