"""Placement of tail buckets: the request checks, the cap and the device headroom (the tuner of
gpu_tail='auto' has tests/test_engine_tail_tuner.py)."""

from __future__ import annotations

import pytest
import torch

from hf_superoffload.engine.buckets import plan_buckets
from hf_superoffload.engine.placement import choose_device_buckets


def _plans(sizes):
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    return plan_buckets([{"params": params}], bucket_size=max(sizes))


def test_requested_count_is_capped_at_the_bucket_count():
    plans = _plans([10, 10, 10])
    assert choose_device_buckets(10_000, plans, torch.device("cpu")) == 3
    assert choose_device_buckets(1, plans, torch.device("cpu")) == 1


@pytest.mark.parametrize("bad", [-1, "all", 1.5, True])
def test_bad_request_says_what_to_pass(bad):
    with pytest.raises(ValueError, match="gpu_tail must be"):
        choose_device_buckets(bad, _plans([10, 10]), torch.device("cpu"))


def test_auto_starts_with_about_a_twentieth_of_the_params_from_the_tail(monkeypatch):
    from hf_superoffload.engine import placement

    monkeypatch.setattr(placement, "_free_device_bytes", lambda device: float("inf"))
    plans = _plans([100] * 40)
    chosen = choose_device_buckets("auto", plans, torch.device("cuda", 0))
    assert chosen == 2  # 5% of 4000 elements
    # With no GPU there is no device to keep a tail on: CPU runs stay on one arithmetic.
    assert choose_device_buckets("auto", plans, torch.device("cpu")) == 0


def test_a_cap_bounds_auto_and_refuses_a_count_above_it(monkeypatch):
    from hf_superoffload.engine import placement

    monkeypatch.setattr(placement, "_free_device_bytes", lambda device: float("inf"))
    plans = _plans([100] * 80)  # 1600 B of tail state per bucket; 5% of params: 4 buckets
    cuda = torch.device("cuda", 0)
    assert choose_device_buckets("auto", plans, cuda, cap_bytes=3300) == 2
    assert choose_device_buckets("auto", plans, cuda, cap_bytes=0) == 0
    assert choose_device_buckets(2, plans, cuda, cap_bytes=3200) == 2
    with pytest.raises(ValueError, match="above gpu_tail_cap"):
        choose_device_buckets(3, plans, cuda, cap_bytes=3200)


def test_headroom_counts_the_allocators_reserved_peak_and_a_margin(monkeypatch):
    from hf_superoffload.engine import placement

    gib = 2**30

    class Props:
        total_memory = 80 * gib

    monkeypatch.setattr(placement.torch.cuda, "get_device_properties", lambda device: Props)
    monkeypatch.setattr(placement.torch.cuda, "max_memory_allocated", lambda device: 60 * gib)
    # Reserved includes blocks held but fragmented: they are not free for more state either.
    monkeypatch.setattr(placement.torch.cuda, "max_memory_reserved", lambda device: 66 * gib)
    headroom = placement.device_headroom_bytes(torch.device("cuda", 0))
    assert headroom == 80 * gib - 66 * gib - 4 * gib  # margin: 5% of the card, at least 2 GiB
    assert placement.device_headroom_bytes(torch.device("cpu")) == 0.0  # nothing to move to
