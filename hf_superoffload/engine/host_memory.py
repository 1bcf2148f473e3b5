"""Page-locked host buffers of the size asked for, not the next power of two.

torch's pinned allocator (``pin_memory=True``) rounds every request up to a power of two: a
bucket of one 4096 x 11008 weight (45M elements) takes 256 MiB of fp32 master instead of 172.
At 5.1B params that was 50 GiB of pinned buffers where 38 were needed (95 GiB host RSS on the
benchmark). Here each buffer is ordinary host memory, page-aligned and page-locked with
``cudaHostRegister`` for as long as the engine owns it, so transfers from and to it stay
asynchronous DMA: on an H100, 55 GB/s each way like torch's pinned blocks (pageable: 4.5 D2H,
8.7 H2D), with the copy call returning at once. torch's ``Tensor.is_pinned()`` says False for
these buffers, since it only recognises its own allocator's.

``check_host_memory`` refuses, before allocating, a host state that would not fit beside the
other ranks of the host, with the bytes needed and available and what to change. What it grants
stays claimed (``HostClaim``) while the objects holding it live: where
``HF_SUPEROFFLOAD_HOST_MEMORY_GIB`` gives the job's memory, the process's later checks count it
taken, as ``MemAvailable`` would show it taken.
"""

from __future__ import annotations

import itertools
import mmap
import os
import socket
import time
import weakref

import torch
import torch.distributed as dist

from .. import env
from . import cgroup_memory
from .replicas import PeerRankError, latest_generation, published_failures

PAGE = mmap.PAGESIZE


class PinnedBuffers:
    """Owns the registered buffers it hands out. ``release`` (one) and ``release_all`` unpin
    before the memory can be freed, since freeing registered memory leaves the driver with a
    stale range; buffers still held when this object is collected (say, an optimizer whose
    construction failed half-way) are unpinned then."""

    def __init__(self) -> None:
        self._owned: dict[int, torch.Tensor] = {}  # data_ptr -> the registered page span
        self._finalizer = weakref.finalize(self, _unpin_all, self._owned)
        self._finalizer.atexit = False  # at exit the process's memory goes anyway

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if numel == 0:
            return torch.empty(0, dtype=dtype)  # nothing to pin (its data_ptr is 0)
        nbytes = numel * dtype.itemsize
        span = -(-nbytes // PAGE) * PAGE  # whole pages: no page is shared
        raw = torch.empty(span + PAGE, dtype=torch.uint8)
        start = -raw.data_ptr() % PAGE
        pages = raw[start : start + span]
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(pages.data_ptr(), span, 0))
        self._owned[pages.data_ptr()] = pages
        return pages[:nbytes].view(dtype)

    def release(self, buffer: torch.Tensor | None) -> None:
        """Unpin ``buffer`` (one this object handed out; None and empty buffers are ignored);
        the memory itself goes when its last reference does."""
        if buffer is None or buffer.numel() == 0:
            return
        if buffer.data_ptr() not in self._owned:
            raise ValueError("release() of a buffer these PinnedBuffers did not hand out")
        _unpin_all({buffer.data_ptr(): self._owned.pop(buffer.data_ptr())})

    def release_all(self) -> None:
        _unpin_all(self._owned)

    @property
    def nbytes(self) -> int:
        """Page-locked bytes held now."""
        return sum(pages.numel() for pages in self._owned.values())


def _unpin_all(owned: dict[int, torch.Tensor]) -> None:
    """Unregister every span in ``owned`` and empty it. Each span is dropped only after its
    own unregister call; one failure does not stop the rest, and the first is raised after."""
    first_error = None
    for ptr in list(owned):
        code = torch.cuda.cudart().cudaHostUnregister(ptr)
        del owned[ptr]
        if first_error is None and int(code) != 0:
            first_error = code
    if first_error is not None:
        torch.cuda.check_error(first_error)


# ---------------------------------------------------------------------------------------------
# Refusing a host state that cannot fit, before allocating it

