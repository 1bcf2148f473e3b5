"""The copy-out ring: buffers are handed out in turn, each only after the copy that last read
it, and misuse says what went wrong."""

from __future__ import annotations

import pytest
import torch

from hf_superoffload.engine.copy_out import CopyOutRing
from hf_superoffload.engine.link import Link


class _Copy:
    """A stand-in for a CUDA event: records whether the ring waited for it."""

    def __init__(self):
        self.waited = False

    def synchronize(self):
        self.waited = True


def test_buffers_go_round_and_each_waits_for_its_last_copy():
    ring = CopyOutRing(Link(torch.device("cpu")), 8, torch.bfloat16, slots=2)
    first = ring.take(8)
    copy = _Copy()
    ring.handed_to_link(copy)
    second = ring.take(5)
    assert second.numel() == 5 and second.data_ptr() != first.data_ptr()
    assert not copy.waited  # the other slot: no wait
    ring.handed_to_link(None)
    again = ring.take(8)
    assert again.data_ptr() == first.data_ptr() and copy.waited


def test_misuse_is_refused():
    link = Link(torch.device("cpu"))
    with pytest.raises(ValueError, match="at least 2 slots"):
        CopyOutRing(link, 8, torch.bfloat16, slots=1)
    ring = CopyOutRing(link, 8, torch.bfloat16)
    with pytest.raises(ValueError, match="does not fit"):
        ring.take(9)
    with pytest.raises(RuntimeError, match="without take"):
        ring.handed_to_link(None)
    ring.take(4)
    with pytest.raises(RuntimeError, match="twice"):
        ring.take(4)


def _partition(numel: int, seed: int):
    from hf_superoffload.engine.partition import HostPartition

    generator = torch.Generator().manual_seed(seed)
    master = torch.randn(numel, generator=generator)
    grad = torch.randn(numel, generator=generator).bfloat16()
    exp_avg = torch.randn(numel, generator=generator) * 0.1
    exp_avg_sq = torch.rand(numel, generator=generator) * 0.1
    flat = master.bfloat16()
    return HostPartition(0, 0, master, exp_avg, exp_avg_sq, grad, None, flat)


@pytest.mark.parametrize(
    "runs",
    [[(0, 1000, 3)], [(0, 300, 3), (500, 500, 2)]],  # whole; two step counts and a skipped gap
    ids=["whole", "runs"],
)
def test_passes_through_the_ring_in_pieces_equal_whole_passes_to_the_bit(runs):
    """Step, replay and rollback of a partition ten pieces long through a two-slot ring give
    the same master, moments and model params as one kernel call per run; elements outside
    the runs (params without a gradient) stay untouched."""
    from hf_superoffload import ops
    from hf_superoffload.engine.host_steps import HostSteps
    from hf_superoffload.engine.stv import StvStats, adam_hyper

    link = Link(torch.device("cpu"))
    ring = CopyOutRing(link, 1000, torch.bfloat16, slots=2, piece=96)
    steps = HostSteps(link, StvStats(), torch.zeros(1), copy_out=ring)
    ours, ref = _partition(1000, 0), _partition(1000, 0)
    group = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}
    hyper = adam_hyper(group, 3)

    def each_run(kernel):
        for offset, numel, step in runs:
            tensors = (ref.master, ref.host_grad, ref.exp_avg, ref.exp_avg_sq, ref.flat_param)
            *state, low = (t.narrow(0, offset, numel) for t in tensors)
            kernel(state, low, {**hyper, "step": step})

    grad = ours.host_grad
    steps.step(ours, hyper, 1.0, None, runs, grad)
    each_run(lambda st, low, hp: ops.adam_step(*st, **hp, grad_scale=1.0, out_lowp=low))
    ours.speculation_applied = True
    steps.replay(ours, hyper, 1.0, 0.25, runs, grad)
    each_run(
        lambda st, low, hp: ops.adam_replay(
            *st, **hp, old_grad_scale=1.0, new_grad_scale=0.25, out_lowp=low
        )
    )
    steps.rollback(ours, hyper, 0.25, runs, grad)
    each_run(lambda st, low, hp: (ops.adam_rollback(*st, **hp, grad_scale=0.25), low.copy_(st[0])))
    for name in ("master", "exp_avg", "exp_avg_sq", "flat_param"):
        assert torch.equal(getattr(ours, name), getattr(ref, name)), name
    assert ring.piece_numel == 96


