"""``hf-superoffload env`` shows each local rank's CPUs for its CPU Adam: for the ranks a
launcher started on this host, else one rank per GPU of this host."""

from __future__ import annotations

import json

import pytest

from hf_superoffload.cli import env_facts, main
from hf_superoffload.engine import core_split
from hf_superoffload.engine.cpu_topology import Topology, parse_cpulist

NODES = {0: parse_cpulist("0-15"), 1: parse_cpulist("16-31")}


@pytest.fixture
def host(monkeypatch):
    """32 CPUs on two nodes; no launcher variables; four GPUs, two on each node."""
    for name in (core_split.CORES_ENV, *core_split.OPENMP_BINDING_ENV):
        monkeypatch.delenv(name, raising=False)
    for name in (*core_split.LAUNCHER_LOCAL_RANKS, "LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    cpus = frozenset(range(32))
    monkeypatch.setattr(core_split, "read_topology", lambda: Topology(cpus, cpus, NODES, {}))
    gpus = [{"index": i, "name": "GPU", "memory_bytes": 2**34, "capability": "9.0",
             "multiprocessors": 132, "numa_node": i // 2} for i in range(4)]  # fmt: skip
    monkeypatch.setattr(env_facts, "gpus", lambda measure_bandwidth: gpus)
    monkeypatch.setattr(core_split.torch, "get_num_threads", lambda: 1)


def run(capsys, *args) -> str:
    assert main(["env", "--no-bandwidth", *args]) == 0
    return capsys.readouterr().out


def test_env_shows_one_rank_per_gpu_on_its_node(host, capsys):
    out = run(capsys)
    assert "CPU Adam cores per local rank (one rank per GPU of this host (4); " in out
    assert "  rank 0: CPUs 0-7, NUMA node 0; CPU Adam 7 thread(s) on 1-7, CPU 0 kept" in out
    assert "  rank 3: CPUs 24-31, NUMA node 1; CPU Adam 7 thread(s) on 25-31, CPU 24 kept" in out
    assert "  chosen as: NUMA node" not in out  # the ranks' reasons differ: each says its own
    assert "(NUMA node 1, its GPU's, split between local ranks [2, 3])" in out
    split = json.loads(run(capsys, "--json"))["core_split"]
    assert split["setting"] == "auto" and len(split["ranks"]) == 4
    assert split["ranks"][2] == {
        "local_rank": 2, "cpus": "16-23", "cpu_adam_cpus": "17-23",
        "kept_for_training_thread": "16", "numa_node": 1, "threads": 7,
        "how": "NUMA node 1, its GPU's, split between local ranks [2, 3]",
    }  # fmt: skip


def test_env_shows_the_ranks_a_launcher_started(host, capsys, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    out = run(capsys)
    assert "(2 ranks on this host (LOCAL_WORLD_SIZE); HF_SUPEROFFLOAD_CPU_CORES=auto)" in out
    assert "  rank 1: CPUs 16-31, NUMA node 1; CPU Adam 15 thread(s) on 17-31" in out


def test_env_says_when_the_cores_are_not_split_or_the_setting_is_refused(host, capsys, monkeypatch):
    monkeypatch.setenv(core_split.CORES_ENV, "off")
    assert "  not split: HF_SUPEROFFLOAD_CPU_CORES=off" in run(capsys)
    monkeypatch.setenv(core_split.CORES_ENV, "0-7;8-15")  # two lists for four ranks
    out = run(capsys)
    assert "  refused: HF_SUPEROFFLOAD_CPU_CORES='0-7;8-15' gives 2 CPU list(s)" in out
    monkeypatch.setenv(core_split.CORES_ENV, "0-7;8-15;16-23;24-31")
    assert "  rank 3: CPUs 24-31, NUMA node 1; CPU Adam 8 thread(s) on 24-31\n" in run(capsys)
