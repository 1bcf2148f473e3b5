"""Runs a test body on several spawned processes, as a launcher would start data-parallel
ranks, and fails (rather than hangs) if any of them does not finish cleanly."""

from __future__ import annotations

import os
import socket
import sys

import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (rank 0 listens on it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def set_rank_env(rank: int, world: int, port: int) -> None:
    """Set what a launcher (torchrun, accelerate, deepspeed) sets for ``rank`` of ``world``
    ranks on this host, before the process group, DeepSpeed or the Trainer reads it."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


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


def one_cpu_rank_env(**variables: str) -> dict[str, str]:
    """The environment of a subprocess that runs one DeepSpeed rank on the CPU (gloo), with
    this checkout and tests/ importable: the caller's, less its HF_SUPEROFFLOAD_* variables
    and accelerate's DeepSpeed config file, plus ``variables``."""
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_SUPEROFFLOAD_")}
    env.pop("ACCELERATE_DEEPSPEED_CONFIG_FILE", None)
    env.update(
        DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", RANK="0", LOCAL_RANK="0",
        WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
        PYTHONPATH=os.pathsep.join([os.path.dirname(tests), tests, *sys.path]),
    )  # fmt: skip
    env.update(variables)
    return env
