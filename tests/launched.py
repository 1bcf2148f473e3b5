"""Runs a launcher (``accelerate launch``, ``deepspeed``, a script that starts ranks) for a test,
in a process group of its own, and kills the whole group when it runs out of time or the test
stops: ``subprocess.run(timeout=...)`` kills only the launcher, and the training processes it
started live on as orphans, holding cores and ports for the tests after it.

Timeouts: the CPU tier runs on 2 cores shared with other jobs. A launch of the examples took
8-45 s there with the cores about twice oversubscribed (load 3-4), most of it imports and
DeepSpeed's start-up; the budgets below leave 10x and more for a busier machine, so a run that
needs them is stuck, not slow.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
from collections.abc import Sequence

# Seconds, by what the command does.
QUICK = 120  # a shell launcher's dry run, a script that only parses its arguments
ONE_PROCESS = 600  # one training process of the examples (plain or DeepSpeed ZeRO-3 on CPU)
SEVERAL_PROCESSES = 900  # two or more ranks launched together


def run_launched(
    cmd: Sequence[str],
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
) -> subprocess.CompletedProcess:
    """Run ``cmd`` with its output captured, like ``subprocess.run``, until the launcher exits;
    then kill what is left of its process group (children it left behind). On timeout kill
    the whole group and raise ``subprocess.TimeoutExpired`` with the output so far. The output
    goes to files, not pipes: a child left running would hold a pipe open."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            list(cmd),
            stdout=out,
            stderr=err,
            text=True,
            env=env,
            cwd=cwd,
            start_new_session=True,  # its own session and process group, id = its pid
        )
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            kill_group(proc.pid)
            proc.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(list(cmd), proc.returncode, stdout, stderr)


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group is gone already
        os.killpg(pgid, signal.SIGKILL)
