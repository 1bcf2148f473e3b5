"""Data parallelism by replicas: every rank of a torch.distributed group holds the whole
optimizer state, averages each bucket's gradients with the others before using them, and so
takes bit-identical steps (the same reduced gradients, the same deterministic kernels, the
same verdicts), with no parameter traffic after the first broadcast.

Collectives must be issued in the same order on every rank. Buckets are averaged as they
launch, and under replicas they launch in bucket order (the optimizer holds back a bucket that
completes before an earlier one); decisions taken from local measurements (the cast plan, how
many buckets ``auto`` moves to the GPU) are agreed on first, so all ranks keep the same
placement, and with it the same arithmetic for every bucket.

One rank's failure ends every rank promptly, with that error. A rank that fails publishes its
error in torch.distributed's store (``publish_failure``: the worker does it for its tasks,
``shares_failures`` for the methods it wraps) before its exception ends the process; the
collective the other ranks wait in then breaks (gloo: at once, when the process's connections
close), and ``Replicas`` raises ``PeerRankError`` with the published error instead of the
backend's "connection reset". With NCCL a collective does not break when a peer exits: the
launcher (torchrun, ``accelerate launch``) ends the other processes when one fails.

A failure belongs to one optimizer: its *generation*, the count of replicated optimizers this
process has built (ranks build them in step, as their collectives require), is part of the
key, and only that optimizer's peers watch it; one built later starts with none. A rank that
catches its error and goes on withdraws it: the next call of a wrapped method, or the next
optimizer it builds, deletes what it published, and a peer that saw it in the meantime does
not raise for it (``FailureWatch.raise_if_fired`` checks it is still there).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist

FAILURE_KEY = "hf_superoffload/failed/g{}/rank{}"  # generation, global rank
MESSAGE_LIMIT = 2000  # characters of a published error

# Replicated optimizers built by this process so far: the latest one's generation.
_generation = {"latest": 0}
# Keys this process published and has not withdrawn.
_published: set[str] = set()


class PeerRankError(RuntimeError):
    """Another rank failed and the collective this rank waited in broke with it."""


def _store():
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    # NOTE: torch has no public accessor of the default group's store (the one every rank of
    # the job reached at init_process_group); this private one has been stable since 1.x.
    return dist.distributed_c10d._get_default_store()


def latest_generation() -> int:
    return _generation["latest"]


def publish_failure(error: BaseException, generation: int | None = None) -> None:
    """Tell the other ranks why this one is about to stop (nothing without other ranks), as a
    failure of the optimizer of ``generation`` (default: the latest built). A PeerRankError is
    not published: its cause is another rank's, already there."""
    store = _store()
    if store is None or isinstance(error, PeerRankError):
        return
    key = FAILURE_KEY.format(latest_generation() if generation is None else generation,
                             dist.get_rank())  # fmt: skip
    message = f"{type(error).__name__}: {error}"[:MESSAGE_LIMIT]
    # A store whose host (rank 0, or the launcher) is gone: the others see that anyway.
    with contextlib.suppress(RuntimeError):
        store.set(key, message)
        _published.add(key)


def withdraw_failures() -> None:
    """This rank goes on after the failures it published: it handled them. Delete them, so
    no peer (and no optimizer built later) ends for them."""
    if not _published:
        return
    store = _store()
    for key in list(_published):
        _published.discard(key)
        if store is not None:
            with contextlib.suppress(RuntimeError):  # as in publish_failure
                store.delete_key(key)


def published_failures(generation: int) -> dict[int, str]:
    """The errors other ranks published for the optimizer of ``generation``, by rank (empty
    when none did, or the store is gone with its host)."""
    store = _store()
    if store is None:
        return {}
    failures = {}
    try:
        for rank in range(dist.get_world_size()):
            key = FAILURE_KEY.format(generation, rank)
            if rank != dist.get_rank() and store.check([key]):
                failures[rank] = store.get(key).decode(errors="replace")
    except RuntimeError:
        pass  # as in publish_failure
    return failures


def peer_error(broken: BaseException, generation: int) -> PeerRankError | None:
    """For ``broken``, an error of a collective: a PeerRankError naming the ranks that
    published a failure of this optimizer and their errors; None when no other rank did."""
    failures = published_failures(generation)
    if not failures:
        return None
    causes = "; ".join(f"rank {rank} failed with {text}" for rank, text in sorted(failures.items()))
    return PeerRankError(
        f"{causes}. Rank {dist.get_rank()} stopped with it: the collective it waited in broke "
        f"when that rank ended ({type(broken).__name__}). Fix that error and restart every rank "
        f"(resume from the last checkpoint)."
    )


def closes_replicas_on_failure(init):
    """A constructor that fails part-way leaves no failure watch running: it closes the
    ``Replicas`` it made (``self._replicas``), if it got that far."""

    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        try:
            init(self, *args, **kwargs)
        except BaseException:
            replicas = self.__dict__.get("_replicas")
            if replicas is not None:
                replicas.close()
            raise

    return wrapper


