"""A SuperOffload ZeRO-3 optimizer whose constructor fails after its STV core (and the core's
worker thread) exists leaves no thread behind: each failed attempt used to leave one running."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from ranks import spawn_ranks
from zero3_reference import Zero3Case, free_port, init_rank, make_engine

WORKER = "hf_superoffload-worker"


def _on_rank(rank, world, port, out_dir) -> None:
    init_rank(rank, world, port)
    torch.set_num_threads(1)
    import hf_superoffload  # noqa: F401
    from hf_superoffload.zero3.optimizer import SuperOffloadZero3Optimizer

    made = []

    def failing(self, *args, **kwargs):
        made.append(self._stv.worker.alive)  # the core and its thread exist by now
        raise RuntimeError("injected after the STV core was made")

    SuperOffloadZero3Optimizer._build_host_partitions = failing
    errors = []
    for _ in range(2):
        with pytest.raises(RuntimeError, match="injected") as error:
            make_engine(Zero3Case(), True, world)
        errors.append(str(error.value))
    alive = [t.name for t in threading.enumerate() if t.name.startswith(WORKER)]
    torch.save({"made": made, "alive": alive, "errors": errors}, os.path.join(out_dir, "r.pt"))


@pytest.mark.slow
def test_a_constructor_that_fails_after_the_stv_core_leaves_no_worker_thread(tmp_path):
    spawn_ranks(_on_rank, (1, free_port(), str(tmp_path)), 1)
    result = torch.load(tmp_path / "r.pt", weights_only=False)
    assert result["made"] == [True, True], result
    assert result["alive"] == [], result
