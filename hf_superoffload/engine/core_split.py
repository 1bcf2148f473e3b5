"""Which CPUs each rank's CPU Adam runs on: a disjoint share of the host per rank.

Every rank of a host runs its own CPU Adam team at about the same time. Left to float, the
teams of several ranks land on the same cores and slow each other down, and a rank's threads
run far from its GPU's NUMA node. ``split_cores`` gives each rank of the host its own share:
NUMA-local where the ranks' GPUs cover the nodes (the ranks of one node share that node's
cores), else an even split of all cores in node order; whole physical cores (hyperthread
siblings stay together) while there are enough; one core of the share kept free for the
training thread. A process the user or launcher already bound (its affinity smaller than the
host's, e.g. ``numactl``, ``deepspeed --bind_cores_to_rank``) keeps its binding; one bound to
its GPU's whole NUMA node (accelerate's ``enable_cpu_affinity``) splits that node with the
other ranks bound there.

The team is pinned through the thread that runs it: the engine's worker thread is bound to
the rank's CPUs when it starts, and GNU OpenMP creates the kernel's team threads from it, once,
so they inherit that affinity (``tests/test_core_split_ranks.py`` reads the threads' real
affinity). The training thread's affinity is left alone. ``HF_SUPEROFFLOAD_CPU_CORES`` turns
it off or sets the CPUs by hand.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence

import torch

from .. import env
from .cpu_topology import Topology, format_cpulist, gpu_numa_node, parse_cpulist, read_topology
from .host_memory import _host_of_every_rank, _ranks_on_this_host

logger = logging.getLogger("hf_superoffload")

CORES_ENV = "HF_SUPEROFFLOAD_CPU_CORES"
# This process's index among the job's processes on its host, as launchers name it (torchrun,
# accelerate and deepspeed's launcher; Open MPI, MVAPICH2, MPICH/Intel MPI; Slurm's srun).
LAUNCHER_LOCAL_RANKS = (
    "LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MV2_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "SLURM_LOCALID",
)
# Set, these make OpenMP (GNU's; KMP_AFFINITY: LLVM's, a clang build) bind each team thread
# to a place itself, over our binding.
OPENMP_BINDING_ENV = ("OMP_PLACES", "GOMP_CPU_AFFINITY", "OMP_PROC_BIND", "KMP_AFFINITY")


@dataclasses.dataclass(frozen=True)
class RankCores:
    cores: frozenset[int]  # this rank's share of the host, the training thread's core included
    adam: frozenset[int]  # where its CPU Adam team runs: the share less the kept core
    node: int | None  # the NUMA node holding the whole share, if one does
    how: str  # why, in words

    @property
    def kept(self) -> frozenset[int]:
        """The CPUs kept free for the training thread (none when the share is one CPU)."""
        return self.cores - self.adam


@dataclasses.dataclass(frozen=True)
class Team:
    threads: int  # the CPU Adam's OpenMP threads
    share: int  # the CPUs this rank counts as its own (its share of the host)
    cpus: frozenset[int] | None  # the CPUs they are bound to; None: they float (not split)
    how: str


# ----------------------------------------------------------------------------- the split


def split_cores(
    topology: Topology,
    local_ranks: int,
    local_rank: int,
    gpu_nodes: Sequence[int | None] | None = None,
) -> RankCores:
    """This rank's share of the host's CPUs. ``gpu_nodes``: each local rank's GPU's NUMA node
    (by local rank; None, or a None entry, where unknown)."""
    if not 0 <= local_rank < local_ranks:
        raise ValueError(f"local rank {local_rank} is not one of {local_ranks} on this host")
    if gpu_nodes is not None and len(gpu_nodes) != local_ranks:
        raise ValueError(f"{len(gpu_nodes)} GPU NUMA nodes given for {local_ranks} local ranks")
    usable, host = topology.usable, topology.host | topology.usable
    if not usable:
        raise ValueError("this process may run on no CPU (its affinity is empty)")
    nodes = {n: cpus & host for n, cpus in topology.nodes.items() if cpus & host}
    known = gpu_nodes is not None and all(node in nodes for node in gpu_nodes)
    mine = gpu_nodes[local_rank] if known else None
    if usable != host:
        if known and usable == nodes[mine]:
            sharers = [r for r in range(local_ranks) if gpu_nodes[r] == mine]
            how = f"bound to NUMA node {mine}, its GPU's, shared by local ranks {sharers}"
        else:
            sharers = [local_rank]
            how = "this process's own binding (set before it started), kept"
        pool = usable
    elif local_ranks == 1:
        pool, sharers, how = usable, [0], "the only rank on this host: all its CPUs"
    elif known and len(nodes) > 1 and set(gpu_nodes) == set(nodes):
        sharers = [r for r in range(local_ranks) if gpu_nodes[r] == mine]
        pool = nodes[mine]
        how = f"NUMA node {mine}, its GPU's, split between local ranks {sharers}"
    else:
        pool, sharers = usable, list(range(local_ranks))
        reason = "one NUMA node" if len(nodes) <= 1 else "GPU nodes unknown or not on every node"
        how = f"an even split between the {local_ranks} ranks of this host ({reason})"
    cores = _slice(pool, len(sharers), sharers.index(local_rank), topology)
    if len(cores) > 0 and len(pool) < len(sharers):
        how += f"; {len(sharers)} ranks for {len(pool)} CPUs, so ranks share CPUs"
    adam = _less_one_core(cores, topology)
    return RankCores(cores, adam, topology.node_of(cores), how)


def _ordered_cores(cpus: frozenset[int], topology: Topology) -> list[list[int]]:
    """``cpus`` grouped into physical cores, in NUMA node order, then by their first CPU."""
    groups: dict[int, list[int]] = {}
    for cpu in sorted(cpus):
        groups.setdefault(topology.core(cpu), []).append(cpu)

    def order(group):
        node = topology.node_of([group[0]])
        return (node if node is not None else -1, group[0])

    return sorted(groups.values(), key=order)


def _slice(pool: frozenset[int], n: int, i: int, topology: Topology) -> frozenset[int]:
    """Part ``i`` of ``n`` near-equal, contiguous parts of ``pool``: whole physical cores
    when there are at least ``n`` of them, else single CPUs, else one CPU shared round-robin."""
    cores = _ordered_cores(pool, topology)
    if len(cores) >= n:
        return frozenset(
            cpu for core in cores[i * len(cores) // n : (i + 1) * len(cores) // n] for cpu in core
        )
    cpus = [cpu for core in cores for cpu in core]
    if len(cpus) >= n:
        return frozenset(cpus[i * len(cpus) // n : (i + 1) * len(cpus) // n])
    return frozenset([cpus[i % len(cpus)]])


def _less_one_core(cores: frozenset[int], topology: Topology) -> frozenset[int]:
    """The share less one physical core (its first) for the training thread; with one core,
    less one of its hyperthreads; a single CPU is shared with the training thread."""
    groups = _ordered_cores(cores, topology)
    if len(groups) > 1:
        return cores - frozenset(groups[0])
    if len(cores) > 1:
        return cores - {min(cores)}
    return cores


def explicit_cores(value: str, topology: Topology, local_ranks: int, local_rank: int) -> RankCores:
    """``HF_SUPEROFFLOAD_CPU_CORES`` as CPU lists, one per local rank separated by ';'
    (e.g. ``0-13;14-27``): this rank's list, all of it for the CPU Adam."""
    lists = [part.strip() for part in value.split(";")]
    if len(lists) != local_ranks:
        raise ValueError(
            f"{CORES_ENV}={value!r} gives {len(lists)} CPU list(s) for the {local_ranks} rank(s) "
            f"on this host: give one per local rank, separated by ';' (e.g. 0-13;14-27), or "
            f"'auto' to split the host, or 'off'."
        )
    try:
        cores = parse_cpulist(lists[local_rank])
    except ValueError as error:
        raise ValueError(f"{CORES_ENV}: {error}") from None
    if not cores:
        raise ValueError(f"{CORES_ENV}={value!r} gives local rank {local_rank} no CPU.")
    outside = cores - topology.usable
    if outside:
        raise ValueError(
            f"{CORES_ENV} gives local rank {local_rank} CPUs {format_cpulist(outside)}, which "
            f"this process may not run on (its affinity is {format_cpulist(topology.usable)}); "
            f"choose CPUs among those, or unset {CORES_ENV}."
        )
    return RankCores(cores, cores, topology.node_of(cores), f"{CORES_ENV}")


