"""Runs a test body on several spawned processes, as a launcher would start data-parallel
ranks, and fails (rather than hangs) if any of them does not finish cleanly."""

from __future__ import annotations

import torch.multiprocessing as mp


def spawn_ranks(target, args: tuple, world: int, timeout: float = 300) -> None:
    """Run ``target(rank, *args)`` for each rank; all must exit with 0 within ``timeout``."""
    context = mp.get_context("spawn")
    procs = [context.Process(target=target, args=(rank, *args)) for rank in range(world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=timeout)
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    assert [proc.exitcode for proc in procs] == [0] * world, "a rank failed (see its stderr)"
