"""Data parallelism is refused until supported: under DDP the engine's gradient hooks would
see each rank's local, un-reduced gradients, a silent error."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hf_superoffload import SuperOffloadOptimizer


def _build_on_rank(rank: int, world: int, rendezvous: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        SuperOffloadOptimizer([torch.nn.Parameter(torch.zeros(4))], gpu_buckets=0).close()
        results.put((rank, "built"))
    except RuntimeError as error:
        results.put((rank, str(error)))
    finally:
        dist.destroy_process_group()


def _outcomes(world: int, tmp_path) -> list[str]:
    context = mp.get_context("spawn")
    results = context.Queue()
    procs = [
        context.Process(target=_build_on_rank, args=(r, world, str(tmp_path / "rdv"), results))
        for r in range(world)
    ]
    for proc in procs:
        proc.start()
    outcomes = sorted(results.get(timeout=60) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    return [message for _, message in outcomes]


def test_two_ranks_are_refused_with_a_clear_error(tmp_path):
    outcomes = _outcomes(2, tmp_path)
    assert all("does not support data parallelism yet (world size 2)" in m for m in outcomes)


def test_a_world_of_one_is_plain_training(tmp_path):
    assert _outcomes(1, tmp_path) == ["built"]
