"""The DeepSpeed systems' shared config (benchmarks/systems.py ``deepspeed_config``): what each
system changes in it, what BENCH_ZERO_EXTRA adds, and that DeepSpeed builds deepspeed_zero3's
(ZeRO-3 with no offload, torch's AdamW as the base optimizer) on one CPU rank and steps it."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from ranks import spawn_ranks
from zero3_reference import build_model, free_port, init_rank

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import systems

ARGS = SimpleNamespace(batch=2, clip=1.0, ratio=0.8)


def _config(system: str) -> dict:
    return systems.SYSTEMS[system].deepspeed_config(ARGS)


@pytest.fixture(autouse=True)
def _no_extra(monkeypatch):
    monkeypatch.delenv(systems.ZERO_EXTRA_ENV, raising=False)


def test_each_system_changes_only_its_offload():
    zero_offload, ours, plain = (
        _config(s) for s in ("deepspeed_zero_offload", "superoffload_zero3", "deepspeed_zero3")
    )
    offload = zero_offload["zero_optimization"]["offload_optimizer"]
    assert offload == {"device": "cpu", "pin_memory": True, "ratio": 0.8}
    assert ours["zero_optimization"]["offload_optimizer"] == {**offload, "super_offload": True}
    assert "offload_optimizer" not in plain["zero_optimization"]
    assert plain["optimizer"]["params"].pop("torch_adam") is True
    assert "torch_adam" not in zero_offload["optimizer"]["params"]
    for config in (ours, plain):  # everything else is the one shared config
        config["zero_optimization"].pop("offload_optimizer", None)
        config["optimizer"]["params"].pop("torch_adam", None)
    zero_offload["zero_optimization"].pop("offload_optimizer")
    assert ours == zero_offload == plain
    assert plain["gradient_clipping"] == 1.0 and plain["train_micro_batch_size_per_gpu"] == 2


def test_bench_zero_extra_adds_and_overrides_zero_keys(monkeypatch):
    monkeypatch.setenv(
        systems.ZERO_EXTRA_ENV,
        '{"stage3_param_persistence_threshold": 1000000000, "overlap_comm": false}',
    )
    zero = _config("deepspeed_zero3")["zero_optimization"]
    assert zero["stage3_param_persistence_threshold"] == 1_000_000_000
    assert zero["overlap_comm"] is False and zero["stage"] == 3


def _plain_zero3_rank(rank: int, port: int) -> None:
    init_rank(rank, 1, port)
    torch.set_num_threads(1)
    import deepspeed

    config = systems.DeepSpeedZero3.deepspeed_config(SimpleNamespace(batch=2, clip=1.0, ratio=1.0))
    model = build_model(0)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    assert (
        systems.qualified_name(type(engine.optimizer)) == systems.DeepSpeedZero3.expected_optimizer
    )
    assert type(engine.optimizer.optimizer) is torch.optim.AdamW
    batch = torch.randint(0, model.config.vocab_size, (2, 16))
    losses = []
    for _ in range(3):
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0], losses
    engine.destroy()


def test_deepspeed_builds_and_steps_plain_zero3_on_a_cpu_rank():
    spawn_ranks(_plain_zero3_rank, (free_port(),), world=1)
