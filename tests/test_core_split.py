"""Each rank of a host gets its own CPUs for its CPU Adam (``engine/core_split.py``): the split
over given topologies, the team sized on it, the engines' choice, and the settings refused."""

from __future__ import annotations

import itertools
import os
import random

import pytest
import torch

from hf_superoffload.engine import core_split
from hf_superoffload.engine.core_split import explicit_cores, split_cores, team_on
from hf_superoffload.engine.cpu_topology import Topology, format_cpulist, parse_cpulist

CUDA = torch.device("cuda", 0)  # only its type and index matter: no GPU is touched
CPU = torch.device("cpu")


def topology(cpus, nodes=None, siblings=(), usable=None) -> Topology:
    """``cpus`` CPUs, ``nodes`` (node -> CPU list text), ``siblings``: CPU lists of one core."""
    host = frozenset(range(cpus))
    nodes = {n: parse_cpulist(text) for n, text in (nodes or {0: f"0-{cpus - 1}"}).items()}
    core_of = {cpu: min(parse_cpulist(g)) for g in siblings for cpu in parse_cpulist(g)}
    return Topology(parse_cpulist(usable) if usable else host, host, nodes, core_of)


def shares(topo, ranks, gpu_nodes=None):
    return [split_cores(topo, ranks, r, gpu_nodes) for r in range(ranks)]


def lists(split) -> list[tuple[str, str]]:
    return [(format_cpulist(s.cores), format_cpulist(s.adam)) for s in split]


def test_one_node_two_ranks_each_get_half_less_the_training_threads_core():
    split = shares(topology(16), 2)
    assert lists(split) == [("0-7", "1-7"), ("8-15", "9-15")]
    assert [s.kept for s in split] == [{0}, {8}] and {s.node for s in split} == {0}


def test_two_nodes_four_ranks_stay_on_their_gpus_node():
    topo = topology(32, {0: "0-15", 1: "16-31"})
    split = shares(topo, 4, [0, 0, 1, 1])
    assert lists(split) == [
        ("0-7", "1-7"),
        ("8-15", "9-15"),
        ("16-23", "17-23"),
        ("24-31", "25-31"),
    ]
    assert [s.node for s in split] == [0, 0, 1, 1]
    # GPUs numbered across the nodes the other way: each rank still gets its GPU's node.
    split = shares(topo, 4, [1, 0, 1, 0])
    assert lists(split)[0] == ("16-23", "17-23") and lists(split)[1] == ("0-7", "1-7")
    assert [s.node for s in split] == [1, 0, 1, 0]


def test_gpus_on_one_node_of_two_or_unknown_split_the_host_evenly_in_node_order():
    topo = topology(32, {0: "0-7,16-23", 1: "8-15,24-31"})
    for gpu_nodes in ([0, 0], None, [0, None]):
        split = shares(topo, 2, gpu_nodes)
        assert lists(split) == [("0-7,16-23", "1-7,16-23"), ("8-15,24-31", "9-15,24-31")]
        assert [s.node for s in split] == [0, 1]


def test_hyperthread_siblings_stay_together_and_the_kept_core_is_whole():
    # 8 physical cores, CPU i and i + 8 on one core (Intel's numbering).
    topo = topology(16, siblings=[f"{i},{i + 8}" for i in range(8)])
    split = shares(topo, 2)
    assert lists(split) == [("0-3,8-11", "1-3,9-11"), ("4-7,12-15", "5-7,13-15")]
    assert [s.kept for s in split] == [{0, 8}, {4, 12}]
    # One core of two threads per rank: one thread each side.
    split = shares(topology(4, siblings=["0,2", "1,3"]), 2)
    assert lists(split) == [("0,2", "2"), ("1,3", "3")]
    # More ranks than cores, not than CPUs: the siblings are split, one CPU each.
    split = shares(topology(4, siblings=["0,2", "1,3"]), 3)
    assert [s.cores for s in split] == [{0}, {2}, {1, 3}]


