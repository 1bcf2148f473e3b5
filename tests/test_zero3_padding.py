"""The padding that ends the last rank's partition of a param (ZeRO-3 pads every param to a
multiple of the ranks) stays zero in SuperOffload's fp32 masters and Adam moments, so two
identical runs save identical optimizer states. It used to be stepped from uninitialized
gradient memory: values such as 9e19 in exp_avg, different in every run."""

from __future__ import annotations

import os

import pytest
import torch
import zero3_branchy as branchy
from ranks import spawn_ranks
from zero3_reference import free_port, init_rank

SCHEDULE = [[True], [False], [True]]


def _padding(engine) -> dict:
    """Per sub group: the padding elements of its fp32 master and both moments as the
    optimizer's state_dict (what a checkpoint saves) holds them."""
    zero = engine.optimizer
    saved = zero.state_dict()
    masters = saved["fp32_flat_groups"]
    states = saved["optimizer_state_dict"]["state"]
    out = {}
    for i, group in enumerate(zero.fp16_groups):
        spots = []
        for param in group:
            _, offset, numel = zero.grad_position[zero.get_param_id(param)]
            rank = zero._get_param_partition_rank(param)
            real = max(0, min(numel, param.ds_numel - rank * numel))
            spots += range(offset + real, offset + numel)
        if spots:
            index = torch.tensor(spots)
            out[i] = {
                "master": masters[i][index].clone(),
                "exp_avg": states[i]["exp_avg"][index].clone(),
                "exp_avg_sq": states[i]["exp_avg_sq"][index].clone(),
            }
    return out


def _on_rank(rank, world, port, out_dir) -> None:
    init_rank(rank, world, port)
    torch.set_num_threads(1)
    import hf_superoffload  # noqa: F401

    case = branchy.branchy_case(max_grad_norm=0.5)
    runs = []
    for _ in range(2):
        engine, _ = branchy.make_engine(case, True, world)
        branchy.train_engine(engine, SCHEDULE, rank)
        runs.append(_padding(engine))
        engine.destroy()
    torch.save(runs, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
def test_partition_padding_stays_zero_and_checkpoints_are_deterministic(tmp_path):
    world = 2
    spawn_ranks(_on_rank, (world, free_port(), str(tmp_path)), world)
    last = torch.load(tmp_path / f"rank{world - 1}.pt", weights_only=False)
    assert last[0], "want padding in the last rank's partitions (the 7-element param)"
    for rank in range(world):
        first, second = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert first.keys() == second.keys()
        for i, values in first.items():
            for key, value in values.items():
                assert torch.equal(value, second[i][key]), (rank, i, key)
                assert not value.any(), f"rank {rank} sub group {i} {key} padding: {value}"