def test_compact_passes_cut_at_the_ring_only_when_they_send_and_equal_whole_calls():
    """Compact moments: a speculative pass goes to the model through the ring in buffer-sized
    pieces, a commit (nothing sent) makes one kernel call for all its params
    (``ops.compact_adam_pieces``, a piece a param); both give the bits of one
    ``ops.compact_adam`` call per param."""
    from hf_superoffload import ops
    from hf_superoffload.engine.compact_moments import CompactMoments
    from hf_superoffload.engine.host_steps import HostSteps
    from hf_superoffload.engine.stv import StvStats, adam_hyper

    spans, salts = [(0, 2000), (2048, 300)], [5, 9]  # a gap between the params: padding
    link = Link(torch.device("cpu"))
    ring = CopyOutRing(link, 2348, torch.bfloat16, slots=2, piece=512)
    steps = HostSteps(link, StvStats(), torch.zeros(1), copy_out=ring)
    part = _partition(2348, 0)
    part.compact = CompactMoments(spans, salts, 2348)
    calls = []
    kernel, kernel_pieces = ops.compact_adam, ops.compact_adam_pieces

    def counted(master, *args, **kwargs):
        calls.append((master.numel(), kwargs["commit"]))
        return kernel(master, *args, **kwargs)

    def counted_pieces(*args, **kwargs):
        calls.append(list(args[6]))
        return kernel_pieces(*args, **kwargs)

    hyper = adam_hyper({"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}, 1)
    runs = [(0, 2348, 1)]
    reference_master = part.master.clone()
    reference = CompactMoments(spans, salts, 2348)
    sent = torch.empty(2348, dtype=torch.bfloat16)
    kwargs = {k: v for k, v in hyper.items() if k != "step"}
    for index, ((offset, n), salt) in enumerate(zip(spans, salts, strict=True)):
        kernel(
            reference_master[offset : offset + n], part.host_grad[offset : offset + n],
            *reference.param_moments(index), step=1, grad_scale=1.0, salt=salt, commit=False,
            out_lowp=sent[offset : offset + n], **kwargs,
        )  # fmt: skip
    try:
        ops.compact_adam, ops.compact_adam_pieces = counted, counted_pieces
        steps.compact.run(
            part, hyper, 1.0, runs, part.host_grad, commit=False, send=True, seconds="cpu_step_seconds"
        )  # fmt: skip
        speculative = list(calls)
        calls.clear()
        steps.compact.run(
            part, hyper, 1.0, runs, part.host_grad, commit=True, send=False, seconds="commit_seconds"
        )  # fmt: skip
    finally:
        ops.compact_adam, ops.compact_adam_pieces = kernel, kernel_pieces
    assert speculative == [(512, False)] * 3 + [(464, False), (300, False)]
    # (offset, elements, first scale block, update number, salt, offset within the param)
    assert calls == [[ops.CommitPiece(0, 2000, 0, 1, 5, 0), ops.CommitPiece(2048, 300, 8, 1, 9, 0)]]
    for (offset, n), salt, index in zip(spans, salts, range(2), strict=True):
        assert torch.equal(part.flat_param[offset : offset + n], sent[offset : offset + n])
        kernel(
            reference_master[offset : offset + n], part.host_grad[offset : offset + n],
            *reference.param_moments(index), step=1, grad_scale=1.0, salt=salt, commit=True,
            **kwargs,
        )  # fmt: skip
    assert torch.equal(part.master, reference_master)
    for ours, theirs in zip(part.compact.tensors(), reference.tensors(), strict=True):
        assert torch.equal(ours, theirs)