def team_on(
    rank: RankCores,
    device_type: str,
    cpu_threads: int | None = None,
    cores_perc: float | None = None,
    torch_threads: int = 1,
) -> Team:
    """The CPU Adam's team on this rank's share: ``cpu_threads`` if given, else
    ``cores_perc`` of the share (DeepSpeed's ``cpuadam_cores_perc``), else the share less the
    training thread's core; on the CPU device, the share less torch's intra-op threads (which
    run forward and backward while the CPU Adam runs). A team larger than the CPU Adam's CPUs
    gets the whole share."""
    threads = _team_size(
        len(rank.cores), len(rank.adam), device_type, cpu_threads, cores_perc, torch_threads
    )
    cpus = rank.adam if threads <= len(rank.adam) else rank.cores
    return Team(threads, len(rank.cores), cpus, rank.how)


def _team_size(cores, adam, device_type, cpu_threads, cores_perc, torch_threads) -> int:
    if cpu_threads is not None:
        return cpu_threads
    if cores_perc is not None:
        return max(1, int(cores_perc * cores))
    if device_type == "cuda":
        return max(1, adam)
    return max(1, cores - torch_threads)


# ----------------------------------------------------------------------------- this process


def cores_setting() -> str:
    """``HF_SUPEROFFLOAD_CPU_CORES``: 'auto' (unset), 'off', or CPU lists."""
    value = (env.read(CORES_ENV) or "auto").strip()
    return value.lower() if value.lower() in ("auto", "off") else value


