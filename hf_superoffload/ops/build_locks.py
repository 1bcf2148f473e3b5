"""Notice a torch extension build lock whose builder is gone, instead of waiting on it forever.

``torch.utils.cpp_extension`` serialises the builds of one extension on a file, ``lock`` in the
extension's build folder: a builder creates it (and keeps it open) for the whole build and
removes it at the end; everyone else, even a process that only loads the finished build,
waits until it is gone. A builder killed part-way leaves it behind, and every later start
waits for it, silently and forever. DeepSpeed builds its ops on CPU this way (``cpu_adam``,
``deepspeed_shm_comm``).

Since a live builder holds the file open, a lock that no process on this machine holds was left
by one that is gone. It is not deleted here: the folder may be shared with other users or
machines, so the error names the file and says when to delete it.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

logger = logging.getLogger("hf_superoffload")

# A lock seen unheld is looked at again after this pause: a builder that has just finished
# closes the file a moment before it removes it.
SETTLE_SECONDS = 1.0


class StaleBuildLockError(RuntimeError):
    """A build lock that no live process holds would make this process wait forever."""


def torch_extension_lock(name: str) -> Path:
    """The lock of the torch extension ``name`` (the folder ``cpp_extension.load`` uses)."""
    from torch.utils import cpp_extension

    # NOTE: a private function of torch, the one that names the folder for load() itself.
    return Path(cpp_extension._get_build_directory(name, verbose=False)) / "lock"


def check_torch_extension_lock(name: str, what: str) -> None:
    check_build_lock(torch_extension_lock(name), what)


def check_build_lock(lock: Path, what: str, settle: float = SETTLE_SECONDS) -> None:
    """Return when ``lock`` is absent or a process on this machine holds it (torch then waits
    for that build, as it should); raise StaleBuildLockError naming the file when it stays
    there unheld. Without /proc (not Linux) nothing can be told, and nothing is checked."""
    if not os.path.isdir("/proc/self/fd"):
        return
    for attempt in range(2):
        try:
            seen = lock.stat()
        except FileNotFoundError:
            return
        holders = processes_holding(lock)
        if holders:
            logger.warning(
                "hf_superoffload: %s is being built by process %s (it holds %s); waiting for "
                "that build to finish.",
                what,
                ", ".join(map(str, holders)),
                lock,
            )
            return
        if attempt == 0:
            time.sleep(settle)
    age = time.time() - seen.st_mtime
    raise StaleBuildLockError(
        f"{what} cannot be built or loaded: its build lock {lock} is left from a build that "
        f"was stopped part-way ({_age(age)} old, and no process on this machine holds it), and "
        f"torch would wait for it forever. Delete it: rm {lock} (unless a process on another "
        f"machine that shares this folder is building {what} right now; then wait for it)."
    )


def processes_holding(path: Path) -> list[int]:
    """Pids of the processes on this machine (those this user may inspect) with ``path``
    open."""
    target = os.path.realpath(path)
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        fd_dir = f"/proc/{entry.name}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:  # gone, or another user's
            continue
        for fd in fds:
            try:
                if os.readlink(f"{fd_dir}/{fd}") == target:
                    found.append(int(entry.name))
                    break
            except OSError:
                continue
    return found


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
