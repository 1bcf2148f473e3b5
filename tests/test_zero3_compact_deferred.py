"""Compact moments' deferred writes (engine/deferred_commits.py) on DeepSpeed ZeRO-3: while a
sub group's validated update waits for the next step's pass, that step's gradient partitions
land in a gradient slot. DeepSpeed's gradient readers between backward and step() must see
them there (or where the fused pass copies them), a gradient written there must be the one
stepped, and everything must equal DeepSpeed's plain CPU offload stepping the same partitions
with the plain-PyTorch compact update (tests/test_zero3_compact.py's reference), bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch
import zero3_branchy as branchy
from ranks import spawn_ranks
from test_zero3_compact import STATE_KEYS, FlatCompactAdamW, _resume_on_rank, _state
from zero3_reference import Zero3Case, batch, free_port, init_rank, make_engine

from hf_superoffload.ops.compact_state import CompactAdamW

WRITE_AT = (2, 3)  # (step, param index): that param's full gradient is halved before step()


def _train(engine, case: Zero3Case, rank: int) -> list[torch.Tensor]:
    """``case``'s steps, reading every param's full gradient before each step() and writing
    one (``WRITE_AT``); returns the gradients read."""
    from deepspeed import utils

    reads = []
    for step in range(case.steps):
        for micro in range(case.accumulation):
            ids = batch(case, step, micro, rank, engine.device)
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            if micro < case.accumulation - 1:
                engine.step()  # DeepSpeed's engine: not at the boundary, only counts
        for index, param in enumerate(engine.module.parameters()):
            grad = utils.safe_get_full_grad(param).clone()
            reads.append(grad)
            if (step, index) == WRITE_AT:
                utils.safe_set_full_grad(param, grad * 0.5)
        engine.step()
    return reads


def _on_rank(rank, world, port, case, out_dir, train=_train) -> None:
    """The reference and ours, each trained by ``train`` (which returns the gradients read)."""
    os.environ["HF_SUPEROFFLOAD_MOMENTS"] = "compact"
    init_rank(rank, world, port)
    torch.set_num_threads(1)
    import hf_superoffload  # noqa: F401  (activates the ZeRO-3 path)

    results = {}
    for name, super_offload in (("reference", False), ("superoffload", True)):
        base = torch.optim.AdamW if super_offload else FlatCompactAdamW
        engine, optimizer = make_engine(case, super_offload, world, optimizer_class=base)
        if not super_offload:
            optimizer.optimizer.set_layout(optimizer, world, rank)
        record = {"reads": train(engine, case, rank), "state": _state(optimizer)}
        if super_offload:
            record["stats"] = optimizer.stats
        results[name] = record
        engine.destroy()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("accumulation", [1, 2])
def test_gradients_read_and_written_while_an_update_is_deferred(accumulation, tmp_path):
    """No clipping (every step validates its speculation, so every step but the first has a
    deferred update to write): the full gradients read before each step() are this step's,
    a gradient written is the one stepped, and the state equals the reference's."""
    case = Zero3Case(max_grad_norm=0.0, steps=4, accumulation=accumulation)
    spawn_ranks(_on_rank, (1, free_port(), case, str(tmp_path)), 1)
    _assert_as_the_reference(tmp_path)


def _assert_as_the_reference(out_dir, written_early: bool = False) -> None:
    """Every gradient read and the final state of ours equal the reference's, bit for bit;
    the pending updates were written by the next step's pass (fused), or with
    ``written_early`` each by its early write, none fused."""
    result = torch.load(out_dir / "rank0.pt", weights_only=False)
    ref, ours = result["reference"], result["superoffload"]
    for i, (a, b) in enumerate(zip(ours["reads"], ref["reads"], strict=True)):
        assert torch.equal(a, b), f"gradient read {i}"
    for a, b in zip(ours["state"], ref["state"], strict=True):
        for key in ("master", *STATE_KEYS):
            assert torch.equal(a[key], b[key]), f"param {a['param']} {key}"
    stats = ours["stats"]
    if written_early:
        assert stats["commits_fused"] == 0 and stats["commit_seconds"] > 0
    else:
        assert stats["commits_fused"] > 0


def _assert_resumed_as_straight(out_dir) -> None:
    """The resumed run's losses and state (and zero_to_fp32's masters) equal the straight
    run's, bit for bit (test_zero3_compact._resume_on_rank's output)."""
    result = torch.load(out_dir / "rank0.pt", weights_only=False)
    straight, resumed = result["straight"], result["resumed"]
    assert resumed["losses"] == straight["losses"]
    for a, b in zip(resumed["state"], straight["state"], strict=True):
        for key in ("master", *STATE_KEYS):
            assert torch.equal(a[key], b[key]), f"param {a['param']} {key}"
    for name, master in result["masters"].items():
        assert torch.equal(result["fp32"][name], master), f"zero_to_fp32 differs at {name}"


def _read_after_step(engine, case: Zero3Case, rank: int) -> list[torch.Tensor]:
    """``case``'s steps (no accumulation), reading every param's full gradient right after
    each step() and nothing before it."""
    from deepspeed import utils

    reads = []
    for step in range(case.steps):
        ids = batch(case, step, 0, rank, engine.device)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
        reads += [utils.safe_get_full_grad(p).clone() for p in engine.module.parameters()]
    return reads


def _slow_fused_on_rank(rank, world, port, case, out_dir) -> None:
    """``_read_after_step`` with the fused pass, which copies the gradients out of their
    slot, slowed down."""
    import time

    from hf_superoffload.engine.compact_passes import CompactPasses

    fused = CompactPasses.fused

    def slow_fused(self, *args, **kwargs):
        time.sleep(0.2)  # the copy into the gradient buffer is still to come
        fused(self, *args, **kwargs)

    CompactPasses.fused = slow_fused
    _on_rank(rank, world, port, case, out_dir, _read_after_step)


