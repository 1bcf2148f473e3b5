"""DeepSpeed's documented way to accumulate a variable number of micro-batches: several
``engine.backward()`` per ``engine.step()`` with ``gradient_accumulation_steps`` 1 and the
boundary set by hand (``engine.set_gradient_accumulation_boundary``), with or without
``engine.coalesce_grad_reduction()``, and with or without ``offload_param`` (DeepSpeed's
``TestCoalesceCpuOffload[3-True-False]`` and ``[3-True-True]``). SuperOffload follows DeepSpeed's
plain CPU offload tensor by tensor, and counts the accumulation buffer it then needs."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from ranks import spawn_ranks
from zero3_reference import (
    TOLERANCES,
    Zero3Case,
    assert_states_close,
    batch,
    free_port,
    init_rank,
    make_engine,
    optimizer_state,
)

MICRO_BATCHES, STEPS = 4, 2
CASES = {  # (offload_param, coalesce); the other two pairings take the same paths
    "boundary_by_hand": (False, False),
    "coalesced_params_offloaded": (True, True),
}


def _train(engine, case: Zero3Case, rank: int, coalesce: bool) -> None:
    for step in range(STEPS):
        block = engine.coalesce_grad_reduction() if coalesce else contextlib.nullcontext()
        with block:
            for micro in range(MICRO_BATCHES):
                ids = batch(case, step, micro, rank, engine.device)
                loss = engine(input_ids=ids, labels=ids).loss
                engine.set_gradient_accumulation_boundary(micro == MICRO_BATCHES - 1)
                engine.backward(loss)
        engine.step()


def _on_rank(rank, world, port, out_dir) -> None:
    init_rank(rank, world, port)
    torch.set_num_threads(1)
    import hf_superoffload  # noqa: F401

    results = {}
    for name, (offload_param, coalesce) in CASES.items():
        case = Zero3Case(max_grad_norm=1.0, offload_param=offload_param, schedule=False)
        for engine_name, super_offload in (("reference", False), ("superoffload", True)):
            engine, optimizer = make_engine(case, super_offload, world)
            _train(engine, case, rank, coalesce)
            record = {"state": optimizer_state(engine), "kind": type(optimizer).__name__}
            if super_offload:
                record["host_bytes"] = optimizer.host_bytes()
            results[(name, engine_name)] = record
            engine.destroy()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
def test_backwards_with_the_boundary_set_by_hand_follow_deepspeed(tmp_path):
    world = 2
    spawn_ranks(_on_rank, (world, free_port(), str(tmp_path)), world)
    for rank in range(world):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for name in CASES:
            ref, ours = results[(name, "reference")], results[(name, "superoffload")]
            assert ours["kind"] == "SuperOffloadZero3Optimizer"
            assert ours["state"]["step"] == [STEPS]
            assert_states_close(ours["state"], ref["state"], TOLERANCES, f"{name} rank {rank}")
            # The accumulation buffer it made once the boundary was set by hand is counted.
            assert ours["host_bytes"]["accumulation"] > 0, name
