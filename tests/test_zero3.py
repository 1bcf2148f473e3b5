"""SuperOffload on DeepSpeed ZeRO-3 (``"super_offload": true``) follows DeepSpeed ZeRO-3 with
plain CPU offload (the same config without the flag) tensor by tensor: every rank's fp32 master
partitions and both moments, with clipping on some, most or no steps, an injected NaN step,
gradient accumulation, two param groups, an LR schedule, one and two ranks, and save/resume.

Runs on CPU with DeepSpeed's CPU accelerator and gloo; each case spawns its ranks, and every rank
trains the reference and then ours in one process (DeepSpeed's start-up is the slow part).

Tolerances are the standalone engine's against torch (engine_reference: 1e-4 relative): with
torch's AdamW as the base optimizer (what the Trainer passes to DeepSpeed) the reference and our
kernel do the same arithmetic up to fp32 rounding, fed back through forward and backward, and a
replay adds a few ulp of the undone update (ops/adam.py states the bound). DeepSpeed's own CPU
Adam forms ``1 - beta2`` in fp32 (9.99987e-4 for 0.999), so its ``exp_avg_sq`` sits 1.3e-5
(relative) from ours after any step: inside the same bound.
"""

from __future__ import annotations

import os

import pytest
import torch
from ranks import spawn_ranks
from zero3_reference import (
    TOLERANCES,
    Zero3Case,
    assert_states_close,
    build_model,
    free_port,
    init_rank,
    make_engine,
    optimizer_state,
    train,
)

from hf_superoffload.zero3.memory_plan import Zero3Run, zero3_memory_plan