def local_rank_and_count() -> tuple[int | None, int, str]:
    """(this process's index among the job's processes on its host, None if unknown; their
    count; how they were found). torch.distributed's host names when it is initialized,
    else the launcher's variables."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        hosts, rank = _host_of_every_rank(), dist.get_rank()
        same = [r for r, host in enumerate(hosts) if host == hosts[rank]]
        return same.index(rank), len(same), "host names over torch.distributed"
    count, how = _ranks_on_this_host()
    for name in LAUNCHER_LOCAL_RANKS:
        value = os.environ.get(name, "").strip()
        if value.isdigit() and int(value) < count:
            return int(value), count, f"{how}, {name}"
    return (0 if count == 1 else None), count, how


def gpu_nodes_of_local_ranks(device_index: int | None, local_rank: int, count: int):
    """Each local rank's GPU's NUMA node, where this process sees every rank's GPU and uses
    the one numbered as its local rank (as accelerate, torchrun and deepspeed's launcher set
    things up); else None (a GPU per process made visible by the launcher: others unknown)."""
    if device_index is None or not torch.cuda.is_available():
        return None
    if device_index != local_rank or torch.cuda.device_count() < count:
        return None
    return [gpu_numa_node(index) for index in range(count)]


def _openmp_binds() -> str | None:
    for name in OPENMP_BINDING_ENV:
        value = os.environ.get(name, "").strip()
        if value and value.lower() not in ("false", "none", "disabled"):
            return name
    return None


def choose_team(
    device: torch.device, cpu_threads: int | None = None, cores_perc: float | None = None
) -> Team:
    """This rank's CPU Adam team: its size and, unless something says not to, its CPUs."""
    setting = cores_setting()
    topology = read_topology()
    local_rank, count, counted = local_rank_and_count()
    torch_threads = torch.get_num_threads()
    if setting not in ("auto", "off"):
        if local_rank is None:
            raise ValueError(
                f"{CORES_ENV} gives CPU lists by local rank, but {count} ranks run on this host "
                f"({counted}) and no launcher variable ({', '.join(LAUNCHER_LOCAL_RANKS)}) says "
                f"which this is; set LOCAL_RANK, or unset {CORES_ENV}."
            )
        if _openmp_binds():
            raise ValueError(
                f"{CORES_ENV} and {_openmp_binds()} both bind the CPU Adam's threads; unset one."
            )
    unsplit = None
    if setting == "off":
        unsplit = f"{CORES_ENV}=off"
    elif not hasattr(os, "sched_setaffinity"):
        unsplit = "this OS cannot bind threads"
    elif local_rank is None:
        unsplit = f"{count} ranks on this host ({counted}) but no launcher says which this is"
    elif _openmp_binds():
        unsplit = f"{_openmp_binds()} is set: OpenMP binds the threads itself"
    if unsplit is not None:
        # Not bound: the threads float over this process's CPUs, a count's share of them.
        bound = topology.usable != topology.host | topology.usable
        cores = len(topology.usable) if bound else max(1, len(topology.usable) // count)
        threads = _team_size(cores, cores - 1, device.type, cpu_threads, cores_perc, torch_threads)
        return Team(threads, cores, None, f"not split: {unsplit}")
    if setting == "auto":
        index = device.index if device.type == "cuda" else None
        rank = split_cores(
            topology, count, local_rank, gpu_nodes_of_local_ranks(index, local_rank, count)
        )
    else:
        rank = explicit_cores(setting, topology, count, local_rank)
    return team_on(rank, device.type, cpu_threads, cores_perc, torch_threads)


_team_cpus: frozenset[int] | None = None  # the last team's CPUs (use_team), for new workers


def use_team(team: Team, device_type: str) -> None:
    """Run the CPU Adam with ``team``: its thread count now, its CPUs in workers started after
    (``pin_cpu_adam_thread``); on a GPU, the training thread's own CPU ops on what it leaves
    (``leave_torch_the_rest``)."""
    from .. import ops

    global _team_cpus
    ops.set_num_threads(team.threads)
    _team_cpus = team.cpus
    where = f"CPUs {format_cpulist(team.cpus)}" if team.cpus is not None else "unbound"
    logger.info("hf_superoffload: CPU Adam: %d thread(s), %s (%s)", team.threads, where, team.how)
    if device_type == "cuda":
        leave_torch_the_rest(team)


def leave_torch_the_rest(team: Team) -> None:
    """torch's intra-op threads (the training thread's CPU ops) as many as the cores the team
    leaves of the rank's share, unless OMP_NUM_THREADS says otherwise. torch's default, one a
    core, wakes threads on the team's cores that keep spinning after each op while the CPU
    Adam runs: on one H100 (3.37B, compact moments, 15 threads) a step took 1.48 s with it and
    1.37 s without it. Launchers of several processes (torchrun, accelerate) set
    OMP_NUM_THREADS=1 already."""
    if os.environ.get("OMP_NUM_THREADS", "").strip():
        return
    rest = max(1, team.share - team.threads)
    if torch.get_num_threads() > rest:
        logger.info(
            "hf_superoffload: torch's CPU threads %d -> %d (the cores the CPU Adam leaves; "
            "set OMP_NUM_THREADS to choose)", torch.get_num_threads(), rest,
        )  # fmt: skip
        torch.set_num_threads(rest)


def pin_cpu_adam_thread(native_id: int) -> None:
    """Bind the thread ``native_id`` (the worker that runs the CPU Adam, before its first
    task) to the team's CPUs; OpenMP creates the kernel's other threads from it, and they
    inherit them. Nothing when the team floats."""
    if _team_cpus is None:
        return
    try:
        os.sched_setaffinity(native_id, _team_cpus)
    except OSError as error:  # e.g. the CPUs went offline, or a cpuset now excludes them
        raise RuntimeError(
            f"could not bind the CPU Adam's thread to CPUs {format_cpulist(_team_cpus)} "
            f"({error}); set {CORES_ENV} to CPUs this process may use, or to 'off'."
        ) from error


# ----------------------------------------------------------------------------- the report


def host_split(ranks: int, device_type: str, gpu_nodes: Sequence[int | None] | None) -> dict:
    """``hf-superoffload env``'s view: each of ``ranks`` local ranks' CPUs and default team, as
    the engine would choose them with this process's affinity (``gpu_nodes``: each local
    rank's GPU's NUMA node, None where unknown)."""
    setting, topology = cores_setting(), read_topology()
    report: dict = {"setting": setting, "not_split": None, "ranks": []}
    if setting == "off":
        report["not_split"] = f"{CORES_ENV}=off: the threads float over each process's CPUs"
    elif _openmp_binds():
        report["not_split"] = f"{_openmp_binds()} is set: OpenMP binds the threads itself"
    if report["not_split"]:
        return report
    torch_threads = torch.get_num_threads()
    for local_rank in range(ranks):
        if setting == "auto":
            rank = split_cores(topology, ranks, local_rank, gpu_nodes)
        else:
            rank = explicit_cores(setting, topology, ranks, local_rank)
        team = team_on(rank, device_type, torch_threads=torch_threads)
        report["ranks"].append(
            {
                "local_rank": local_rank,
                "cpus": format_cpulist(rank.cores),
                "cpu_adam_cpus": format_cpulist(team.cpus),
                "kept_for_training_thread": format_cpulist(rank.kept),
                "numa_node": rank.node,
                "threads": team.threads,
                "how": rank.how,
            }
        )
    return report
