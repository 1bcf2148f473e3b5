"""Placement of tail buckets: the request checks and the measured tuner of gpu_buckets='auto'."""

from __future__ import annotations

import pytest
import torch

from hf_superoffload.engine.buckets import plan_buckets
from hf_superoffload.engine.placement import TailTuner, choose_device_buckets


def _plans(sizes):
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    return plan_buckets([{"params": params}], bucket_size=max(sizes))


def test_requested_count_is_capped_at_the_bucket_count():
    plans = _plans([10, 10, 10])
    assert choose_device_buckets(10_000, plans, torch.device("cpu")) == 3
    assert choose_device_buckets(1, plans, torch.device("cpu")) == 1


@pytest.mark.parametrize("bad", [-1, "all", 1.5, True])
def test_bad_request_says_what_to_pass(bad):
    with pytest.raises(ValueError, match="gpu_buckets must be"):
        choose_device_buckets(bad, _plans([10, 10]), torch.device("cpu"))


def test_auto_takes_about_a_tenth_of_the_params_from_the_tail(monkeypatch):
    from hf_superoffload.engine import placement

    monkeypatch.setattr(placement, "_free_device_bytes", lambda device: float("inf"))
    plans = _plans([100] * 30)
    chosen = choose_device_buckets("auto", plans, torch.device("cuda", 0))
    assert chosen == 3  # 10% of 3000 elements
    # With no GPU there is no device to keep a tail on: CPU runs stay on one arithmetic.
    assert choose_device_buckets("auto", plans, torch.device("cpu")) == 0


def _feed(tuner, steps, host_elements=1_000_000):
    """steps: (wall seconds, exposed seconds, cpu seconds) per step, the CPU stepping all
    host elements each step; returns the proposals."""
    now = exposed = cpu = 0.0
    elements = 0
    out = []
    for wall, waited, cpu_s in steps:
        now, exposed, cpu = now + wall, exposed + waited, cpu + cpu_s
        elements += host_elements
        out.append(tuner.elements_to_move(now, exposed, cpu, elements, host_elements))
    return out


def test_tuner_moves_the_exposed_cpu_work_after_warmup():
    tuner = TailTuner(warmup_steps=2, tuning_steps=8, threshold=0.02)
    # CPU Adam at 1M elements / 0.5 s = 2M/s; the GPU waited 0.1 s -> move 200k elements.
    proposals = _feed(tuner, [(1.0, 0.3, 0.5)] * 2 + [(1.0, 0.1, 0.5)])
    assert proposals == [0, 0, 200_000]
    assert tuner.active


def test_tuner_stops_once_the_gpu_no_longer_waits():
    tuner = TailTuner(warmup_steps=1, tuning_steps=8, threshold=0.02)
    proposals = _feed(tuner, [(1.0, 0.5, 0.5), (1.0, 0.01, 0.5), (1.0, 0.5, 0.5)])
    assert proposals == [0, 0, 0]
    assert not tuner.active


def test_tuner_moves_at_most_max_share_of_the_host_params_at_once():
    tuner = TailTuner(warmup_steps=1, tuning_steps=8, threshold=0.02, max_share=0.25)
    # The GPU waited 0.4 s at 2M elements/s: 800k, capped at 250k of the 1M on the host.
    assert _feed(tuner, [(1.0, 0.4, 0.5)] * 2) == [0, 250_000]
    default = TailTuner(warmup_steps=1)  # at most half by default: 500k of the 1M
    assert _feed(default, [(1.0, 0.4, 0.5)] * 2) == [0, 500_000]


def test_tuner_stops_after_its_window():
    tuner = TailTuner(warmup_steps=1, tuning_steps=2, threshold=0.02)
    proposals = _feed(tuner, [(1.0, 0.1, 0.5)] * 5)
    assert proposals[:3] == [0, 200_000, 200_000]
    assert proposals[3:] == [0, 0] and not tuner.active


def test_tuner_ignores_the_step_right_after_a_move():
    tuner = TailTuner(warmup_steps=1, tuning_steps=8, threshold=0.02)
    now = exposed = cpu = 0.0
    elements = 0

    def step(wall, waited):
        nonlocal now, exposed, cpu, elements
        now, exposed, cpu, elements = now + wall, exposed + waited, cpu + 0.5, elements + 10**6
        return tuner.elements_to_move(now, exposed, cpu, elements, 10**6)

    assert [step(1.0, 0.1), step(1.0, 0.1)] == [0, 200_000]
    tuner.moved()
    assert step(3.0, 0.0) == 0 and tuner.active  # the move's own step: a new baseline only
    assert step(1.0, 0.05) == 100_000  # measured again


def test_tuner_window_counts_measured_steps_not_baselines():
    tuner = TailTuner(warmup_steps=1, tuning_steps=2, threshold=0.02)
    now = exposed = cpu = 0.0
    elements = 0

    def step(waited):
        nonlocal now, exposed, cpu, elements
        now, exposed, cpu, elements = now + 1.0, exposed + waited, cpu + 0.5, elements + 10**6
        return tuner.elements_to_move(now, exposed, cpu, elements, 10**6)

    assert step(0.1) == 0  # warm-up
    assert step(0.1) == 200_000  # measurement 1
    tuner.moved()
    assert step(0.1) == 0 and tuner.active  # baseline after the move, not a measurement
    assert step(0.1) == 200_000  # measurement 2
    assert step(0.1) == 0 and not tuner.active  # window of 2 measurements over


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


def test_default_cpu_threads_share_a_host_between_unbound_ranks(monkeypatch):
    from hf_superoffload.engine import checks

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(checks.os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("ACCELERATE_CPU_AFFINITY", raising=False)
    assert checks.default_cpu_threads(cuda) == 63  # one core feeds the GPU
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert checks.default_cpu_threads(cuda) == 15  # 64 / 4 ranks, minus the feeding core
    # accelerate's enable_cpu_affinity bound each rank to its own node's cores already.
    monkeypatch.setenv("ACCELERATE_CPU_AFFINITY", "1")
    monkeypatch.setattr(checks.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert checks.default_cpu_threads(cuda) == 15