def test_a_rank_the_user_bound_keeps_its_binding():
    topo = topology(32, usable="8-15")  # numactl -C 8-15, deepspeed --bind_cores_to_rank
    for ranks, rank in ((1, 0), (4, 1), (4, 3)):
        got = split_cores(topo, ranks, rank, None)
        assert (format_cpulist(got.cores), format_cpulist(got.adam)) == ("8-15", "9-15")
        assert "binding" in got.how


def test_ranks_bound_to_their_gpus_node_split_it_with_the_others_bound_there():
    # accelerate's enable_cpu_affinity binds each rank to its GPU's whole node.
    nodes = {0: "0-15", 1: "16-31"}
    got = split_cores(topology(32, nodes, usable="16-31"), 4, 2, [0, 0, 1, 1])
    assert format_cpulist(got.cores) == "16-23" and got.node == 1
    got = split_cores(topology(32, nodes, usable="16-31"), 4, 3, [0, 0, 1, 1])
    assert format_cpulist(got.cores) == "24-31"
    # Bound to a node that is not its GPU's: the user's choice, kept whole.
    got = split_cores(topology(32, nodes, usable="0-15"), 4, 2, [0, 0, 1, 1])
    assert format_cpulist(got.cores) == "0-15"


def test_more_ranks_than_cpus_share_cpus_round_robin():
    split = shares(topology(2), 4)
    assert [s.cores for s in split] == [{0}, {1}, {0}, {1}]
    assert all(s.adam == s.cores and not s.kept for s in split)  # nothing left to keep
    assert "share CPUs" in split[0].how


def test_odd_counts_split_into_near_equal_disjoint_parts():
    for cpus, ranks in ((16, 3), (7, 2), (10, 4), (2, 2)):
        split = shares(topology(cpus), ranks)
        sizes = sorted(len(s.cores) for s in split)
        assert sizes[-1] - sizes[0] <= 1, (cpus, ranks, sizes)
        assert frozenset().union(*(s.cores for s in split)) == frozenset(range(cpus))
        assert sum(sizes) == cpus  # disjoint


def test_one_rank_takes_all_its_cpus_less_one_core():
    got = split_cores(topology(16, {0: "0-7", 1: "8-15"}), 1, 0, [1])
    assert (format_cpulist(got.cores), format_cpulist(got.adam)) == ("0-15", "1-15")
    assert got.node is None  # spans both nodes
    assert split_cores(topology(1), 1, 0).adam == {0}  # one CPU: shared with training


def test_random_topologies_give_disjoint_shares_within_the_host():
    rng = random.Random(0)
    for _ in range(200):
        n_nodes, per_node, smt = rng.choice([1, 2, 4]), rng.choice([1, 2, 3, 8]), rng.choice([1, 2])
        cores = n_nodes * per_node
        cpus = cores * smt
        nodes = {
            n: ",".join(str(c + t * cores) for c in range(n * per_node, (n + 1) * per_node) for t in range(smt))
            for n in range(n_nodes)
        }  # fmt: skip
        siblings = [",".join(str(c + t * cores) for t in range(smt)) for c in range(cores)]
        topo = topology(cpus, nodes, siblings)
        ranks = rng.randint(1, 2 * cpus)
        gpu_nodes = rng.choice([None, [rng.randrange(n_nodes) for _ in range(ranks)]])
        split = shares(topo, ranks, gpu_nodes)
        for s in split:
            assert s.adam and s.adam <= s.cores <= topo.host
        if ranks <= cpus and (gpu_nodes is None or set(gpu_nodes) != set(nodes) or n_nodes == 1):
            for a, b in itertools.combinations(split, 2):
                assert not a.cores & b.cores, (nodes, ranks, gpu_nodes)


