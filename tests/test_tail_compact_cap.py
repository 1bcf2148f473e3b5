"""The GPU tail's state is sized by its buckets' moments (bucket.tail_state_bytes): fp32
moments hold 16 B an element there (fp32 master, gradients and two moments), compact ones about
10 (a code a moment an element and a scale pair a block of each param). The figure is the
bytes the tail allocates (compared here on the CPU stand-in of the device), and gpu_tail_cap's
check, auto's budget, the cap's give-back and their messages count with it."""

from __future__ import annotations

import pytest
import torch
from compact_reference import assert_equal_trajectory, run_compact_reference
from engine_reference import RunConfig, clip_threshold, run_superoffload

from hf_superoffload import SuperOffloadOptimizer
from hf_superoffload.engine import placement
from hf_superoffload.engine.bucket import tail_state_bytes
from hf_superoffload.engine.buckets import plan_buckets

GiB = 2**30


def _allocated(bucket) -> int:
    """Bytes of the tensors a tail bucket holds on the device."""
    moments = bucket.compact.tensors() if bucket.compact else [bucket.exp_avg, bucket.exp_avg_sq]
    tensors = [bucket.master, bucket.grad, *moments]
    assert all(t.device == bucket.flat_param.device for t in tensors)
    return sum(t.nbytes for t in tensors)


@pytest.mark.parametrize("moments", ["fp32", "compact"])
def test_the_figure_is_what_the_tail_allocates_built_there_or_moved_there(moments):
    torch.manual_seed(0)
    # Params of a few blocks and of part of one, several to a bucket.
    model = torch.nn.Sequential(torch.nn.Linear(96, 40), torch.nn.Linear(40, 24))
    opt = SuperOffloadOptimizer(
        model.parameters(), lr=1e-2, model=model, bucket_size=4000, gpu_tail=1, moments=moments
    )
    compact = moments == "compact"
    tail = [b for b in opt._buckets if b.on_device]
    assert len(tail) == 1 and len(opt._buckets) > 1
    model(torch.randn(4, 96)).sum().backward()
    opt.step()
    opt.synchronize()
    opt._tail.move([b for b in opt._buckets if not b.on_device], to_device=True, why="test")
    assert any(len(b.plan.params) > 1 for b in opt._buckets)
    per_element = []
    for bucket in opt._buckets:
        assert bucket.on_device
        assert tail_state_bytes(bucket.plan, compact) == _allocated(bucket)
        per_element.append(_allocated(bucket) / bucket.plan.numel)
    assert sum(opt.device_bytes().values()) == opt._tail.device_state_bytes()
    assert opt._tail.device_state_bytes() == sum(_allocated(b) for b in opt._buckets)
    if compact:
        assert all(10 < b < 10.5 for b in per_element), per_element
    else:
        assert per_element == [16.0] * len(per_element)
    opt.close()


def test_gpu_tail_cap_counts_a_compact_tail_at_its_own_bytes():
    """A cap of 12 B an element holds one compact bucket (about 10 B), not an fp32 one (16):
    the refusal names the fp32 bucket's bytes."""
    n = 1024 * 1024  # one bucket per weight

    def build(moments):
        torch.manual_seed(0)
        m = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024, bias=False) for _ in range(2)))
        return SuperOffloadOptimizer(
            m.parameters(), lr=1e-3, model=m, bucket_size=n, gpu_tail=1,
            gpu_tail_cap=12 * n / GiB, moments=moments,
        )  # fmt: skip

    opt = build("compact")
    assert sum(opt.device_bytes().values()) == opt._tail.device_state_bytes() < 12 * n
    opt.close()
    with pytest.raises(ValueError) as err:
        build("fp32")
    assert f"needs {16 * n / GiB:.2f} GiB" in str(err.value) and "above gpu_tail_cap=0.01" in str(
        err.value
    )


def test_auto_fills_its_budget_by_the_buckets_moments(monkeypatch):
    monkeypatch.setattr(placement, "_free_device_bytes", lambda device: float("inf"))
    params = [torch.nn.Parameter(torch.zeros(100)) for _ in range(80)]
    plans = plan_buckets([{"params": params}], bucket_size=100)  # 5% of params: 4 buckets
    cuda = torch.device("cuda", 0)
    compact_bucket = tail_state_bytes(plans[-1], compact=True)
    assert compact_bucket < 1100 < 1600 == tail_state_bytes(plans[-1], compact=False)
    cap = 2 * compact_bucket
    assert placement.choose_device_buckets("auto", plans, cuda, cap, compact=True) == 2
    assert placement.choose_device_buckets("auto", plans, cuda, cap, compact=False) == 1
    assert placement.choose_device_buckets(2, plans, cuda, cap, compact=True) == 2
    with pytest.raises(ValueError, match="above gpu_tail_cap"):
        placement.choose_device_buckets(2, plans, cuda, cap, compact=False)


def test_a_cap_lowered_to_one_compact_buckets_state_keeps_that_bucket():
    """At 16 B an element both compact buckets would have gone back; by their bytes the
    tail-most stays, and the trajectory is the compact reference's to the bit."""
    cfg = RunConfig(steps=6, two_groups=True, schedule="warmup_decay")
    cfg = cfg.replace(max_grad_norm=clip_threshold(cfg, "some"))
    seen = []

    def probe(when, step, model, opt):
        if when == "after_step":
            seen.append((opt.stats["gpu_tail_buckets"], opt._tail.device_state_bytes()))
        if when == "after_step" and step == 2:
            last = opt._buckets[-1]
            opt.gpu_tail_cap = tail_state_bytes(last.plan, True) / GiB
            assert last.plan.numel * 16 > opt._tail.cap_bytes

    got = run_superoffload(
        cfg, gpu_tail=2, probe=probe, moments="compact", speculate_after_clip=True
    )
    assert_equal_trajectory(got, run_compact_reference(cfg, got.grad_norms))
    assert seen[2][0] == 2 and all(count == 1 for count, _ in seen[3:])
    assert got.stats["tail_moves"] == 1
