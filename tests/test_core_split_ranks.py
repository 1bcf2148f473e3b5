"""Two ranks of one host, started as a launcher starts them (LOCAL_RANK, LOCAL_WORLD_SIZE):
each one's CPU Adam threads run on its own CPUs, read from the kernel's threads themselves
(/proc/self/task/*/status) while a kernel call runs."""

from __future__ import annotations

import json
import os
import time

import pytest

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="Linux thread affinity"
)


def _affinities() -> dict[int, str]:
    """Every thread of this process, by id: its CPUs as the kernel lists them."""
    found = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                status = f.read()
        except OSError:  # ended meanwhile
            continue
        for line in status.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                found[int(tid)] = line.split()[1]
    return found


def _rank(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch
    from ranks import set_rank_env

    from hf_superoffload import ops
    from hf_superoffload.engine import core_split
    from hf_superoffload.engine.cpu_topology import format_cpulist
    from hf_superoffload.engine.worker import Worker

    set_rank_env(rank, world, port)
    torch.set_num_threads(1)
    ops.prepare()
    # The engine's set-up: the team of 2 threads (an OpenMP thread beside the worker) on
    # this rank's share, then the worker that runs the CPU Adam.
    team = core_split.choose_team(torch.device("cpu"), cpu_threads=2)
    core_split.use_team(team, "cpu")
    before = set(_affinities())
    worker = Worker()
    n = 4_000_000
    state = [torch.rand(n) for _ in range(4)]
    hyper = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    for key in range(6):
        worker.submit([key], lambda: ops.adam_step(*state, **hyper))
    seen: dict[int, str] = {}
    while worker.busy(range(6)):  # the kernel runs: read its threads' CPUs
        seen.update({t: cpus for t, cpus in _affinities().items() if t not in before})
        time.sleep(0.002)
    worker.wait()
    worker.close()
    result = {
        "planned": format_cpulist(team.cpus),
        "threads": seen,
        "worker": worker._thread.native_id,
        "training_thread": _affinities()[os.getpid()],
        "how": team.how,
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def test_two_ranks_run_their_cpu_adam_threads_on_disjoint_cpus(tmp_path):
    from ranks import free_port, spawn_ranks

    from hf_superoffload.engine.core_split import split_cores, team_on
    from hf_superoffload.engine.cpu_topology import format_cpulist, read_topology

    spawn_ranks(_rank, (2, free_port(), str(tmp_path)), 2, timeout=120)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    usable = format_cpulist(os.sched_getaffinity(0))
    planned = []
    for rank, result in enumerate(results):
        expected = team_on(split_cores(read_topology(), 2, rank), "cpu", cpu_threads=2)
        assert result["planned"] == format_cpulist(expected.cpus), result
        # The worker and OpenMP's thread it created: at least two threads ran the kernel,
        # every new thread of the rank on its planned CPUs; the training thread untouched.
        threads = {int(t): cpus for t, cpus in result["threads"].items()}
        assert result["worker"] in threads and len(threads) >= 2, result
        assert set(threads.values()) == {result["planned"]}, result
        assert result["training_thread"] == usable
        planned.append(expected.cpus)
    if len(os.sched_getaffinity(0)) >= 2:
        assert not planned[0] & planned[1], planned  # disjoint where the host has the CPUs


def _zero3_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch
    from zero3_reference import Zero3Case, init_rank, make_engine

    init_rank(rank, world, port)
    torch.set_num_threads(1)
    import hf_superoffload  # noqa: F401  (the ZeRO-3 path)
    from hf_superoffload import ops
    from hf_superoffload.engine.cpu_topology import format_cpulist

    _, optimizer = make_engine(Zero3Case(), True, world)
    worker = optimizer._stv.worker._thread.native_id
    result = {
        "worker": _affinities()[worker],
        "threads": ops.get_num_threads(),
        "training_thread": format_cpulist(os.sched_getaffinity(0)),
    }
    with open(os.path.join(out_dir, f"zero3_rank{rank}.json"), "w") as f:
        json.dump(result, f)


def test_the_zero3_paths_ranks_bind_their_workers_to_their_shares(tmp_path):
    """Under DeepSpeed ZeRO-3 (two gloo ranks, which find the ranks of their host by host name
    over torch.distributed), each rank's worker runs on the split's CPUs for that rank and the
    team has the split's size; the training thread keeps the process's CPUs."""
    from ranks import free_port, spawn_ranks

    from hf_superoffload.engine.core_split import split_cores, team_on
    from hf_superoffload.engine.cpu_topology import format_cpulist, read_topology

    spawn_ranks(_zero3_rank, (2, free_port(), str(tmp_path)), 2, timeout=240)
    for rank in range(2):
        result = json.loads((tmp_path / f"zero3_rank{rank}.json").read_text())
        expected = team_on(split_cores(read_topology(), 2, rank), "cpu", torch_threads=1)
        assert result["worker"] == format_cpulist(expected.cpus), result
        assert result["threads"] == expected.threads
        assert result["training_thread"] == format_cpulist(os.sched_getaffinity(0))