def test_explicit_lists_one_per_local_rank():
    topo = topology(16)
    got = explicit_cores("0-6; 8-14", topo, 2, 1)
    assert got.cores == got.adam == parse_cpulist("8-14")
    with pytest.raises(ValueError, match=r"gives 1 CPU list.*for the 2 rank.*one per local rank"):
        explicit_cores("0-7", topo, 2, 0)
    with pytest.raises(ValueError, match=r"CPUs 16-17, which this process may not run on .* 0-15"):
        explicit_cores("0-7;14-17", topo, 2, 1)
    with pytest.raises(ValueError, match="not a CPU list: '8-x'"):
        explicit_cores("0-7;8-x", topo, 2, 1)
    with pytest.raises(ValueError, match="gives local rank 1 no CPU"):
        explicit_cores("0-7;", topo, 2, 1)


def test_the_team_is_sized_on_the_share():
    rank = split_cores(topology(32), 2, 1)  # 16-31, CPU Adam on 17-31
    assert team_on(rank, "cuda") == core_split.Team(15, 16, rank.adam, rank.how)
    assert team_on(rank, "cuda", cores_perc=0.5).threads == 8
    assert team_on(rank, "cpu", torch_threads=4).threads == 12  # torch's threads run backward
    # More threads than the CPU Adam's CPUs: the whole share, the kept core too.
    assert team_on(rank, "cuda", cpu_threads=16).cpus == rank.cores
    assert team_on(rank, "cuda", cpu_threads=40).cpus == rank.cores  # asked for: oversubscribed


# ----------------------------------------------------------------------------- this process


@pytest.fixture
def host(monkeypatch):
    """A 64-CPU host of two nodes, seen by a process bound by nobody, no launcher variables."""
    for name in (
        core_split.CORES_ENV,
        "HF_SUPEROFFLOAD_CPU_THREADS",
        *core_split.OPENMP_BINDING_ENV,
    ):
        monkeypatch.delenv(name, raising=False)
    for name in (*core_split.LAUNCHER_LOCAL_RANKS, "LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    topo = topology(64, {0: "0-31", 1: "32-63"})
    monkeypatch.setattr(core_split, "read_topology", lambda: topo)
    monkeypatch.setattr(core_split, "gpu_nodes_of_local_ranks", lambda index, rank, count: None)
    return topo


def test_the_launchers_local_rank_picks_this_ranks_share(host, monkeypatch):
    assert core_split.choose_team(CUDA) == core_split.Team(
        63, 64, parse_cpulist("1-63"), split_cores(host, 1, 0).how
    )
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "2")
    team = core_split.choose_team(CUDA)
    assert (team.threads, team.cpus) == (15, parse_cpulist("33-47"))
    assert team.cpus == split_cores(host, 4, 2).adam
    # GPUs on both nodes: rank 2's GPU on node 0.
    monkeypatch.setattr(
        core_split, "gpu_nodes_of_local_ranks", lambda index, rank, count: [1, 1, 0, 0]
    )
    assert core_split.choose_team(CUDA).cpus == parse_cpulist("1-15")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "3")  # LOCAL_RANK comes first
    assert core_split.choose_team(CUDA).cpus == parse_cpulist("1-15")


