"""HF_SUPEROFFLOAD_CPU_ADAM_ISA naming an instruction set this CPU cannot run (or no
instruction set at all) is refused when the optimizer is built, naming the variable and what
this CPU runs, not at the first kernel call inside the worker; ``hf-superoffload env`` marks it
invalid. A runnable one is used by the kernels.
"""

from __future__ import annotations

import pytest
import torch

from hf_superoffload import SuperOffloadOptimizer, ops
from hf_superoffload.cli import env as env_command
from hf_superoffload.cli import env_facts, host_facts
from hf_superoffload.ops import adam

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _unrunnable() -> str:
    """A kernel of the build this CPU cannot run (sve on x86, avx512 on ARM)."""
    return next(name for name in adam.ISAS if name not in ops.available_isas())


@pytest.fixture
def isa_variable(monkeypatch):
    """Set the variable as a fresh process would first read it."""

    def set_to(value: str) -> None:
        monkeypatch.setenv(adam.ISA_ENV, value)
        monkeypatch.setattr(adam, "_isa_override", adam._NOT_READ)

    ops.prepare()  # the build (cached) before the variable is set
    return set_to


@pytest.mark.parametrize("value", ["unrunnable", "avx-512"])
def test_an_isa_this_cpu_cannot_run_is_refused_when_the_optimizer_is_built(isa_variable, value):
    value = _unrunnable() if value == "unrunnable" else value
    isa_variable(value)
    model = torch.nn.Linear(8, 8)
    before = [p.detach().clone() for p in model.parameters()]
    runs = ", ".join(ops.available_isas())
    expected = f"{adam.ISA_ENV}={value}: this CPU runs {runs}; unset it or pick one."
    with pytest.raises(ValueError) as refused:
        SuperOffloadOptimizer(model.parameters(), lr=1e-3, model=model)
    assert str(refused.value) == expected
    for param, old in zip(model.parameters(), before, strict=True):
        torch.testing.assert_close(param, old, rtol=0, atol=0)
    # The same params train once the variable names one this CPU runs.
    isa_variable("scalar")
    optimizer = SuperOffloadOptimizer(model.parameters(), lr=1e-3, model=model)
    try:
        model(torch.randn(2, 8)).sum().backward()
        optimizer.step()
        optimizer.synchronize()
        assert ops.active_isa() == "scalar"
    finally:
        optimizer.close()


def test_env_marks_an_unrunnable_isa_invalid(isa_variable):
    value = _unrunnable()
    isa_variable(value)
    kernel = env_facts.cpu_adam(host_facts.cpu(), build=False)
    assert kernel["status"] == "loaded"
    assert kernel["isa_override_error"].startswith(f"{adam.ISA_ENV}={value}: this CPU runs ")
    assert kernel["isa"] == ops.load_extension().best_isa()  # what runs once it is unset
    facts = {**env_facts.collect(measure_bandwidth=False), "cpu_adam": kernel}
    text = env_command.render(facts)
    assert f"{adam.ISA_ENV}={value}: INVALID" in text
    assert "INVALID          " + kernel["isa_override_error"] in text


def test_env_names_the_variable_in_use_when_this_cpu_runs_it(isa_variable):
    isa_variable("scalar")
    kernel = env_facts.cpu_adam(host_facts.cpu(), build=False)
    assert "isa_override_error" not in kernel
    assert (kernel["isa"], kernel["isa_source"]) == ("scalar", adam.ISA_ENV)