def _both_on_rank(rank, world, port, case, env, out_dir) -> None:
    os.environ.update(env)
    init_rank(rank, world, port)
    torch.set_num_threads(1)
    import hf_superoffload  # noqa: F401  (activates the ZeRO-3 path)

    results = {}
    for name, super_offload in (("reference", False), ("superoffload", True)):
        engine, optimizer = make_engine(case, super_offload, world)
        kind = type(optimizer).__name__
        norms_agree = _compare_norms_with_deepspeeds(optimizer) if super_offload else []
        waits_at_use = _count_gathers_waiting_at_use() if super_offload else [0]
        record = train(engine, case, rank, range(case.steps))
        record.update(state=optimizer_state(engine), kind=kind)
        if super_offload:
            record["stats"] = optimizer.stats
            record["host_bytes"] = optimizer.host_bytes()
            record["params"] = sum(p.ds_tensor.numel() for p in engine.module.parameters())
            record["norms_agree"] = norms_agree
            record["gathers_waiting_at_use"] = waits_at_use[0]
            record["world"] = world
        results[name] = record
        engine.destroy()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def _compare_norms_with_deepspeeds(optimizer) -> list[bool]:
    """Wrap zero3/norms.py's sub_group_norms where the optimizer's own _get_norm_groups calls it
    (the method stays the package's): record, each step, whether it computed the norms (in one
    all-reduce, not falling back to DeepSpeed's path) over DeepSpeed's own cut of the sub
    groups, and whether they equal the ones DeepSpeed's per sub group path computes to the bit."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    from hf_superoffload.zero3 import optimizer as zero3_optimizer

    agree, ours = [], zero3_optimizer.sub_group_norms

    def both(zero, groups):
        mine = ours(zero, groups)
        if mine is None:  # the package would fall back to DeepSpeed's path
            agree.append(False)
            return None
        cut = [
            [id(p) for p in sub_group]
            for group in zero.trainable_param_groups
            for sub_group in DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups(
                zero, group["params"]
            )
        ]
        theirs = [zero.complete_grad_norm_calculation_for_cpu_offload(g) for g in groups]
        agree.append(
            [[id(p) for p in g] for g in groups] == cut
            and torch.equal(torch.stack(mine), torch.stack([t.reshape(()) for t in theirs]))
        )
        return mine

    zero3_optimizer.sub_group_norms = both
    return agree


def _count_gathers_waiting_at_use() -> list[int]:
    """Count the gathers that take zero3/gather_waits.py's wait-at-use path (one rank per
    partition): DeepSpeed renaming what its guard reads would send them silently back to
    waiting at issue."""
    from hf_superoffload.zero3 import gather_waits

    count, waits_at_use = [0], gather_waits.WaitsAtUse

    def counted(*args, **kwargs):
        count[0] += 1
        return waits_at_use(*args, **kwargs)

    gather_waits.WaitsAtUse = counted
    return count


def _run(case: Zero3Case, world: int, tmp_path, env: dict | None = None) -> list[dict]:
    spawn_ranks(_both_on_rank, (world, free_port(), case, env or {}, str(tmp_path)), world)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _assert_follows(results: list[dict]) -> None:
    for rank, result in enumerate(results):
        ref, ours = result["reference"], result["superoffload"]
        assert ref["kind"] == "DeepSpeedZeroOptimizer_Stage3"
        assert ours["kind"] == "SuperOffloadZero3Optimizer"
        assert ours["norms_agree"] and all(ours["norms_agree"]), f"rank {rank}"
        if ours["world"] == 1:  # with one rank per partition every gather waits at use
            assert ours["gathers_waiting_at_use"] > 0, f"rank {rank}"
        assert_states_close(ours["state"], ref["state"], TOLERANCES, f"rank {rank}")
        torch.testing.assert_close(
            torch.tensor(ours["losses"]), torch.tensor(ref["losses"]), rtol=1e-4, atol=1e-6,
            equal_nan=True,
        )  # fmt: skip


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_follows_deepspeed_with_clipping_on_some_steps_nan_accumulation_groups_schedule(
    world, tmp_path
):
    # Thresholds inside each world's range of norms (two ranks average two batches: smaller).
    case = Zero3Case(max_grad_norm={1: 1.3, 2: 1.0}[world], accumulation=2, nan_step=3)
    results = _run(case, world, tmp_path)
    _assert_follows(results)
    ref, ours = results[0]["reference"], results[0]["superoffload"]
    clipped = [n > case.max_grad_norm for n in ref["norms"] if n == n and n != float("inf")]
    assert any(clipped) and not all(clipped), f"want clipping on some steps, norms {ref['norms']}"
    stats = ours["stats"]
    assert stats["rollbacks_nonfinite"] == 1 and stats["steps"] == case.steps
    assert stats["speculative_steps"] >= 1
    # The NaN step was skipped on every rank: one step fewer than steps taken.
    assert ours["state"]["step"] == [case.steps - 1]


@pytest.mark.slow
def test_follows_deepspeed_when_every_step_clips_and_speculation_replays(tmp_path):
    case = Zero3Case(max_grad_norm=1e-2, two_groups=False)
    results = _run(case, 1, tmp_path, env={"HF_SUPEROFFLOAD_SPECULATE_AFTER_CLIP": "1"})
    _assert_follows(results)
    stats = results[0]["superoffload"]["stats"]
    assert stats["speculative_steps"] == case.steps
    # Step 1 speculates with scale 1 and is withheld (its norm already clips): nothing to roll
    # back; later steps speculate with the last coefficient, run, and are replayed with their
    # own, each step counted once.
    assert stats["rollbacks_clip"] == case.steps - 1
    assert stats["speculations_applied"] > 0 and stats["replays"] > 0, stats


@pytest.mark.slow
def test_follows_deepspeed_without_clipping(tmp_path):
    case = Zero3Case(max_grad_norm=0.0, schedule=False)
    results = _run(case, 1, tmp_path)
    _assert_follows(results)
    ours = results[0]["superoffload"]
    stats = ours["stats"]
    assert stats["speculative_steps"] == case.steps and stats["rollbacks_clip"] == 0
    assert stats["speculations_applied"] > 0 and stats["speculations_withheld"] == 0, stats
    # Nothing accumulates: DeepSpeed's host accumulation buffer is gone; fp32 master, fp32
    # gradients and two moments remain (no bf16 copy-out in an fp32 model): 16 B/param.
    host = ours["host_bytes"]
    assert host["accumulation"] == 0 and host["param_copy_out"] == 0
    assert sum(host.values()) == 16 * ours["params"]


@pytest.mark.slow
def test_follows_deepspeed_in_bf16_at_14_bytes_per_param(tmp_path):
    case = Zero3Case(bf16=True, max_grad_norm=1.3, steps=4)
    results = _run(case, 1, tmp_path)
    _assert_follows(results)
    ours = results[0]["superoffload"]
    # Per param of the partition: fp32 master (4), bf16 gradients as DeepSpeed hands them over
    # (2: its fp32 gradient buffer is dropped), two fp32 moments (8); the rounded params go
    # back through three shared buffers of the largest sub group, not one per sub group.
    host, params = ours["host_bytes"], ours["params"]
    assert host["master"] == 4 * params and host["gradients"] == 2 * params
    assert host["moments"] == 8 * params and host["accumulation"] == 0
    assert 0 < host["param_copy_out"] <= 3 * 2 * case.sub_group_size
    # The memory plan counts the same bytes from the model's config alone.
    run = Zero3Run(seq=8, batch=case.micro_batch, sub_group_size=case.sub_group_size)
    plan = zero3_memory_plan(build_model().config, run)
    for key in ("master", "gradients", "moments", "accumulation"):
        assert plan.host[key] == host[key], key
    assert plan.host["param_copy_out"] >= host["param_copy_out"]


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_follows_deepspeed_with_half_the_sub_groups_stepped_on_the_device(world, tmp_path):
    # ratio 0.5: the first sub groups' state stays on the device (on CPU, the CPU: the same
    # code) and steps there after validation, with the LR schedule (DeepSpeed's own partial
    # offload froze the first group's lr), clipping on some steps, a NaN step, accumulation.
    case = Zero3Case(max_grad_norm={1: 1.3, 2: 1.0}[world], accumulation=2, nan_step=3, ratio=0.5)
    results = _run(case, world, tmp_path)
    _assert_follows(results)
    ref = results[0]["reference"]
    clipped = [n > case.max_grad_norm for n in ref["norms"] if n == n and n != float("inf")]
    assert any(clipped) and not all(clipped), f"want clipping on some steps, norms {ref['norms']}"
    for result in results:
        ours = result["superoffload"]
        stats, host = ours["stats"], ours["host_bytes"]
        assert 0 < stats["gpu_tail_buckets"] < stats["buckets"], stats
        assert 0 < stats["gpu_tail_params"] < ours["params"], stats
        # Host state only for the sub groups left there: master, gradients, two moments.
        assert host["master"] == 4 * (ours["params"] - stats["gpu_tail_params"]), host
        assert ours["state"]["step"] == [case.steps - 1]  # the NaN step skipped everywhere


@pytest.mark.slow
def test_follows_deepspeed_with_params_offloaded_too(tmp_path):
    case = Zero3Case(offload_param=True, max_grad_norm=1.3, steps=4)
    _assert_follows(_run(case, 1, tmp_path))


@pytest.mark.slow
def test_follows_deepspeed_cpu_adam_on_two_ranks(tmp_path):
    case = Zero3Case(deepspeed_adam=True, max_grad_norm=2.0)
    _assert_follows(_run(case, 2, tmp_path))


def _resume_on_rank(rank, world, port, case, out_dir) -> None:
    init_rank(rank, world, port)
    torch.set_num_threads(1)
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    import hf_superoffload  # noqa: F401

    half = case.steps // 2
    checkpoint = os.path.join(out_dir, "checkpoint")
    engine, optimizer = make_engine(case, True, world)
    train(engine, case, rank, range(half))
    engine.save_checkpoint(checkpoint, tag="half")
    masters = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    train(engine, case, rank, range(half, case.steps))
    straight = optimizer_state(engine)
    engine.destroy()

    # Other initial weights: everything must come from the checkpoint.
    engine, optimizer = make_engine(case, True, world, model_seed=1)
    engine.load_checkpoint(checkpoint, tag="half")
    assert type(optimizer).__name__ == "SuperOffloadZero3Optimizer"
    train(engine, case, rank, range(half, case.steps))
    resumed = optimizer_state(engine)
    engine.destroy()
    deepspeed.comm.barrier()
    consolidated = get_fp32_state_dict_from_zero_checkpoint(checkpoint, tag="half")
    torch.save(
        {"straight": straight, "resumed": resumed, "masters": masters, "fp32": consolidated},
        os.path.join(out_dir, f"rank{rank}.pt"),
    )


@pytest.mark.slow  # the default tier's ZeRO-3 resume: test_zero3_checkpoint_cross.py[1]
@pytest.mark.parametrize("ratio", [1.0, 0.5])
def test_save_then_resume_equals_an_uninterrupted_run_and_zero_to_fp32_reads_the_masters(
    ratio, tmp_path
):
    # ratio 0.5: the device sub groups' moments travel in DeepSpeed's checkpoint as well.
    case = Zero3Case(max_grad_norm=1.0, nan_step=1, ratio=ratio)
    world = 2
    spawn_ranks(_resume_on_rank, (world, free_port(), case, str(tmp_path)), world)
    for rank in range(world):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert_states_close(
            result["resumed"], result["straight"], TOLERANCES, f"rank {rank}", rare_outliers=False
        )
        assert result["fp32"].keys() == result["masters"].keys()
        for name, master in result["masters"].items():
            assert torch.equal(result["fp32"][name], master), f"zero_to_fp32 differs at {name}"


def test_state_comparison_allows_rare_small_outliers_only():
    """The comparison these tests use lets 1 element in 1000 exceed the tolerance, by at most
    ten times: Adam's amplification of an ulp, not a defect that moves most elements."""
    want = {"step": [3], "master": [torch.linspace(-1, 1, 4000)], "exp_avg": [None],
            "exp_avg_sq": [None]}  # fmt: skip
    tolerance = {"master": {"rtol": 1e-4, "atol": 1e-6}}

    def with_master(master):
        return {**want, "master": [master]}

    rare = want["master"][0].clone()
    rare[[100, 500, 3500, 3900]] += 2e-4  # 4 of 4000, each within 10x
    assert_states_close(with_master(rare), want, tolerance, "rare")
    many = want["master"][0].clone()
    many[:5] += 2e-4  # 5 of 4000
    with pytest.raises(AssertionError, match="5 of 4000 elements beyond"):
        assert_states_close(with_master(many), want, tolerance, "many")
    far = want["master"][0].clone()
    far[7] += 1e-2  # one element, far beyond 10x
    with pytest.raises(AssertionError, match="at 10x tolerance"):
        assert_states_close(with_master(far), want, tolerance, "far")
    shifted = want["master"][0] * (1 + 3e-4)  # a wrong coefficient: every element moves
    with pytest.raises(AssertionError, match="elements beyond"):
        assert_states_close(with_master(shifted), want, tolerance, "shifted")
    with pytest.raises(AssertionError, match="strict: master"):  # same code on both sides
        assert_states_close(with_master(rare), want, tolerance, "strict", rare_outliers=False)
