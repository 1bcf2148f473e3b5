"""A thread that ends this rank's collectives when another rank publishes its failure.

``replicas.py``'s ``publish_failure`` leaves a failing rank's error in torch.distributed's
store. With gloo the other ranks' collective breaks when that process exits; with NCCL it does
not: they wait until the NCCL timeout. The watcher polls the store and, on another rank's
failure, aborts this process's NCCL groups: the collective this rank waits in ends, the next
raises, and ``Replicas._run`` / ``shares_failures`` turn that into ``PeerRankError`` with the
published error (the store stays reachable: only the communicators are aborted).

gloo cannot be aborted in torch 2.13: ``ProcessGroupGloo`` does not override
``Backend::abort()``, a no-op (only its send/recv works abort), so a gloo collective ends
when the failed process exits, and the watcher says so in a warning.
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from .replicas import FAILURE_KEY, PeerRankError

logger = logging.getLogger("hf_superoffload")

POLL_S = 0.5
FULL_SCAN_EVERY = 20  # polls: a key deleted as another is added keeps the count unchanged
STORE_TIMEOUT = datetime.timedelta(seconds=5)  # one poll never waits longer on a lost host


class FailureWatch:
    """Polls ``store`` for the failure of a rank other than ``rank``; on one, records it in
    ``failure`` (rank, message), sets ``fired`` and calls ``abort`` (True when it could end
    this rank's collectives). Stops on ``stop()``, once ``group_alive()`` is false, and after
    firing; a daemon thread, it never keeps the interpreter alive."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        abort: Callable[[], bool],
        group_alive: Callable[[], bool] = lambda: True,
        poll_s: float = POLL_S,
    ):
        self._store = store
        self._peer_keys = {r: FAILURE_KEY.format(r) for r in range(world_size) if r != rank}
        self._abort = abort
        self._group_alive = group_alive
        self._poll_s = poll_s
        self._stopping = threading.Event()
        self.fired = threading.Event()
        self.failure: tuple[int, str] | None = None
        self._thread = threading.Thread(target=self._watch, name="superoffload-failure-watch")
        self._thread.daemon = True
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """End the thread; idempotent. Bounded: a poll stuck on a lost store host is left to
        end with its timeout (the thread is a daemon)."""
        self._stopping.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self._poll_s + STORE_TIMEOUT.total_seconds())

    def raise_if_fired(self) -> None:
        """After a collective whose result is read on the host: with NCCL an aborted one
        returns without an error, its result undefined."""
        if self.failure is not None:
            rank, message = self.failure
            raise PeerRankError(
                f"rank {rank} failed with {message}. This rank stopped with it: its process "
                f"groups were aborted. Fix that error and restart every rank."
            )

    def _watch(self) -> None:
        keys_seen, polls = None, 0
        while not self._stopping.wait(self._poll_s) and self._group_alive():
            try:
                # One round trip a poll; the per-rank checks only when keys were added.
                keys = self._store.num_keys()
                if keys != keys_seen or polls % FULL_SCAN_EVERY == 0:
                    keys_seen = keys
                    failure = self._published_failure()
                    if failure is not None:
                        return self._fire(failure)
            except RuntimeError as error:  # the store's host is gone: so is the job
                logger.warning("SuperOffload stopped watching for other ranks' failures: %s", error)
                return
            polls += 1

    def _published_failure(self) -> tuple[int, str] | None:
        for rank, key in self._peer_keys.items():
            if self._store.check([key]):
                return rank, self._store.get(key).decode(errors="replace")
        return None

    def _fire(self, failure: tuple[int, str]) -> None:
        self.failure = failure
        self.fired.set()
        rank, message = failure
        if self._abort():
            logger.error("rank %d failed with %s; aborting this rank's process groups", *failure)
        else:
            logger.warning(
                "rank %d failed with %s. This rank's process groups cannot be aborted (gloo "
                "has no abort in torch %s): its collective ends when rank %d's process exits.",
                rank, message, torch.__version__, rank,
            )  # fmt: skip


def abort_nccl_groups() -> bool:
    """Abort every NCCL process group of this process (newest first, in one NCCL group, as
    ``distributed_c10d._abort_process_group`` does: some NCCL versions deadlock otherwise),
    leaving torch.distributed's bookkeeping and store as they are (the blocked main thread
    still reads them). False when there is none."""
    # NOTE: torch has no public list of a process's groups; _world.pg_names is it.
    groups = sorted(dist.distributed_c10d._world.pg_names.items(), key=lambda g: g[1])
    nccl = [pg for pg, _ in reversed(groups) if _nccl_backend(pg) is not None]
    if not nccl:
        return False
    world_nccl = _nccl_backend(dist.group.WORLD) if dist.group.WORLD is not None else None
    if world_nccl is not None:
        world_nccl._group_start()
    for pg in nccl:
        pg.abort()
    if world_nccl is not None:
        world_nccl._group_end()
    return True


def _nccl_backend(pg: dist.ProcessGroup):
    if not dist.is_nccl_available():
        return None
    try:
        backend = pg._get_backend(torch.device("cuda"))
    except RuntimeError:  # no CUDA backend in this group
        return None
    return backend if isinstance(backend, dist.ProcessGroupNCCL) else None


def watch_failures(poll_s: float = POLL_S) -> FailureWatch | None:
    """Start watching every other rank of the job (None without other ranks). Failures are
    published by global rank in the default store, so the whole world is watched."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    # NOTE: private, as in replicas._store. A clone: its own connection, so a poll never
    # queues behind the main thread's store calls (TCPStore serialises one client's calls).
    store = dist.distributed_c10d._get_default_store().clone()
    store.set_timeout(STORE_TIMEOUT)
    return FailureWatch(
        store,
        dist.get_rank(),
        dist.get_world_size(),
        abort=abort_nccl_groups,
        group_alive=dist.is_initialized,
        poll_s=poll_s,
    )