MEMINFO = "/proc/meminfo"
PROC_CGROUP = cgroup_memory.PROC_CGROUP  # which cgroup this process is in
MOUNTINFO = cgroup_memory.MOUNTINFO  # where its hierarchy is mounted


class HostMemoryError(MemoryError):
    """The optimizer's host state would not fit; raised before any of it is allocated."""


# Where MemAvailable undercounts: VMs whose memory grows as it is used (a balloon or hotplug
# starts them at a fraction: one 256 GiB machine here read 31 GiB), the user says the figure.
HOST_MEMORY_ENV = "HF_SUPEROFFLOAD_HOST_MEMORY_GIB"


def host_bytes_available() -> int:
    """Bytes of host memory this process can still take, pinned or pageable
    (``host_memory_available``)."""
    return host_memory_available()[0]


def host_memory_available() -> tuple[int, str]:
    """Bytes of host memory this process can still take, pinned or pageable, and what says
    so: the kernel's ``MemAvailable``, or less where a memory limit of the process's cgroup or
    of one of its parents (cgroup v2 or v1, ``cgroup_memory``) leaves less;
    ``HF_SUPEROFFLOAD_HOST_MEMORY_GIB`` replaces both where set (the job's whole figure:
    ``check_host_memory`` takes off it what earlier checks granted)."""
    override = env.read(HOST_MEMORY_ENV)
    if override:
        try:
            gib = float(override)
        except ValueError:
            gib = -1.0
        if not gib > 0:
            raise ValueError(
                f"{HOST_MEMORY_ENV}={override!r}: give the GiB of host memory this job may "
                f"use, a number above 0 (e.g. {HOST_MEMORY_ENV}=240), or unset it"
            )
        return int(gib * 2**30), f"{HOST_MEMORY_ENV}={override}"
    with open(MEMINFO) as f:
        fields = dict(line.split(":", 1) for line in f)
    available = int(fields["MemAvailable"].split()[0]) * 1024
    cgroup = cgroup_memory.headroom(PROC_CGROUP, MOUNTINFO)
    if cgroup.bytes is not None and cgroup.bytes < available:
        return cgroup.bytes, cgroup.where
    if cgroup.bytes is None:
        return available, f"MemAvailable in {MEMINFO}; {cgroup.where}"
    return available, f"MemAvailable in {MEMINFO}, tighter than the {cgroup.where}"


# Processes of the job on this host, as launchers that set one say it (torchrun and
# accelerate, deepspeed's launcher, Open MPI, MVAPICH2, MPICH and Intel MPI): read only before
# torch.distributed is initialized, which counts them itself.
LAUNCHER_LOCAL_SIZES = (
    "LOCAL_WORLD_SIZE",
    "LOCAL_SIZE",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MV2_COMM_WORLD_LOCAL_SIZE",
    "MPI_LOCALNRANKS",
)
HOST_KEY = "hf_superoffload/host/rank{}"  # in torch.distributed's store: each rank's host


def ranks_on_this_host() -> int:
    """Processes of this job on this host, each of which allocates its own host state and
    runs its own CPU Adam team at about the same time."""
    return _ranks_on_this_host()[0]


