"""Runs the cases of tests/test_zero3_peer_cases.py on spawned ranks: each case on DeepSpeed's
plain offload, then on ours, several cases per spawn (DeepSpeed's start-up is the slow part).

A case that raises on one rank leaves the ranks out of step: the others go on to a collective
that rank never enters (gloo then waits out its timeout), or meet it in a different one. So a
rank stops at its first error and exits (gloo fails its peers' pending collective at once),
the case that failed is reported with every rank's error, and the cases after it run in a
fresh spawn. A rank that hangs outright leaves the case it was running marked unfinished.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import torch
from ranks import spawn_ranks
from zero3_reference import free_port, init_rank

MODES = (("plain", False), ("ours", True))
UNFINISHED = "did not finish: the rank hung or died in it (the spawn was stopped)"


def run_cases(rank: int, world: int, port: int, runs: dict[str, Callable], out_dir: str) -> None:
    """Spawn target: ``run(super_offload, world, rank, out_dir)`` of each case in order and
    mode, each result written as soon as it exists; stops at this rank's first error."""
    init_rank(rank, world, port)
    torch.set_num_threads(1)
    import hf_superoffload  # noqa: F401  (activates the ZeRO-3 path)

    path = os.path.join(out_dir, f"rank{rank}.pt")
    results = {}
    for name, run in runs.items():
        for mode, super_offload in MODES:
            results[(name, mode)] = {"error": UNFINISHED}
            torch.save(results, path)
            try:
                results[(name, mode)] = {"value": run(super_offload, world, rank, out_dir)}
            except Exception as error:  # recorded; the test says what failed where
                results[(name, mode)] = {"error": f"{type(error).__name__}: {error}"}
                torch.save(results, path)
                return
            torch.save(results, path)


def spawn_cases(runs: dict[str, Callable], world: int, out_dir: str, timeout=600) -> list[dict]:
    """Every case's results per rank: ``{(name, mode): {"value": ...} or {"error": ...}}``; a
    case missing on a rank never started there. After a case that failed on any rank, the
    following ones run again in a fresh spawn."""
    merged: list[dict] = [{} for _ in range(world)]
    names = list(runs)
    attempt = 0
    while names:
        folder = os.path.join(out_dir, f"spawn{attempt}")
        per_rank = _spawn_once({n: runs[n] for n in names}, world, folder, timeout)
        if not any(per_rank):  # no rank started a case (start-up failed): no use retrying
            break
        settled = _settled(names, per_rank, world)
        for rank, results in enumerate(per_rank):
            merged[rank].update({k: v for k, v in results.items() if k[0] in settled})
        names = names[len(settled) :]
        attempt += 1
    return merged


def _spawn_once(runs, world, out_dir, timeout) -> list[dict]:
    os.makedirs(out_dir, exist_ok=True)
    # A rank that failed or hung: what it wrote says how far it got.
    with contextlib.suppress(AssertionError):
        spawn_ranks(run_cases, (world, free_port(), runs, out_dir), world, timeout=timeout)
    results = []
    for rank in range(world):
        path = os.path.join(out_dir, f"rank{rank}.pt")
        results.append(torch.load(path, weights_only=False) if os.path.exists(path) else {})
    return results


def _settled(names: list[str], per_rank: list[dict], world: int) -> list[str]:
    """The leading cases this spawn answered: those that passed on every rank, and the first
    one that did not (what comes after it ran out of step, or not at all)."""
    for count, name in enumerate(names, 1):
        for rank in range(world):
            for mode, _ in MODES:
                if "value" not in per_rank[rank].get((name, mode), {}):
                    return names[:count]
    return names


def failures(per_rank: list[dict], name: str) -> str:
    """Every rank's error (or missing result) in case ``name``, one line each."""
    lines = []
    for rank, results in enumerate(per_rank):
        for mode, _ in MODES:
            result = results.get((name, mode))
            if result is None:
                lines.append(f"rank {rank} {mode}: not run (a failure before it, or no start)")
            elif "error" in result:
                lines.append(f"rank {rank} {mode}: {result['error']}")
    return "\n".join(lines)