def test_gradients_read_right_after_step_while_the_fused_pass_copies_them(tmp_path):
    """No clipping: each step's gradients land in a gradient slot and the next speculative
    pass copies them into the gradient buffer. A read right after step(), while that (slowed)
    pass may still be copying, sees the whole of this step's gradients, as DeepSpeed's plain
    offload shows them; the state equals the reference's. No persistent params: step() then
    returns before the last sub groups' passes are done (it gathers none)."""
    case = Zero3Case(max_grad_norm=0.0, steps=4, persistence_threshold=0)
    spawn_ranks(_slow_fused_on_rank, (1, free_port(), case, str(tmp_path)), 1)
    _assert_as_the_reference(tmp_path)


# The branch runs in some steps only: a sub group holding it launches at step() then, its
# deferred update written in a pass of its own, its gradient slot zeroed where the branch's
# gradients would be; the steps around it fuse.
BRANCH_SCHEDULE = [[True], [True], [False], [True], [True], [False], [False], [True]]


def _branchy_on_rank(rank, world, port, out_dir) -> None:
    os.environ["HF_SUPEROFFLOAD_MOMENTS"] = "compact"
    init_rank(rank, world, port)
    torch.set_num_threads(1)
    import hf_superoffload  # noqa: F401

    engine, optimizer = branchy.make_engine(branchy.branchy_case(max_grad_norm=0.0), True, world)
    for slot in optimizer._grad_slots.buffers:  # torch.empty: what another sub group left
        slot.fill_(7.0)
    branchy.train_engine(engine, BRANCH_SCHEDULE, rank)
    optimizer.synchronize()
    padding = []  # the padding of the last rank's partitions: master and both moments
    for part in optimizer._host_parts:
        for index, param in enumerate(optimizer.fp16_groups[part.index]):
            _, offset, numel = optimizer.grad_position[optimizer.get_param_id(param)]
            real = optimizer._real_numel(param)
            moments = part.compact.decoded(index)
            padding += [t[real:numel] for t in (part.master[offset : offset + numel], *moments)]
    record = {"state": branchy.full_state(engine), "padding": padding, "stats": optimizer.stats}
    engine.destroy()
    torch.save(record, os.path.join(out_dir, f"rank{rank}.pt"))


def _branchy_reference() -> dict:
    """The plain-PyTorch compact update over the whole model in one process (one rank: its
    partition of every param is the param, salted as the engine salts it)."""
    model = branchy.build()
    case = branchy.branchy_case()
    optimizer = CompactAdamW(
        model.parameters(), lr=case.lr, eps=case.eps, weight_decay=case.weight_decay
    )
    for step, micros in enumerate(BRANCH_SCHEDULE):
        for micro, use_branch in enumerate(micros):
            (model(branchy.batch(step, micro, 0), use_branch) / len(micros)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    out = {}
    for name, p in model.named_parameters():
        exp_avg, exp_avg_sq = optimizer.state[p]["moments"].decoded()
        out[name] = {"master": p.detach().clone(), "exp_avg": exp_avg.view_as(p),
                     "exp_avg_sq": exp_avg_sq.view_as(p)}  # fmt: skip
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_a_param_without_gradients_after_a_deferred_update(world, tmp_path):
    """One rank: every tensor equals the plain-PyTorch compact update's, bit for bit. Two
    ranks: the padding that ends a partition stays zero (gradient slots are zeroed there)."""
    spawn_ranks(_branchy_on_rank, (world, free_port(), str(tmp_path)), world)
    for rank in range(world):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert result["stats"]["commits_fused"] > 0
        for i, values in enumerate(result["padding"]):
            assert not values.any(), f"rank {rank} padding {i}: {values}"
        if world == 2:
            assert rank == 0 or any(v.numel() for v in result["padding"])  # the odd param
            continue
        for name, want in _branchy_reference().items():
            for key, value in want.items():
                assert torch.equal(result["state"][name][key], value), f"{name} {key}"


def test_a_checkpoint_saved_while_an_update_is_deferred_resumes_bit_exactly(tmp_path):
    """No clipping: the checkpoint is saved right after a step whose update the next step's
    pass would write; the save writes it first, and the resumed run equals the straight one
    (tests/test_zero3_compact.py's resume, where clipping leaves nothing deferred)."""
    case = Zero3Case(max_grad_norm=0.0, steps=4)
    spawn_ranks(_resume_on_rank, (1, free_port(), case, str(tmp_path)), 1)
    _assert_resumed_as_straight(tmp_path)


def _early_on_rank(rank, world, port, case, out_dir) -> None:
    """``_train`` with every pending update written right after validation (as with a GPU),
    each write slowed so that the next backward's partitions arrive while some are queued."""
    from test_compact_deferred import _commit_early

    _commit_early(pytest.MonkeyPatch(), 0.1)
    _on_rank(rank, world, port, case, out_dir)


def test_gradients_read_and_written_while_updates_are_written_early(tmp_path):
    """No clipping, the pending updates written right after validation: the gradients read
    before each step() are this step's (in a slot while the sub group's write is queued, in
    its buffer once it is done), a gradient written is the one stepped, the state equals the
    reference's, and every update was written by its early write, none fused."""
    case = Zero3Case(max_grad_norm=0.0, steps=4)
    spawn_ranks(_early_on_rank, (1, free_port(), case, str(tmp_path)), 1)
    _assert_as_the_reference(tmp_path, written_early=True)