def _ranks_on_this_host() -> tuple[int, str]:
    """The count, and how it was found. With torch.distributed initialized every rank writes
    its host name into the job's store and reads the others': whatever started the ranks
    (torchrun, accelerate, ``deepspeed``, mpirun, srun). Before that, the launcher's count."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        hosts = _host_of_every_rank()
        return hosts.count(hosts[dist.get_rank()]), "host names over torch.distributed"
    for name in LAUNCHER_LOCAL_SIZES:
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return max(1, int(value)), name
    return 1, "no launcher count, torch.distributed not initialized"


def _host_of_every_rank() -> list[str]:
    """Every rank's host name, by rank, through the default group's store (no collective:
    ranks may ask at different points, and no device is needed). Waits for ranks that have
    not written theirs yet; a rank that failed and published its error ends the wait."""
    # NOTE: torch has no public accessor of the default group's store (replicas.py says so).
    store = dist.distributed_c10d._get_default_store()
    world, rank = dist.get_world_size(), dist.get_rank()
    keys = [HOST_KEY.format(r) for r in range(world)]
    store.set(keys[rank], socket.gethostname())
    deadline = time.monotonic() + store.timeout.total_seconds()
    while not store.check(keys):
        failures = published_failures(latest_generation())  # the optimizer being built
        if failures:
            raise PeerRankError(
                "counting the ranks on this host: "
                + "; ".join(f"rank {r} failed with {text}" for r, text in sorted(failures.items()))
            )
        if time.monotonic() > deadline:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            raise RuntimeError(
                f"rank(s) {missing} did not say which host they run on within "
                f"{store.timeout}: every rank of the job must build the optimizer (a rank that "
                "ended before it leaves the others waiting)"
            )
        time.sleep(0.05)
    return [value.decode() for value in store.multi_get(keys)]


# What the passed checks of this process granted and is still held: claim key -> its parts.
# Plain dict operations (atomic under the GIL): a claim may be dropped on another thread.
_GRANTED: dict[int, dict[str, int]] = {}
_claim_keys = itertools.count()


class HostClaim:
    """Host bytes, by part, that a passed ``check_host_memory`` granted. Counted by this
    process's later checks under ``HF_SUPEROFFLOAD_HOST_MEMORY_GIB`` while the claim lives: as
    long as its caller keeps it (an allocation that fails part-way drops it with its frame)
    and then as long as any of the objects that hold the memory (``held_by``)."""

    def __init__(self, parts: dict[str, int]) -> None:
        self.key = next(_claim_keys)
        self.parts = {name: nbytes for name, nbytes in parts.items() if nbytes}
        _GRANTED[self.key] = self.parts
        weakref.finalize(self, _GRANTED.pop, self.key, None).atexit = False

    def held_by(self, *holders) -> HostClaim:
        """Keep the claim while any of ``holders`` lives (None entries skipped): each one's
        finalizer references it until that holder is collected."""
        for holder in holders:
            if holder is not None:
                weakref.finalize(holder, _keep, self).atexit = False
        return self

    def take(self, name: str) -> HostClaim:
        """Move part ``name`` out into a claim of its own, for memory that other objects hold
        (or none: an empty claim)."""
        return HostClaim({name: self.parts.pop(name, 0)})


def _keep(claim: HostClaim) -> None:
    """A holder's finalizer: its reference to ``claim`` goes with it."""


def held_host_parts() -> dict[str, int]:
    """Bytes, by part, that this process's passed checks granted and still hold."""
    held: dict[str, int] = {}
    for parts in list(_GRANTED.values()):
        for name, nbytes in list(parts.items()):
            held[name] = held.get(name, 0) + nbytes
    return held


def _left_for_the_job(ranks: int) -> tuple[int, str]:
    """Bytes of host memory this check may grant for all ``ranks`` of the host, and whence.
    ``MemAvailable`` (or the cgroup's limit) already shows what earlier checks' allocations
    took. ``HF_SUPEROFFLOAD_HOST_MEMORY_GIB`` is the job's whole figure, so what this process's
    earlier checks granted and still holds is taken off it, for each rank of the host (each
    holds its own, as it checks its own)."""
    figure, source = host_memory_available()
    override = env.read(HOST_MEMORY_ENV)
    held = held_host_parts()
    per_rank = sum(held.values())
    if not override or not per_rank:
        return figure, source
    listed = ", ".join(f"{name} {nbytes / 2**30:.2f}" for name, nbytes in held.items())
    return max(0, figure - per_rank * ranks), (
        f"{HOST_MEMORY_ENV}={override} less {per_rank / 2**30:.2f} GiB per rank x {ranks} "
        f"rank(s) that this job's earlier host checks granted and it still holds: {listed} GiB"
    )


