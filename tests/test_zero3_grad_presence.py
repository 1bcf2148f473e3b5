"""SuperOffload on ZeRO-3 when a param gets gradients in only some micro-batches of a window, or in
none: it follows torch (AdamW + clip_grad_norm_ on the window's summed gradient, a param without
a gradient skipped), on one and two ranks, with its sub groups on the host and on the device.

DeepSpeed's plain CPU offload is not the reference here: it steps a param whose last gradient
of the window came before the last micro-batch from its gradient buffer's previous contents
(that window's gradient is lost), and a param without a gradient from whatever that buffer last
held (docs/engine.md, "ZeRO-3: params without a gradient").
"""

from __future__ import annotations

import os

import pytest
import torch
import zero3_branchy as branchy
from ranks import spawn_ranks
from zero3_reference import TOLERANCES, free_port, init_rank

T, F = True, False
SCENARIOS = {
    # The branch runs in the first micro-batch of a window but not the last, then in the last
    # only (its accumulation slot still holds the earlier window's sum), then in both.
    "partial_windows": (
        branchy.branchy_case(accumulation=2, max_grad_norm=0.5),
        [[T, T], [T, F], [F, T], [T, T]],
    ),
    # Whole steps without the branch: skipped, its step count stays behind the others'.
    "absent_steps": (branchy.branchy_case(max_grad_norm=0.5), [[T], [F], [F], [T], [T]]),
    # The same with the first half of the sub groups stepped on the device.
    "absent_steps_device": (
        branchy.branchy_case(max_grad_norm=0.5, ratio=0.5),
        [[T], [F], [F], [T], [T]],
    ),
}


def _on_rank(rank, world, port, out_dir) -> None:
    init_rank(rank, world, port)
    torch.set_num_threads(1)
    import hf_superoffload  # noqa: F401  (activates the ZeRO-3 path)

    results = {}
    for name, (case, schedule) in SCENARIOS.items():
        engine, optimizer = branchy.make_engine(case, True, world)
        losses = branchy.train_engine(engine, schedule, rank)
        zero = engine.optimizer
        zero.synchronize()
        branch = engine.module.branch.weight
        sub_group = zero.grad_position[zero.get_param_id(branch)][0]
        state = zero.optimizer.state[zero.fp32_partitioned_groups_flat[sub_group]]
        results[name] = {
            "kind": type(optimizer).__name__,
            "losses": losses,
            "state": branchy.full_state(engine),
            "branch_sub_group_state": {k: v for k, v in state.items() if "step" in k},
            "device_sub_groups": zero.stats["gpu_tail_buckets"],
        }
        engine.destroy()
    # "absent_steps" again, saved after its third step (the branch then at 1 step, the rest of
    # its sub group at 3) and resumed by a new engine.
    case, schedule = SCENARIOS["absent_steps"]
    engine, _ = branchy.make_engine(case, True, world)
    branchy.train_engine(engine, schedule[:3], rank)
    engine.save_checkpoint(os.path.join(out_dir, "checkpoint"), tag="step3")
    engine.destroy()
    engine, _ = branchy.make_engine(case, True, world)
    engine.load_checkpoint(os.path.join(out_dir, "checkpoint"), tag="step3")
    branchy.train_engine(engine, schedule[3:], rank, first_step=3)
    results["absent_steps_resumed"] = {"state": branchy.full_state(engine)}
    engine.destroy()
    if rank == 0:
        results["torch"] = {
            name: branchy.train_torch(case, schedule, world)
            for name, (case, schedule) in SCENARIOS.items()
        }
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(
    scope="module", params=[1, pytest.param(2, marks=pytest.mark.slow)], ids=["world1", "world2"]
)
def runs(request, tmp_path_factory):
    world, out = request.param, tmp_path_factory.mktemp(f"presence{request.param}")
    spawn_ranks(_on_rank, (world, free_port(), str(out)), world)
    return world, torch.load(out / "rank0.pt", weights_only=False)


def _assert_follows_torch(got: dict, want: dict, scenario: str) -> None:
    for name, ref in want.items():
        for key in ("master", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                got[name][key], ref[key].view_as(got[name][key]), **TOLERANCES[key],
                msg=lambda m, n=name, k=key: f"{scenario}: {n} {k}: {m}",
            )  # fmt: skip


def test_gradients_from_early_micro_batches_of_a_window_are_stepped(runs):
    _, results = runs
    got = results["partial_windows"]
    assert got["kind"] == "SuperOffloadZero3Optimizer"
    _assert_follows_torch(got["state"], results["torch"]["partial_windows"], "partial_windows")


@pytest.mark.parametrize("scenario", ["absent_steps", "absent_steps_device"])
def test_params_without_a_gradient_in_a_step_are_skipped_as_torch_skips_them(runs, scenario):
    _, results = runs
    got, want = results[scenario], results["torch"][scenario]
    _assert_follows_torch(got["state"], want, scenario)
    # Torch's per-param step counts: the branch's is 3 of 5, the sub group's (the largest) 5.
    assert want["branch.weight"]["step"] == 3 and want["body.weight"]["step"] == 5
    steps = got["branch_sub_group_state"]
    assert int(steps["step"]) == 5
    assert 3 in steps["param_steps"].tolist(), steps
    if scenario == "absent_steps_device":
        assert got["device_sub_groups"] > 0


def test_a_resume_carries_each_params_own_step_count(runs):
    _, results = runs
    want = results["torch"]["absent_steps"]
    _assert_follows_torch(results["absent_steps_resumed"]["state"], want, "absent_steps_resumed")
