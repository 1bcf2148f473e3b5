"""ZeRO-3 with gradient_accumulation_steps 1 leaves DeepSpeed's host accumulation buffer out at
start-up; a boundary set by hand (``engine.set_gradient_accumulation_boundary(False)``) makes it
after all. The host check counts it before it is made: refused, with a message naming
gradient_accumulation_steps and nothing changed, where it does not fit; granted, its figure is
the buffer's bytes and the window trains as DeepSpeed's plain CPU offload does."""

from __future__ import annotations

import os

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

MICRO_BATCHES = 3
GiB = 2**30


def _window(engine, case: Zero3Case, rank: int) -> None:
    for micro in range(MICRO_BATCHES):
        ids = batch(case, 0, micro, rank, engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.set_gradient_accumulation_boundary(micro == MICRO_BATCHES - 1)
        engine.backward(loss)
    engine.step()


def _on_rank(rank, world, port, out_dir) -> None:
    from hf_superoffload.engine import host_memory

    os.environ[host_memory.HOST_MEMORY_ENV] = "1000"
    init_rank(rank, world, port)
    torch.set_num_threads(1)
    import hf_superoffload  # noqa: F401  (activates the ZeRO-3 path)

    case = Zero3Case(max_grad_norm=1.0, schedule=False, bf16=True)
    engine, optimizer = make_engine(case, True, world)
    held = sum(host_memory.held_host_parts().values())  # the start-up check's grant
    numel = optimizer._accumulation_buffer_numel()
    buffer = numel * optimizer.gradient_accumulation_dtype.itemsize
    before = optimizer_state(engine)
    out = {"buffer": buffer}
    os.environ[host_memory.HOST_MEMORY_ENV] = str((held + buffer - 1) / GiB)
    try:
        engine.set_gradient_accumulation_boundary(False)
    except host_memory.HostMemoryError as error:
        out["refused"] = str(error)
    out["refused_host_bytes"] = optimizer.host_bytes()["accumulation"]
    out["refused_held"] = host_memory.held_host_parts().get("accumulation", 0)
    out["unchanged"] = all(
        torch.equal(a, b)
        for key in ("master", "exp_avg", "exp_avg_sq")
        for a, b in zip(before[key], optimizer_state(engine)[key], strict=True)
    )
    os.environ[host_memory.HOST_MEMORY_ENV] = str((held + buffer) / GiB)
    _window(engine, case, rank)
    out["host_bytes"] = optimizer.host_bytes()["accumulation"]
    out["held"] = host_memory.held_host_parts().get("accumulation", 0)
    out["state"] = optimizer_state(engine)
    engine.destroy()
    reference, _ = make_engine(case, False, world)
    _window(reference, case, rank)
    out["reference"] = optimizer_state(reference)
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


def test_a_hand_set_boundary_is_refused_before_an_accumulation_buffer_that_does_not_fit(
    tmp_path,
):
    spawn_ranks(_on_rank, (1, free_port(), str(tmp_path)), 1)
    out = torch.load(tmp_path / "rank0.pt", weights_only=False)
    message = out["refused"]
    assert "refused set_gradient_accumulation_boundary(False)" in message
    assert "set gradient_accumulation_steps in the DeepSpeed config" in message
    assert "earlier host checks granted" in message and "Nothing was changed" in message
    assert out["refused_host_bytes"] == out["refused_held"] == 0 and out["unchanged"]
    # Granted: the figure checked is the buffer made, and the window trains as DeepSpeed's.
    assert out["host_bytes"] == out["held"] == out["buffer"] > 0
    assert out["state"]["step"] == [1]
    assert_states_close(out["state"], out["reference"], TOLERANCES, "hand-set boundary")
