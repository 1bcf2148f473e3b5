"""DeepSpeed's tensor-fragment API between backward and ``step()`` on SuperOffload's ZeRO-3 path
gives and takes what it gives and takes on DeepSpeed's plain CPU offload: full and local
gradients read and written (``safe_get/set_full_grad``, ``safe_get/set_local_grad``), fp32
params and Adam moments read (``safe_get_full_fp32_param``, ``safe_get_full_optimizer_state``)
and an fp32 param written (``safe_set_full_fp32_param``), on one and two ranks. A sub group
that was already stepped speculatively is undone first and steps from what was written.

Writes of full gradients run without clipping: DeepSpeed's ``set_fp32_grad_for_param`` keeps
the norm from backward, ours takes the written gradient's (docs/engine.md)."""

from __future__ import annotations

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

CASES = {
    "full": Zero3Case(max_grad_norm=0.0, steps=3),
    "local": Zero3Case(max_grad_norm=1.0, steps=3),
}


def _train(engine, case: Zero3Case, rank: int, api: str) -> dict:
    from deepspeed import utils

    reads = {"grad": [], "fp32": [], "exp_avg": []}
    for step in range(case.steps):
        ids = batch(case, step, 0, rank, engine.device)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        for index, param in enumerate(engine.module.parameters()):
            # Reads first (the speculated sub groups are undone for them), then writes.
            reads["fp32"].append(utils.safe_get_full_fp32_param(param).clone())
            if step > 0:  # torch's AdamW (the reference's base) makes its state in step 1
                exp_avg = utils.safe_get_full_optimizer_state(param, "exp_avg")
                reads["exp_avg"].append(exp_avg.clone())
            if api == "full":
                grad = utils.safe_get_full_grad(param).clone()
                reads["grad"].append(grad)
                if index % 2 == 0:
                    utils.safe_set_full_grad(param, grad * 0.5 + 1e-3)
                if index == 1:
                    utils.safe_set_full_fp32_param(param, reads["fp32"][-1] * 0.9)
            else:
                grad = utils.safe_get_local_grad(param).clone()
                reads["grad"].append(grad)
                if index % 2 == 1:
                    utils.safe_set_local_grad(param, grad * 3.0)
        engine.step()
    return reads


def _on_rank(rank, world, port, out_dir) -> None:
    init_rank(rank, world, port)
    torch.set_num_threads(1)
    import hf_superoffload  # noqa: F401

    results = {}
    for api, case in CASES.items():
        for name, super_offload in (("reference", False), ("superoffload", True)):
            engine, optimizer = make_engine(case, super_offload, world)
            reads = _train(engine, case, rank, api)
            record = {"reads": reads, "state": optimizer_state(engine)}
            record["kind"] = type(optimizer).__name__
            if super_offload:
                record["stats"] = optimizer.stats
            results[(api, name)] = record
            engine.destroy()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_gradient_and_state_accessors_act_as_on_deepspeeds_offload(world, tmp_path):
    spawn_ranks(_on_rank, (world, free_port(), str(tmp_path)), world)
    for rank in range(world):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for api in CASES:
            ref, ours = results[(api, "reference")], results[(api, "superoffload")]
            assert ours["kind"] == "SuperOffloadZero3Optimizer"
            what = f"{api} rank {rank}"
            for key, tolerance in (("grad", "exp_avg"), ("fp32", "master"), ("exp_avg", "exp_avg")):
                for i, (a, b) in enumerate(zip(ours["reads"][key], ref["reads"][key], strict=True)):
                    torch.testing.assert_close(
                        a.float(), b.float(), **TOLERANCES[tolerance],
                        msg=lambda m, k=key, j=i, w=what: f"{w}: read {k}[{j}]: {m}",
                    )  # fmt: skip
            assert_states_close(ours["state"], ref["state"], TOLERANCES, what)
        # Speculations were undone for the accessors (one rank's count suffices).
        assert results[("full", "superoffload")]["stats"]["rollbacks_accumulation"] > 0
