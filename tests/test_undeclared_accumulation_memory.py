"""The host check counts the fp32 gradient sum of accumulation nobody declared before it is
made. Declared (``gradient_accumulation_steps`` > 1) the start-up check counts every host
bucket's sum; told nothing (two backward() per step, ``set_accumulation_boundary(False)``, a
hook firing twice) each bucket's sum is checked as it is first needed: refused before it is
allocated, the step restored to where it began, with a message naming
``gradient_accumulation_steps``; granted, it trains as torch.optim.AdamW does."""

from __future__ import annotations

import gc

import pytest
import torch

from hf_superoffload import SuperOffloadOptimizer
from hf_superoffload.engine import bucket as bucket_module
from hf_superoffload.engine import host_memory, layout
from hf_superoffload.engine.bucket import grad_sum_bytes
from hf_superoffload.engine.host_memory import HOST_MEMORY_ENV, HostMemoryError

GiB = 2**30
STEPS, MICRO = 3, 2


@pytest.fixture
def own_claims(monkeypatch):
    """This test's claims only (other tests' optimizers may still be alive), one rank."""
    monkeypatch.setattr(host_memory, "_GRANTED", {})
    for name in host_memory.LAUNCHER_LOCAL_SIZES:
        monkeypatch.delenv(name, raising=False)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))


def _batches():
    gen = torch.Generator().manual_seed(1)
    return [[torch.randn(4, 32, generator=gen) for _ in range(MICRO)] for _ in range(STEPS)]


def _spy(monkeypatch, module) -> list[dict[str, int]]:
    seen = []
    real = host_memory.check_host_memory

    def spy(parts, remedies):
        seen.append(dict(parts))
        return real(parts, remedies)

    monkeypatch.setattr(module, "check_host_memory", spy)
    return seen


def _start_up_bytes(monkeypatch) -> tuple[int, int]:
    """The start-up check's bytes, and the gradient sums of every host bucket, of the model
    under the test's optimizer (one built, then dropped)."""
    seen = _spy(monkeypatch, layout)
    model = _model()
    opt = SuperOffloadOptimizer(model.parameters(), lr=1e-2, model=model, bucket_size=600)
    sums = sum(grad_sum_bytes(b.plan.numel) for b in opt._buckets if not b.on_device)
    assert len(opt._buckets) > 1 and seen[0]["accumulation"] == 0  # nothing declared
    opt.close()
    del opt
    gc.collect()
    assert host_memory.held_host_parts() == {}
    return sum(seen[0].values()), sums


@pytest.mark.parametrize("told", ["nothing", "set_accumulation_boundary"])
def test_undeclared_accumulation_is_refused_before_a_sum_that_does_not_fit(
    own_claims, monkeypatch, told
):
    start_up, sums = _start_up_bytes(monkeypatch)
    monkeypatch.setenv(HOST_MEMORY_ENV, str((start_up + sums - 1) / GiB))
    checks = _spy(monkeypatch, bucket_module)
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = SuperOffloadOptimizer(model.parameters(), lr=1e-2, model=model, bucket_size=600)
    with pytest.raises(HostMemoryError) as err:
        for micro, x in enumerate(_batches()[0]):  # the README's loop: two backward() a step
            if told == "set_accumulation_boundary":
                opt.set_accumulation_boundary(micro == MICRO - 1)
            model(x).square().sum().backward()
        opt.step()
    message = str(err.value)
    assert "SuperOffloadOptimizer refused the step" in message
    assert "gradient_accumulation_steps=<backward calls per step>" in message
    assert "(accumulation 0.00 GiB)" in message and "earlier host checks granted" in message
    # The sum that did not fit was never made; those made were each checked first.
    assert [c["accumulation"] for c in checks][-1] > 0
    held = host_memory.held_host_parts().get("accumulation", 0)
    assert opt.host_bytes()["accumulation"] == held < sums
    # The step is restored to where it began: params and master as they were.
    opt.zero_grad()
    opt.synchronize()
    for p, q in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), q)
        assert torch.equal(opt.master_state(p)["master"], q)
        assert not opt.master_state(p)["exp_avg"].any()
    opt.close()


def test_undeclared_accumulation_that_fits_trains_as_adamw(own_claims, monkeypatch):
    start_up, sums = _start_up_bytes(monkeypatch)
    monkeypatch.setenv(HOST_MEMORY_ENV, str((start_up + sums) / GiB))
    model, reference = _model(), _model()
    opt = SuperOffloadOptimizer(model.parameters(), lr=1e-2, model=model, bucket_size=600)
    adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for batch in _batches():
        for x in batch:
            model(x).square().sum().backward()
            reference(x).square().sum().backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)  # the engine's default
        opt.step()
        opt.zero_grad()
        adamw.step()
        adamw.zero_grad()
    opt.synchronize()
    # Every host bucket's sum was made, each under its own granted check.
    assert opt.host_bytes()["accumulation"] == sums == host_memory.held_host_parts()["accumulation"]
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        state = opt.master_state(p)
        torch.testing.assert_close(p.detach(), q.detach())
        torch.testing.assert_close(state["exp_avg"], adamw.state[q]["exp_avg"])
        torch.testing.assert_close(state["exp_avg_sq"], adamw.state[q]["exp_avg_sq"])
    opt.close()


def test_declared_accumulation_counts_the_sums_at_start_up_and_not_again(own_claims, monkeypatch):
    """The figure the start-up check counts is the one the buckets' sums are made of."""
    seen = _spy(monkeypatch, layout)
    later = _spy(monkeypatch, bucket_module)
    model = _model()
    opt = SuperOffloadOptimizer(
        model.parameters(), lr=1e-2, model=model, bucket_size=600, gradient_accumulation_steps=2
    )
    for x in _batches()[0]:
        model(x).square().sum().backward()
    opt.step()
    opt.synchronize()
    assert seen[0]["accumulation"] == opt.host_bytes()["accumulation"] > 0
    assert later == []  # counted once, at start-up
    opt.close()
