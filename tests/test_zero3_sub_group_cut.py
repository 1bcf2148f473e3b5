"""The memory plan, the host check and the ZeRO-3 optimizer cut a rank's partition into the same
sub groups and keep the same ones on the device (``zero3/sub_group_cut.py``): ``ratio`` is a
share of the sub groups, as in DeepSpeed, and a model's first param (the embedding) larger than
``sub_group_size`` is a sub group alone, so the first sub groups hold more than their share of
the elements. The plan, made from the model's config on the meta device, must count the bytes
the optimizer allocates: on the device (fp32 master, both moments and fp32 gradients of the
device sub groups) and on the host, on 1 and 2 CPU ranks (DeepSpeed's CPU accelerator, gloo).
"""

from __future__ import annotations

import os

import pytest
import torch
from ranks import spawn_ranks
from zero3_reference import (
    SEQ,
    Zero3Case,
    build_model,
    free_port,
    init_rank,
    llama_config,
    make_engine,
)

from hf_superoffload.zero3.memory_plan import Zero3Run, zero3_memory_plan

SUB_GROUP_SIZE = 1500  # the embedding (256 x 32 = 8192 elements, 4096 a rank on 2) is larger
PERSISTENCE = 100  # the norms (32 elements) persist: sub groups of their own
RATIOS = (0.7, 0.4)
TRAINING_PARTS = (
    "master", "moments", "gradients", "param_copy_out", "accumulation", "grad_slots"
)  # fmt: skip


# The output layer is the embedding (tied): no large last param.
MODEL = {"vocab_size": 256, "max_position_embeddings": SEQ, "tie_word_embeddings": True}


def _config():
    return llama_config(**MODEL)


def _build(seed: int):
    return build_model(seed, **MODEL)


def _case(ratio: float, accumulation: int) -> Zero3Case:
    return Zero3Case(
        bf16=True, ratio=ratio, accumulation=accumulation, sub_group_size=SUB_GROUP_SIZE,
        persistence_threshold=PERSISTENCE,
    )  # fmt: skip


def _build_on_rank(rank, world, port, accumulation, out_dir) -> None:
    init_rank(rank, world, port)
    torch.set_num_threads(1)
    import hf_superoffload  # noqa: F401  (activates the ZeRO-3 path)
    from hf_superoffload.zero3 import host_check

    checked = []
    check = host_check.check_host_memory

    def recording(parts, remedies):
        checked.append(dict(parts))
        return check(parts, remedies)

    host_check.check_host_memory = recording
    results = {}
    for ratio in RATIOS:
        engine, optimizer = make_engine(
            _case(ratio, accumulation), True, world, model_builder=_build
        )
        device = [
            t for part in optimizer._device_parts
            for t in (part.master, part.exp_avg, part.exp_avg_sq, part.grad)
        ]  # fmt: skip
        results[ratio] = {
            "sub_groups": [m.numel() for m in optimizer.fp32_partitioned_groups_flat],
            "device_bytes": sum(t.numel() * t.element_size() for t in device),
            "device_sub_groups": len(optimizer._device_parts),
            "host_bytes": optimizer.host_bytes(),
            "checked": checked[-1],
        }
        engine.destroy()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
@pytest.mark.parametrize(("world", "accumulation"), [(1, 1), (2, 2)])
def test_plan_and_host_check_count_the_optimizers_own_sub_groups(world, accumulation, tmp_path):
    spawn_ranks(_build_on_rank, (world, free_port(), accumulation, str(tmp_path)), world)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for ratio in RATIOS:
        run = Zero3Run(
            seq=SEQ, batch=2, ranks=world, ratio=ratio, sub_group_size=SUB_GROUP_SIZE,
            persistence_threshold=PERSISTENCE, gradient_accumulation=accumulation,
        )  # fmt: skip
        plan = zero3_memory_plan(_config(), run)
        for rank, results in enumerate(ranks):
            built = results[ratio]
            where = f"ratio {ratio}, rank {rank} of {world}"
            # The device's optimizer state: whole sub groups, the embedding's first.
            assert plan.gpu["optimizer_on_gpu"] == built["device_bytes"] > 0, where
            for key in TRAINING_PARTS:
                assert plan.host[key] == built["host_bytes"][key], f"{where}: {key}"
                assert built["checked"][key] == built["host_bytes"][key], f"{where}: check {key}"
            assert list(plan.split.numels) == built["sub_groups"], where
            assert plan.split.device_count == built["device_sub_groups"], where
    # The embedding alone is the first sub group, so the share of elements on the device is
    # well above the share of sub groups (what the plan used to count).
    built = ranks[0][RATIOS[0]]
    device_share = built["device_bytes"] / 16 / sum(built["sub_groups"])
    assert device_share > 1.3 * (1 - RATIOS[0]), device_share
