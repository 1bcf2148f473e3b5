"""A gather issued through a param outside the optimizer (a frozen one) waits for the CPU updates
of the trainable params it gathers with it.

DeepSpeed gathers a list of params through the gather function of its first one: the
coordinator's prefetch takes the first of a set (its order is the params' addresses), and
``GatheredParameters`` the lowest ``ds_id`` (a frozen first layer's). The updates ``step()``
left running on the worker must be in whatever such a gather reads, as they are on DeepSpeed's
plain offload, whose step is done when it returns.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
from engine_reference import PARAM_TOL
from ranks import spawn_ranks
from zero3_peer_reference import PeerSetup, build_engine, micro_batch
from zero3_reference import free_port, init_rank

HOLD_SECONDS = 1.0  # how long the worker is held after step() returns


def _gathered_after_one_step(super_offload: bool, world: int, rank: int) -> dict:
    """The frozen first layer's and the trainable second layer's weights, gathered together
    (through the frozen one: lowest ds_id) right after one step."""
    import deepspeed

    engine = build_engine(PeerSetup(frozen=True, zero_init=True), super_offload, world)
    frozen, trainable = engine.module.layers[0].weight, engine.module.layers[1].weight
    if super_offload:
        # Hold the worker (a task on no sub group, queued before the step's) until a timer
        # lets it go: the step's updates are still to come when step() returns.
        release = threading.Event()
        engine.optimizer._stv.worker.submit([], release.wait)
        timer = threading.Timer(HOLD_SECONDS, release.set)
        timer.start()
    engine.backward(engine(*micro_batch(0, 0, rank)))
    engine.step()
    with deepspeed.zero.GatheredParameters([frozen, trainable]):
        gathered = {"frozen": frozen.detach().clone(), "trainable": trainable.detach().clone()}
    if super_offload:
        timer.join()
        engine.optimizer.synchronize()
    engine.destroy()
    return gathered


def _on_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    init_rank(rank, world, port)
    torch.set_num_threads(1)
    import hf_superoffload  # noqa: F401  (activates the ZeRO-3 path)

    result = {
        mode: _gathered_after_one_step(mode == "ours", world, rank) for mode in ("plain", "ours")
    }
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "world", [1, pytest.param(2, marks=pytest.mark.slow)], ids=["world1", "world2"]
)
def test_a_gather_through_a_frozen_param_reads_the_stepped_weights(world, tmp_path):
    spawn_ranks(_on_rank, (world, free_port(), str(tmp_path)), world)
    for rank in range(world):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        plain, ours = result["plain"], result["ours"]
        torch.testing.assert_close(ours["frozen"], plain["frozen"], rtol=0.0, atol=0.0)
        torch.testing.assert_close(
            ours["trainable"], plain["trainable"], **PARAM_TOL,
            msg=lambda m, rank=rank: f"rank {rank}: the gathered trainable weight: {m}",
        )  # fmt: skip
