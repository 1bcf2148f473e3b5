"""The copy-out ring of the ZeRO-3 path (engine/copy_out.py: a few buffers the CPU Adam writes
the rounded params into before they go back to the model) exists only where params are cast on
the host. The memory plan, the start-up host check and the optimizer take that from one rule
(``host_parts.copy_out_ring_dtype``): for each cast, what the plan and the check count is the
bytes of the buffers the optimizer makes, and a plan made without the run's cast counts the
most any cast makes and says so.

On CPU (DeepSpeed's CPU accelerator, gloo) every cast is built end to end; cast "auto" casts on
the host there. On a GPU, "auto" casts the params on the device and no ring is made: the rule's
table checks that here, and the ``gpu`` test builds it.
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
    optimizer_state,
    train,
)

from hf_superoffload.engine.copy_out import COPY_OUT_PIECE, COPY_OUT_SLOTS, copy_out_bytes
from hf_superoffload.zero3.host_parts import copy_out_ring_dtype
from hf_superoffload.zero3.memory_plan import Zero3Run, zero3_memory_plan

BF16, FP32 = torch.bfloat16, torch.float32
CASTS = ("cpu", "gpu", "auto")
# As tests/test_zero3_sub_group_cut.py: the plan cuts this model into the optimizer's sub groups.
SUB_GROUP_SIZE, PERSISTENCE = 1500, 100
MODEL = {"vocab_size": 256, "max_position_embeddings": SEQ, "tie_word_embeddings": True}
CASE = Zero3Case(
    bf16=True, steps=2, sub_group_size=SUB_GROUP_SIZE, persistence_threshold=PERSISTENCE
)


@pytest.mark.parametrize(
    ("device", "dtype", "compact", "expected"),
    [
        # Casting on the host makes the ring; "auto" casts on the device where there is a GPU.
        ("cuda", BF16, False, {"cpu": BF16, "gpu": None, "auto": None, None: BF16}),
        ("cpu", BF16, False, {"cpu": BF16, "gpu": None, "auto": BF16, None: BF16}),
        # An fp32 model has nothing to round.
        ("cuda", FP32, False, {"cpu": None, "gpu": None, "auto": None, None: None}),
        # Compact moments always write their updates into the ring, in the model's dtype.
        ("cuda", BF16, True, {"cpu": BF16, "gpu": BF16, "auto": BF16, None: BF16}),
        ("cuda", FP32, True, {"cpu": FP32, "gpu": FP32, "auto": FP32, None: FP32}),
    ],
)
def test_the_ring_exists_where_params_are_cast_on_the_host(device, dtype, compact, expected):
    for cast, ring in expected.items():
        assert copy_out_ring_dtype(dtype, cast, device, compact) == ring, cast
    with pytest.raises(ValueError, match="cast must be"):
        copy_out_ring_dtype(dtype, "host", device, compact)


def _plan(**run):
    config = llama_config(**MODEL)
    return zero3_memory_plan(
        config, Zero3Run(
            seq=SEQ, batch=CASE.micro_batch, sub_group_size=SUB_GROUP_SIZE,
            persistence_threshold=PERSISTENCE, **run,
        ),
    )  # fmt: skip


def test_a_gpu_plan_counts_the_ring_only_for_a_cast_on_the_host():
    """On a GPU, cast "auto" (the default) and "gpu" make no ring; a plan without the cast
    counts the ring, 96 MiB a rank at most in bf16 (three 16M-element pieces), and says it is
    an upper bound."""
    from transformers import LlamaConfig

    config = LlamaConfig(  # sub groups larger than a piece: the ring at its most
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=2, vocab_size=32000,
        num_attention_heads=8,
    )  # fmt: skip
    plans = {
        cast: zero3_memory_plan(config, Zero3Run(seq=128, batch=1, cast=cast))
        for cast in (*CASTS, None)
    }
    most = COPY_OUT_SLOTS * COPY_OUT_PIECE * 2
    assert most == 96 * 2**20 and plans[None].split.largest_host_sub_group > COPY_OUT_PIECE
    ring = {cast: plan.host["param_copy_out"] for cast, plan in plans.items()}
    assert ring == {"cpu": most, "gpu": 0, "auto": 0, None: most}
    for cast in CASTS:  # the ring is all that differs
        rest = {k: v for k, v in plans[cast].host.items() if k != "param_copy_out"}
        assert rest == {k: v for k, v in plans[None].host.items() if k != "param_copy_out"}
        assert plans[cast].upper_bounds == {}
        assert "at most" not in plans[cast].table()
    (why,) = plans[None].upper_bounds.values()
    assert "none with cast 'auto' or 'gpu' on a GPU" in why
    (line,) = [row for row in plans[None].table().splitlines() if "param_copy_out" in row]
    assert "0.09 GiB (at most: " in line
    # An fp32 model has no ring whatever the cast: nothing is rounded.
    fp32 = zero3_memory_plan(config, Zero3Run(seq=128, batch=1, dtype_bytes=4))
    assert fp32.host["param_copy_out"] == 0 and fp32.upper_bounds == {}
    with pytest.raises(ValueError, match="dtype_bytes must be 2"):
        zero3_memory_plan(config, Zero3Run(seq=128, batch=1, dtype_bytes=1))


def _build(seed: int):
    return build_model(seed, **MODEL)


def _build_each_cast(rank, port, out_dir) -> None:
    init_rank(rank, 1, port)
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
    for cast in CASTS:
        os.environ["HF_SUPEROFFLOAD_CAST"] = cast
        engine, optimizer = make_engine(CASE, True, 1, model_builder=_build)
        ring = optimizer._copy_out
        # What the optimizer allocated: the storage behind each of the ring's buffers.
        buffers = [b.untyped_storage().nbytes() for b in ring.buffers] if ring else []
        results[cast] = {
            "ring_buffers": buffers,
            "host_bytes": optimizer.host_bytes(),
            "checked": checked[-1],
            "largest_host_sub_group": max(p.numel for p in optimizer._host_parts),
            "state": optimizer_state(engine) if cast == "auto" else None,
        }
        record = train(engine, CASE, rank, range(CASE.steps))
        results[cast]["losses"] = record["losses"]
        results[cast]["trained"] = optimizer_state(engine)
        engine.destroy()
    torch.save(results, os.path.join(out_dir, "rank0.pt"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="builds on DeepSpeed's CPU accelerator")
def test_plan_check_and_optimizer_count_the_same_ring_for_each_cast(tmp_path):
    spawn_ranks(_build_each_cast, (free_port(), str(tmp_path)), 1)
    built = torch.load(tmp_path / "rank0.pt", weights_only=False)
    upper = _plan(device_type="cpu")  # the cast not given
    bound = upper.host["param_copy_out"]
    for cast in CASTS:
        got = built[cast]
        allocated = sum(got["ring_buffers"])
        plan = _plan(cast=cast, device_type="cpu")
        assert plan.split.largest_host_sub_group == got["largest_host_sub_group"], cast
        assert plan.host["param_copy_out"] == allocated, cast
        assert got["checked"]["param_copy_out"] == allocated, cast
        assert got["host_bytes"]["param_copy_out"] == allocated, cast
        # Without the cast the plan counts the ring: exact, or one ring above.
        assert bound - allocated in (0, bound), cast
    # On CPU "auto" casts on the host, as "cpu" does: three pieces of the largest sub group.
    largest = built["cpu"]["largest_host_sub_group"]
    assert sum(built["cpu"]["ring_buffers"]) == COPY_OUT_SLOTS * 2 * largest > 0
    assert built["auto"]["ring_buffers"] == built["cpu"]["ring_buffers"]
    assert built["gpu"]["ring_buffers"] == [] and bound == copy_out_bytes(largest, BF16)
    # Where the rounding happens changes no bit: the kernel's round to nearest even and the
    # cast of the fp32 master give the same bf16 params, so the same masters and moments.
    for cast in ("cpu", "gpu"):
        assert built[cast]["losses"] == built["auto"]["losses"], cast
        for key in ("master", "exp_avg", "exp_avg_sq"):
            for a, b in zip(
                built[cast]["trained"][key], built["auto"]["trained"][key], strict=True
            ):
                assert torch.equal(a, b), f"{cast}: {key}"
    # And they trained: the masters moved.
    start, end = built["auto"]["state"]["master"], built["auto"]["trained"]["master"]
    assert any(not torch.equal(a, b) for a, b in zip(start, end, strict=True))
