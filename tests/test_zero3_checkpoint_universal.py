"""A change of world size through DeepSpeed's universal checkpoint keeps each param group's own
hyperparameters on the ZeRO-3 path (DeepSpeed's loader gives every group those of group 0, so
the Trainer's no-decay group would get weight decay).

Saved by ours on two ranks, converted with ``ds_to_universal``, resumed on one: every group's
lr, weight_decay, betas and eps are the saved ones, every param's fp32 master and both moments
equal the saved ones, and the next step equals DeepSpeed's plain ZeRO-Offload resumed from the
same checkpoint with its groups (and step counts) set right by hand.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from ranks import spawn_ranks
from zero3_reference import (
    TOLERANCES,
    Zero3Case,
    _param_groups,
    assert_states_close,
    build_model,
    ds_config,
    free_port,
    init_rank,
    optimizer_state,
    train,
)

HYPERPARAMETERS = ("lr", "weight_decay", "betas", "eps")
STATES = ("fp32", "exp_avg", "exp_avg_sq")


def _engine(case: Zero3Case, super_offload: bool, world: int, universal: bool, seed: int = 0):
    import deepspeed

    model = build_model(seed)
    config = ds_config(case, super_offload, world)
    if universal:
        config["checkpoint"] = {"load_universal": True}
    optimizer = torch.optim.AdamW(_param_groups(model, case), lr=case.lr, eps=case.eps)
    engine, *_ = deepspeed.initialize(model=model, config=config, optimizer=optimizer)
    return engine


def _full_states(engine) -> dict[str, dict[str, torch.Tensor]]:
    """Every param's whole fp32 master and moments, by name (gathered over the ranks)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    return {
        name: {
            "fp32": safe_get_full_fp32_param(p).clone(),
            "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").clone(),
            "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").clone(),
        }
        for name, p in engine.module.named_parameters()
    }


def _groups(engine) -> list[dict]:
    return [{k: g[k] for k in HYPERPARAMETERS} for g in engine.optimizer.optimizer.param_groups]


def _save_on_rank(rank, world, port, case, out_dir) -> None:
    init_rank(rank, world, port)
    torch.set_num_threads(1)
    import hf_superoffload  # noqa: F401

    engine = _engine(case, True, world, universal=False)
    train(engine, case, rank, range(case.steps))
    engine.save_checkpoint(os.path.join(out_dir, "checkpoint"), tag="saved")
    record = {"kind": type(engine.optimizer).__name__, "groups": _groups(engine)}
    record["states"] = _full_states(engine)
    engine.destroy()
    if rank == 0:
        torch.save(record, os.path.join(out_dir, "saved.pt"))


def _resume_on_rank(rank, world, port, case, out_dir) -> None:
    init_rank(rank, world, port)
    torch.set_num_threads(1)
    import hf_superoffload  # noqa: F401

    results = {}
    for name, super_offload in (("ours", True), ("reference", False)):
        engine = _engine(case, super_offload, world, universal=True, seed=1)
        engine.load_checkpoint(os.path.join(out_dir, "checkpoint"), tag="universal")
        record = {"kind": type(engine.optimizer).__name__, "groups": _groups(engine)}
        record["states"] = _full_states(engine)
        if not super_offload:
            # DeepSpeed's loader gave every group group 0's hyperparameters, and every sub group
            # one shared step tensor (torch's AdamW then adds 1 to it per sub group): set both right.
            saved = torch.load(os.path.join(out_dir, "saved.pt"), weights_only=False)
            base = engine.optimizer.optimizer
            for group, want in zip(base.param_groups, saved["groups"], strict=True):
                group.update(want)
            for state in base.state.values():
                state["step"] = state["step"].clone()
        train(engine, case, rank, range(case.steps, case.steps + 1))
        record["after_step"] = optimizer_state(engine)
        results[name] = record
        engine.destroy()
    torch.save(results, os.path.join(out_dir, "resumed.pt"))


@pytest.mark.slow  # about 90 s on 2 cores: two ranks, the conversion, one rank
def test_universal_checkpoint_keeps_each_param_groups_hyperparameters_across_world_sizes(tmp_path):
    case = Zero3Case(steps=3, max_grad_norm=1.0, two_groups=True)
    spawn_ranks(_save_on_rank, (2, free_port(), case, str(tmp_path)), 2)
    subprocess.run(
        [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
         "--input_folder", str(tmp_path / "checkpoint" / "saved"),
         "--output_folder", str(tmp_path / "checkpoint" / "universal"),
         "--num_extract_workers", "1", "--num_merge_workers", "1"],
        check=True, capture_output=True, timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )  # fmt: skip
    spawn_ranks(_resume_on_rank, (1, free_port(), case, str(tmp_path)), 1)
    saved = torch.load(tmp_path / "saved.pt", weights_only=False)
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=False)
    ours, reference = resumed["ours"], resumed["reference"]
    assert saved["kind"] == ours["kind"] == "SuperOffloadZero3Optimizer"
    assert reference["kind"] == "DeepSpeedZeroOptimizer_Stage3"
    assert [g["weight_decay"] for g in saved["groups"]] == [case.weight_decay, 0.0]
    assert ours["groups"] == saved["groups"]
    assert ours["states"].keys() == saved["states"].keys()
    for name, states in saved["states"].items():
        for key in STATES:
            assert torch.equal(ours["states"][name][key], states[key]), f"{name}: {key}"
    assert_states_close(ours["after_step"], reference["after_step"], TOLERANCES, "one step on")
