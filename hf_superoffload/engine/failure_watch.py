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

A watch belongs to one optimizer and sees only that optimizer's failures (its generation,
``replicas.py``). It fires on a failure seen on two polls in a row: a rank that catches its
error and goes on at once withdraws it before then. One withdrawn after a watch fired without
aborting (gloo) is forgotten: the watch goes on and ``raise_if_fired`` does not raise for it.
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from .replicas import FAILURE_KEY, PeerRankError, latest_generation, published_failures

logger = logging.getLogger("hf_superoffload")

POLL_S = 0.5
FULL_SCAN_EVERY = 20  # polls: a key deleted as another is added keeps the count unchanged
STORE_TIMEOUT = datetime.timedelta(seconds=5)  # one poll never waits longer on a lost host


class FailureWatch:
    """Polls ``store`` for a failure of the optimizer of ``generation`` on a rank other than
    ``rank``; on one (seen on two polls in a row), records it in ``failure`` (rank, message),
    sets ``fired`` and calls ``abort`` (True when it could end this rank's collectives). Stops
    on ``stop()``, once ``group_alive()`` is false, and after an abort; without one it watches
    on, and forgets a failure its rank withdraws. A daemon thread, it never keeps the
    interpreter alive."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        abort: Callable[[], bool],
        group_alive: Callable[[], bool] = lambda: True,
        poll_s: float = POLL_S,
        generation: int = 0,
        still_published: Callable[[int], bool] | None = None,
    ):
        self._store = store
        self.generation = generation
        self._peer_keys = {
            r: FAILURE_KEY.format(generation, r) for r in range(world_size) if r != rank
        }
        # Whether a rank's failure is still there, asked from the main thread (the watch's
        # own store connection is its thread's).
        self._still_published = still_published or (lambda r: True)
        self.aborted = False
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
        failure = self.failure
        if failure is not None and not self.aborted and not self._still_published(failure[0]):
            self._forget(failure)  # withdrawn: that rank caught its error and went on
            return
        if failure is not None:
            rank, message = failure
            how = "its process groups were aborted" if self.aborted else "it cannot go on alone"
            raise PeerRankError(
                f"rank {rank} failed with {message}. This rank stopped with it: {how}. Fix that "
                f"error and restart every rank."
            )

    def _watch(self) -> None:
        keys_seen, polls, suspect = None, 0, None
        while not self._stopping.wait(self._poll_s) and self._group_alive():
            try:
                # One round trip a poll; the per-rank checks only when keys changed, while one
                # is suspected or fired, and now and then.
                keys = self._store.num_keys()
                if keys != keys_seen or suspect or self.failure or polls % FULL_SCAN_EVERY == 0:
                    keys_seen = keys
                    failure = self._published_failure()
                    confirmed = failure is not None and failure == suspect
                    if self.failure is not None and failure != self.failure:
                        self._forget(self.failure)
                    elif confirmed and self.failure is None and self._fire(failure):
                        return  # aborted: nothing left to watch
                    suspect = failure
            except RuntimeError as error:  # the store's host is gone: so is the job
                logger.warning("SuperOffload stopped watching for other ranks' failures: %s", error)
                return
            polls += 1

    def _published_failure(self) -> tuple[int, str] | None:
        for rank, key in self._peer_keys.items():
            if self._store.check([key]):
                return rank, self._store.get(key).decode(errors="replace")
        return None

    def _forget(self, failure: tuple[int, str]) -> None:
        if self.failure == failure:
            self.failure = None
            self.fired.clear()
            logger.warning("rank %d withdrew its failure (%s): it caught the error and went on",
                           *failure)  # fmt: skip

    def _fire(self, failure: tuple[int, str]) -> bool:
        """Record ``failure`` and abort this rank's groups; True when they were aborted."""
        self.failure = failure
        self.fired.set()
        rank, message = failure
        if self._abort():
            self.aborted = True
            logger.error("rank %d failed with %s; aborting this rank's process groups", *failure)
            return True
        logger.warning(
            "rank %d failed with %s. This rank's process groups cannot be aborted (gloo "
            "has no abort in torch %s): its collective ends when rank %d's process exits.",
            rank, message, torch.__version__, rank,
        )  # fmt: skip
        return False


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


def watch_failures(generation: int | None = None, poll_s: float = POLL_S) -> FailureWatch | None:
    """Start watching every other rank of the job for failures of the optimizer of
    ``generation`` (default: the latest built; None without other ranks). Failures are
    published by global rank in the default store, so the whole world is watched."""
    generation = latest_generation() if generation is None else generation
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
        generation=generation,
        still_published=lambda rank: rank in published_failures(generation),
    )