def check_host_memory(parts: dict[str, int], remedies: str) -> HostClaim:
    """Refuse, before anything is allocated, a host state of ``parts`` (bytes per rank, by
    what they hold) that this host cannot hold for all of its ranks; the kernel's OOM killer
    would otherwise end the run part-way. ``remedies`` says what to change. Returns the
    claim on what it granted: the caller binds it to the objects that hold the memory
    (``HostClaim.held_by``)."""
    per_rank = sum(parts.values())
    ranks, how = _ranks_on_this_host()
    available, source = _left_for_the_job(ranks)
    if per_rank * ranks <= available:
        return HostClaim(parts)
    listed = ", ".join(f"{name} {nbytes / 2**30:.2f}" for name, nbytes in parts.items() if nbytes)
    if env.read(HOST_MEMORY_ENV):
        figure = f"raise {HOST_MEMORY_ENV} only if the job may really use more."
    else:
        figure = (
            f"Where memory grows as it is used, as on some VMs, and MemAvailable reads low at "
            f"start, set {HOST_MEMORY_ENV} to the real figure."
        )
    raise HostMemoryError(
        f"the optimizer's host state needs {per_rank / 2**30:.2f} GiB per rank ({listed} GiB) "
        f"x {ranks} rank(s) on this host ({how}) = {per_rank * ranks / 2**30:.2f} "
        f"GiB of host memory (pinned and pageable), but only {available / 2**30:.2f} GiB is "
        f"available ({source}); the kernel would kill the run part-way. {remedies} ({figure})"
    )


def standalone_host_parts(
    host_numel: int,
    model_dtype: torch.dtype,
    cast,
    accumulating: bool,
    compact_blocks: int | None = None,
    largest_bucket: int | None = None,
) -> dict[str, int]:
    """Host bytes SuperOffloadOptimizer allocates for ``host_numel`` elements of host buckets
    (``bucket.py``, ``cast`` its CastPlan): fp32 master and moments, the gradient buffer
    (model dtype, or fp32 when gradients are cast on the device), the shared copy-out ring
    of rounded params (16-bit models whose params do not cross in fp32: a few buffers of at
    most ``COPY_OUT_PIECE`` elements, not a copy per bucket), and the fp32 gradient sum kept
    while micro-batches accumulate where that is declared (else each bucket's is checked as
    it is made, ``Bucket.reserve_sum``). Without a GPU, tail buckets live in host memory too:
    count them. ``compact_blocks``: the moments are compact, in that many blocks
    (compact_moments.py), and the copy-out ring is always there (a speculative pass leaves the
    master as it was), as are the gradient slots (grad_slots.py: a few gradient buffers of the largest bucket).
    ``largest_bucket``: the elements of the largest bucket, host or device (the ring's buffers
    hold one, up to ``COPY_OUT_PIECE``); unknown, the host elements bound it."""
    from .bucket import grad_sum_bytes  # here: bucket -> this
    from .compact_moments import compact_moment_bytes  # here: compact_moments -> ops
    from .copy_out import copy_out_bytes  # here: copy_out -> link -> this
    from .grad_slots import grad_slots_bytes
    from .layout import copy_out_dtype

    low = model_dtype.itemsize if model_dtype != torch.float32 else 0
    grad_bytes = 4 if not low or cast.grads_on_device else low
    compact = compact_blocks is not None
    ring_dtype = copy_out_dtype(model_dtype, cast.params_on_device, compact)
    moments = compact_moment_bytes(host_numel, compact_blocks) if compact else 8 * host_numel
    largest = host_numel if largest_bucket is None else largest_bucket
    return {
        "master": 4 * host_numel,
        "moments": moments,
        "gradients": grad_bytes * host_numel,
        "param_copy_out": copy_out_bytes(largest, ring_dtype),
        "accumulation": grad_sum_bytes(host_numel) if accumulating else 0,
        "grad_slots": grad_slots_bytes(largest, grad_bytes) if compact else 0,
    }


STANDALONE_REMEDIES = (
    "Use fewer GPUs per host (fewer processes per host), keep more buckets on the GPU "
    "(gpu_tail), train a smaller model, or free host memory; with several GPUs, DeepSpeed "
    'ZeRO-3 ("super_offload": true) partitions this state over the ranks instead of '
    "replicating it."
)
