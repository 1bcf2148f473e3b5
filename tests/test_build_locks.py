"""A torch extension build lock left by a builder that was killed part-way makes every later
build or load of that extension wait forever, silently. ops/build_locks.py tells such a lock
from a live build (whose builder holds the file open) and stops with the file to delete;
activation applies it to every DeepSpeed op build (its CPU ops: deepspeed_shm_comm, cpu_adam).
The CPU Adam of this package takes its own lock, under a flock a dead builder cannot hold
(tests/test_cpu_adam_build.py)."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import pytest
from launched import QUICK, run_launched

from hf_superoffload.ops.build_locks import StaleBuildLockError, check_build_lock

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc")


def test_no_lock_no_wait(tmp_path):
    check_build_lock(tmp_path / "lock", "the op", settle=0.01)


def test_a_lock_nobody_holds_is_refused_with_the_file_to_delete(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    with pytest.raises(StaleBuildLockError, match=re.escape(f"rm {lock}")) as refused:
        check_build_lock(lock, "DeepSpeed's cpu_adam op", settle=0.01)
    assert "no process on this machine holds it" in str(refused.value)
    assert lock.exists()  # not deleted: the folder may be shared


def test_a_lock_a_live_builder_holds_is_waited_for(tmp_path, caplog):
    lock = tmp_path / "lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import os, sys, time; os.open(sys.argv[1], os.O_CREAT | "
         "os.O_EXCL); print('held', flush=True); time.sleep(120)", str(lock)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with caplog.at_level(logging.WARNING, logger="hf_superoffload"):
            check_build_lock(lock, "the op", settle=0.01)  # returns: torch waits for the build
        assert f"by process {holder.pid}" in caplog.text
    finally:
        holder.kill()
        holder.wait()


# A DeepSpeed op loaded in a process that imported hf_superoffload, with its build folder under
# TORCH_EXTENSIONS_DIR holding a lock from a killed build.
LOAD_SHM_OP = """
import hf_superoffload
from deepspeed.accelerator import get_accelerator
get_accelerator().create_op_builder("ShareMemCommBuilder").load()
"""


@pytest.mark.slow
def test_a_deepspeed_op_build_stops_at_a_stale_lock_instead_of_waiting_forever(tmp_path):
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.touch()
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "DS_ACCELERATOR": "cpu"}
    try:
        done = run_launched([sys.executable, "-c", LOAD_SHM_OP], timeout=QUICK, env=env)
    except subprocess.TimeoutExpired as waited:
        raise AssertionError(f"the op load waited on the stale lock: {waited.stderr}") from None
    assert done.returncode != 0
    assert "StaleBuildLockError" in done.stderr and f"rm {lock}" in done.stderr, done.stderr[-2000:]