def shares_failures(method):
    """Wrap a method that takes part in collectives (a constructor, ``step``): a failure in it
    is published for the other ranks, and an error caused by another rank's published failure
    becomes a PeerRankError with that rank's error. Entering it withdraws this rank's earlier
    failures (``withdraw_failures``)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        withdraw_failures()  # called again: what failed before was handled
        try:
            return method(self, *args, **kwargs)
        except PeerRankError:
            raise
        except BaseException as error:
            generation = _generation_of(self)
            peer = peer_error(error, generation) if isinstance(error, RuntimeError) else None
            if peer is not None:
                raise peer from error
            publish_failure(error, generation)
            raise

    return wrapper


def _generation_of(optimizer) -> int:
    """The generation of ``optimizer``'s replicas; a constructor that failed before making
    them would have made the next one."""
    replicas = optimizer.__dict__.get("_replicas")
    if replicas is not None and replicas.distributed:
        return replicas.generation
    return latest_generation() + 1


class Replicas:
    """A world of one (no collectives at all) when torch.distributed is not initialised or
    the group has one rank."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device):
        initialised = dist.is_available() and dist.is_initialized()
        self.group = group if group is not None else (dist.group.WORLD if initialised else None)
        self.size = dist.get_world_size(self.group) if self.group is not None else 1
        self.failure_watch = None
        self.generation = 0
        if self.size == 1:
            self.group = None
            return
        from .failure_watch import watch_failures  # it imports this module

        withdraw_failures()  # this rank goes on: it builds another optimizer
        _generation["latest"] += 1
        self.generation = _generation["latest"]
        # NCCL collectives wait through a peer's death: the watch aborts them when one fails.
        self.failure_watch = watch_failures(self.generation)
        # NCCL reduces CUDA tensors only (on the model's GPU); gloo takes CPU tensors.
        nccl = dist.get_backend(self.group) == "nccl"
        self._scalar_device = device if nccl else torch.device("cpu")
        self._source = dist.get_global_rank(self.group, 0)

    @property
    def distributed(self) -> bool:
        return self.group is not None

    def close(self) -> None:
        if self.failure_watch is not None:
            self.failure_watch.stop()

    def publish_failure(self, error: BaseException) -> None:
        """Publish ``error`` as a failure of this optimizer (see ``publish_failure``)."""
        if self.distributed:
            publish_failure(error, self.generation)

    def _run(self, collective, *args, **kwargs) -> None:
        """A collective; broken by another rank's end, it raises PeerRankError."""
        try:
            collective(*args, **kwargs)
        except RuntimeError as broken:
            peer = peer_error(broken, self.generation)
            if peer is None:
                peer = PeerRankError(
                    f"a collective of the SuperOffload replicas broke ({broken}). Another rank "
                    f"most likely failed or was stopped before it could say why: its own error "
                    f"is in its log. Fix it and restart every rank."
                )
            raise peer from broken

    def broadcast_(self, tensors: list[torch.Tensor]) -> None:
        """Make every rank start from rank 0's values (as DDP does at construction)."""
        if self.distributed:
            for tensor in tensors:
                self._run(dist.broadcast, tensor, src=self._source, group=self.group)

    def average_(self, tensor: torch.Tensor) -> None:
        """In place: the mean over ranks (sum, then divide: not every backend has AVG). 16-bit
        gradients are summed in fp32, one rounding at the end instead of one per addition."""
        if not self.distributed:
            return
        wide = tensor.float() if tensor.dtype != torch.float32 else tensor
        self._run(dist.all_reduce, wide, op=dist.ReduceOp.SUM, group=self.group)
        wide.div_(self.size)
        if wide is not tensor:
            tensor.copy_(wide)

    def agree(self, value: float, op: str) -> float:
        """The ``op`` ("min" or "max") of a local decision over all ranks."""
        if not self.distributed:
            return value
        reduce_op = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]
        holder = torch.tensor([float(value)], dtype=torch.float64, device=self._scalar_device)
        self._run(dist.all_reduce, holder, op=reduce_op, group=self.group)
        return self._read(holder)[0]

    def any_(self, flags: list[bool]) -> list[bool]:
        """Each flag set on any rank."""
        return [bool(v) for v in self.maxima([int(f) for f in flags])]

    def maxima(self, counts: list[int]) -> list[int]:
        """Each count's maximum over all ranks."""
        if not self.distributed:
            return counts
        holder = torch.tensor(counts, dtype=torch.int64, device=self._scalar_device)
        self._run(dist.all_reduce, holder, op=dist.ReduceOp.MAX, group=self.group)
        return [int(v) for v in self._read(holder)]

    def from_rank0(self, values: list[float]) -> list[float]:
        """Rank 0's ``values`` on every rank (a decision measured locally, taken once)."""
        if not self.distributed:
            return values
        holder = torch.tensor(values, dtype=torch.float64, device=self._scalar_device)
        self._run(dist.broadcast, holder, src=self._source, group=self.group)
        return self._read(holder)

    def _read(self, holder: torch.Tensor) -> list:
        """A collective's result on the host; an NCCL collective the failure watch aborted
        returns without an error and an undefined result, so it is not used."""
        values = holder.tolist()
        if self.failure_watch is not None:
            self.failure_watch.raise_if_fired()
        return values