def test_off_unknown_rank_or_openmps_own_binding_leave_the_threads_floating(host, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # no LOCAL_RANK: which share is unknown
    team = core_split.choose_team(CUDA)
    assert (team.threads, team.cpus) == (15, None) and "no launcher says" in team.how
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("OMP_PROC_BIND", "close")
    assert core_split.choose_team(CUDA).cpus is None
    monkeypatch.setenv("OMP_PROC_BIND", "false")
    assert core_split.choose_team(CUDA).cpus == parse_cpulist("1-15")
    monkeypatch.setenv(core_split.CORES_ENV, "off")
    team = core_split.choose_team(CUDA)
    assert (team.threads, team.cpus) == (15, None)


def test_explicit_cores_by_local_rank_and_the_settings_refused(host, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv(core_split.CORES_ENV, "0-7;32-39")
    team = core_split.choose_team(CUDA)
    assert (team.threads, team.cpus) == (8, parse_cpulist("32-39"))
    monkeypatch.setenv("OMP_PLACES", "cores")
    with pytest.raises(ValueError, match="HF_SUPEROFFLOAD_CPU_CORES and OMP_PLACES both bind"):
        core_split.choose_team(CUDA)
    monkeypatch.delenv("OMP_PLACES")
    monkeypatch.delenv("LOCAL_RANK")
    with pytest.raises(ValueError, match=r"no launcher variable .*LOCAL_RANK.* says which"):
        core_split.choose_team(CUDA)


def test_default_cpu_threads_share_a_host_between_ranks(host, monkeypatch):
    from hf_superoffload.engine import checks

    assert checks.default_cpu_threads(CUDA) == 63  # one core feeds the GPU
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert checks.default_cpu_threads(CUDA) == 15  # 64 / 4 ranks, minus the feeding core
    assert checks.cores_of_this_rank() == 16


def test_the_deepspeed_paths_team_is_the_split(host, monkeypatch):
    from hf_superoffload.zero3.options import resolve_options

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    planned = split_cores(host, 2, 1)
    team = resolve_options(None, CUDA).team
    assert team == core_split.choose_team(CUDA) == team_on(planned, "cuda")
    assert (team.threads, team.cpus) == (31, parse_cpulist("33-63"))
    team = resolve_options(0.5, CUDA).team  # the config's cpuadam_cores_perc
    assert team == team_on(planned, "cuda", cores_perc=0.5) and team.threads == 16
    monkeypatch.setenv("HF_SUPEROFFLOAD_CPU_THREADS", "40")
    team = resolve_options(None, CUDA).team
    assert (team.threads, team.cpus) == (40, planned.cores)


def test_a_cpu_list_round_trips():
    for text in ("0", "0-3", "0-3,8,10-11"):
        assert format_cpulist(parse_cpulist(text)) == text
    with pytest.raises(ValueError, match="runs backwards"):
        parse_cpulist("3-1")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux thread affinity")
def test_the_engines_worker_runs_on_the_teams_cpus(monkeypatch):
    """The optimizer's worker thread, which runs the CPU Adam, is bound to the team's CPUs;
    the training thread is not."""
    from hf_superoffload import SuperOffloadOptimizer

    usable = os.sched_getaffinity(0)
    cpu = max(usable)
    monkeypatch.setenv(core_split.CORES_ENV, str(cpu))
    model = torch.nn.Linear(8, 8)
    optimizer = SuperOffloadOptimizer(model.parameters(), gpu_tail=0)
    try:
        model(torch.randn(2, 8)).sum().backward()
        optimizer.step()
        worker = optimizer._stv.worker._thread.native_id
        assert os.sched_getaffinity(worker) == {cpu}
        assert os.sched_getaffinity(0) == usable
    finally:
        optimizer.close()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux thread affinity")
def test_a_team_on_cpus_the_host_lacks_is_refused_by_the_worker(monkeypatch):
    from hf_superoffload.engine.worker import Worker

    monkeypatch.setattr(core_split, "_team_cpus", frozenset({4095}))
    with pytest.raises(RuntimeError, match=r"CPUs 4095 .*set HF_SUPEROFFLOAD_CPU_CORES to CPUs"):
        Worker()


def test_openmp_affinity_variables_that_bind_nothing_leave_the_split(host, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    for value, split in (("disabled", True), ("none", True), ("compact", False)):
        monkeypatch.setenv("KMP_AFFINITY", value)
        assert (core_split.choose_team(CUDA).cpus is not None) == split, value


def test_without_thread_affinity_the_team_is_sized_and_left_floating(monkeypatch):
    """macOS and Windows have no sched_getaffinity or sched_setaffinity."""
    from hf_superoffload.engine import cpu_topology

    monkeypatch.delenv(core_split.CORES_ENV, raising=False)
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", *core_split.LAUNCHER_LOCAL_RANKS):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delattr(os, "sched_getaffinity")
    monkeypatch.delattr(os, "sched_setaffinity")
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert cpu_topology.read_topology().usable == frozenset(range(8))
    assert core_split.choose_team(CUDA) == core_split.Team(
        7, 8, None, "not split: this OS cannot bind threads"
    )
