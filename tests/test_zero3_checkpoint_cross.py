"""A ZeRO-3 checkpoint crosses between DeepSpeed's plain ZeRO-Offload and SuperOffload, both ways:
params and both moments right after the resume equal those of the run that saved, tensor by
tensor, and training on continues as the uninterrupted run does.

The two cut a rank's partition into sub groups differently (hf_superoffload/zero3/
checkpoint_layout.py says how), so a sub group of one file is not a sub group of the other.
``HF_SUPEROFFLOAD_DEEPSPEED=0`` (DeepSpeed's own optimizer, the package imported) must resume a
run that ours saved, too.
"""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch
from ranks import spawn_ranks
from zero3_reference import (
    TOLERANCES,
    Zero3Case,
    assert_states_close,
    free_port,
    init_rank,
    make_engine,
    optimizer_state,
    train,
)

OURS, PLAIN = "SuperOffloadZero3Optimizer", "DeepSpeedZeroOptimizer_Stage3"
NAMES = {True: "ours", False: "plain"}


def _cross_on_rank(rank, world, port, case, env, directions, out_dir) -> None:
    os.environ.update(env)
    init_rank(rank, world, port)
    torch.set_num_threads(1)
    import deepspeed

    import hf_superoffload  # noqa: F401  (activates, or with the opt-out installs the reader)

    half = case.steps // 2
    results = {}
    for saver, loader in directions:
        checkpoint = os.path.join(out_dir, f"{saver}-{loader}")
        engine, _ = make_engine(case, saver, world)
        train(engine, case, rank, range(half))
        engine.save_checkpoint(checkpoint, tag="half")
        saved = optimizer_state(engine)
        train(engine, case, rank, range(half, case.steps))
        straight = optimizer_state(engine)
        saver_kind = type(engine.optimizer).__name__
        engine.destroy()

        engine, _ = make_engine(case, loader, world, model_seed=1)  # other initial weights
        engine.load_checkpoint(checkpoint, tag="half")
        at_resume = optimizer_state(engine)
        lrs = [g["lr"] for g in engine.optimizer.optimizer.param_groups]
        train(engine, case, rank, range(half, case.steps))
        record = {
            "kinds": (saver_kind, type(engine.optimizer).__name__),
            "saved": saved,
            "at_resume": at_resume,
            "straight": straight,
            "resumed": optimizer_state(engine),
            "lrs": lrs,
        }
        results[(saver, loader)] = record
        engine.destroy()
        deepspeed.comm.barrier()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def _run(case, world, tmp_path, directions, env=None) -> list[dict]:
    args = (world, free_port(), case, env or {}, directions, str(tmp_path))
    spawn_ranks(_cross_on_rank, args, world)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _assert_crossed(results: list[dict], kinds: dict) -> None:
    for rank, by_direction in enumerate(results):
        for direction, record in by_direction.items():
            what = f"rank {rank}, {NAMES[direction[0]]} -> {NAMES[direction[1]]}"
            assert record["kinds"] == kinds[direction], what
            saved, at_resume = record["saved"], record["at_resume"]
            assert at_resume["step"] == saved["step"], what
            for key in ("master", "exp_avg", "exp_avg_sq"):
                for i, (a, b) in enumerate(zip(at_resume[key], saved[key], strict=True)):
                    assert torch.equal(a, b), f"{what}: {key}[{i}] differs right after the resume"
            # The rest of the run on the other optimizer follows the uninterrupted one as ours
            # follows DeepSpeed's (tests/test_zero3.py).
            assert_states_close(record["resumed"], record["straight"], TOLERANCES, what)


BOTH_WAYS = ((False, True), (True, False))
KINDS = {(False, True): (PLAIN, OURS), (True, False): (OURS, PLAIN)}


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_checkpoints_cross_between_plain_zero_offload_and_superoffload_both_ways(world, tmp_path):
    # Two ranks: half of our sub groups on the device (ratio 0.5), whose state travels too.
    case = Zero3Case(max_grad_norm=1.0, ratio=1.0 if world == 1 else 0.5)
    _assert_crossed(_run(case, world, tmp_path, BOTH_WAYS), KINDS)


def test_the_opt_out_keeps_deepspeeds_optimizer_and_installs_the_reader_of_ours(monkeypatch):
    """With HF_SUPEROFFLOAD_DEEPSPEED=0 "super_offload" builds DeepSpeed's own optimizer (CUDA
    only, so not run here) and the reader that the test above shows resuming our checkpoints
    in DeepSpeed's optimizer is installed all the same. Shown on stand-ins for DeepSpeed's two
    modules, so that the real ones (patched by this session's activation) stay as they are."""
    from hf_superoffload.zero3 import activation

    class Stage3:
        def _rigid_load_state_dict(self, state_dict, load_optimizer_states=True):
            return "deepspeed's"

    class DeepSpeedsSuperOffload:
        pass

    stage3 = types.SimpleNamespace(DeepSpeedZeroOptimizer_Stage3=Stage3)
    superoffload = types.SimpleNamespace(SuperOffloadOptimizer_Stage3=DeepSpeedsSuperOffload)
    monkeypatch.setitem(sys.modules, activation.STAGE3_MODULE, stage3)
    monkeypatch.setitem(sys.modules, activation.TARGET_MODULE, superoffload)
    monkeypatch.setenv(activation.OPT_OUT_ENV, "0")
    activation.activate()
    assert superoffload.SuperOffloadOptimizer_Stage3 is DeepSpeedsSuperOffload
    assert Stage3._rigid_load_state_dict._hf_superoffload_recut
    assert Stage3()._rigid_load_state_dict({"no": "record"}) == "deepspeed's"  # theirs: as it was
