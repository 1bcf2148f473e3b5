"""Saves of a model that ``bf16=True`` cast: frozen params and float buffers keep their fp32
values in the file.

SuperOffloadTrainer casts an fp32 model to bf16 in place (the fp32 masters of the trained
params live on the host). The frozen params and float buffers have no master: their fp32
values, which bf16 does not hold, are kept on the host at the cast and written by every save
(float32, the default), as the plain Trainer, which keeps the fp32 model, writes them. A model
handed over in bf16 loses nothing to the cast: its frozen values are written upcast, exactly.
Models, data and arguments: tests/test_integration_trainer.py's (imported).
"""

from __future__ import annotations

import gc
import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may touch the network

import pytest
import torch
from safetensors.torch import load_file
from test_integration_trainer import _args, _dataset, _model
from trainer_cleanup import OPENED_TRAINERS

from hf_superoffload import SuperOffloadTrainer
from hf_superoffload.engine.host_memory import HOST_MEMORY_ENV, HostMemoryError

pytestmark = pytest.mark.usefixtures("one_intra_op_thread", "close_trainers_optimizers")

NOT_BF16 = 1 + 2**-12  # bf16 holds 1 and 1 + 2**-7 near it: this rounds to 1
FROZEN = "model.norm.weight"
BUFFER = "model.norm.calibration"  # a persistent float buffer, saved with the weights


def _model_with_frozen_values(dtype=torch.float32):
    model = _model()
    norm = model.model.norm
    with torch.no_grad():
        norm.weight.fill_(NOT_BF16)
        norm.weight[0] = -3 * NOT_BF16
    norm.weight.requires_grad_(False)
    norm.register_buffer("calibration", torch.linspace(1, 2, 7) + 2**-20)
    return model.to(dtype)


def _trained(tmp_path, model, **overrides):
    trainer = SuperOffloadTrainer(
        model=model,
        args=_args(tmp_path / "run", True, max_steps=2, bf16=True, **overrides),
        train_dataset=_dataset(),
    )
    OPENED_TRAINERS.append(trainer)
    trainer.train()
    return trainer


def test_frozen_params_and_buffers_are_saved_with_their_fp32_values(tmp_path):
    model = _model_with_frozen_values()
    frozen, buffer = model.model.norm.weight.clone(), model.model.norm.calibration.clone()
    assert not torch.equal(frozen.to(torch.bfloat16).float(), frozen)
    assert not torch.equal(buffer.to(torch.bfloat16).float(), buffer)
    trainer = _trained(tmp_path, model)
    assert trainer.model.model.norm.weight.dtype == torch.bfloat16  # the model computes in bf16
    trainer.save_model(str(tmp_path / "saved"))
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert saved[FROZEN].dtype == torch.float32 and torch.equal(saved[FROZEN], frozen)
    assert saved[BUFFER].dtype == torch.float32 and torch.equal(saved[BUFFER], buffer)
    optimizer = trainer.superoffload_optimizer
    for name, param in trainer.model.named_parameters():
        if param.requires_grad:  # the trained params: their masters, as before
            assert torch.equal(saved[name], optimizer.master_state(param)["master"]), name

    # A buffer changed since the cast (as training updates some) is written as it is now.
    with torch.no_grad():
        trainer.model.model.norm.calibration.mul_(2)
    trainer.save_model(str(tmp_path / "changed"))
    changed = load_file(tmp_path / "changed" / "model.safetensors")
    assert torch.equal(changed[BUFFER], trainer.model.model.norm.calibration.float())
    assert torch.equal(changed[FROZEN], frozen)


def test_checkpoints_hold_the_fp32_values_of_frozen_params(tmp_path):
    model = _model_with_frozen_values()
    frozen = model.model.norm.weight.clone()
    _trained(tmp_path, model, save_strategy="steps", save_steps=2)
    saved = load_file(tmp_path / "run" / "checkpoint-2" / "model.safetensors")
    assert torch.equal(saved[FROZEN], frozen)


def test_a_model_handed_over_in_bf16_keeps_no_fp32_copies(tmp_path):
    """Nothing to lose: its frozen values are bf16 already, and written upcast, exactly."""
    model = _model_with_frozen_values(torch.bfloat16)
    frozen = model.model.norm.weight.clone()
    trainer = _trained(tmp_path, model)
    assert trainer._superoffload_frozen_fp32 == {}
    trainer.save_model(str(tmp_path / "saved"))
    saved = load_file(tmp_path / "saved" / "model.safetensors")
    assert saved[FROZEN].dtype == torch.float32 and torch.equal(saved[FROZEN], frozen.float())


def test_fp32_copies_that_do_not_fit_the_host_are_refused_before_the_cast(tmp_path, monkeypatch):
    monkeypatch.setenv(HOST_MEMORY_ENV, str(64 / 2**30))  # 64 bytes: less than the copies
    model = _model_with_frozen_values()
    trainer = SuperOffloadTrainer(
        model=model, args=_args(tmp_path, True, max_steps=2, bf16=True), train_dataset=_dataset()
    )
    OPENED_TRAINERS.append(trainer)
    with pytest.raises(HostMemoryError, match=r"frozen_fp32_values.*load the model in bf16"):
        trainer.train()
    assert all(p.dtype == torch.float32 for p in model.parameters())  # nothing cast


FP32_STATE = ("master", "exp_avg", "exp_avg_sq")


def _train_and_close(tmp_path, host_memory_gib: str | None, monkeypatch):
    """Trains a frozen-values model to the end (or to its refusal); returns the trained params'
    fp32 state, or the error. The trainer and its optimizer are gone after, with what their
    host checks granted."""
    if host_memory_gib is None:
        monkeypatch.delenv(HOST_MEMORY_ENV, raising=False)
    else:
        monkeypatch.setenv(HOST_MEMORY_ENV, host_memory_gib)
    trainer = SuperOffloadTrainer(
        model=_model_with_frozen_values(),
        args=_args(tmp_path, True, max_steps=2, bf16=True),
        train_dataset=_dataset(),
    )
    try:
        trainer.train()
    except HostMemoryError as error:
        assert trainer._superoffload_built is None  # refused before the optimizer allocated
        outcome = str(error)
    else:
        optimizer = trainer.superoffload_optimizer
        outcome = {
            name: {key: optimizer.master_state(param)[key].clone() for key in FP32_STATE}
            for name, param in trainer.model.named_parameters()
            if param.requires_grad
        }
        optimizer.close()
        del optimizer
    del trainer
    gc.collect()
    return outcome


def test_the_host_memory_figure_holds_the_fp32_copies_and_the_optimizer_together(
    tmp_path, monkeypatch
):
    """HF_SUPEROFFLOAD_HOST_MEMORY_GIB is the job's whole host memory: the fp32 copies the
    cast keeps and then the optimizer's state are checked against it in turn, the second
    counting the first. One byte short of both is refused at the optimizer's check, before it
    allocates (each alone fits); both exactly train as with no figure given."""
    from hf_superoffload.engine import host_memory, layout
    from hf_superoffload.integrations import save

    monkeypatch.setattr(host_memory, "_GRANTED", {})  # this test's claims only
    checked = []
    real = host_memory.check_host_memory

    def spy(parts, remedies):
        checked.append(sum(parts.values()))
        return real(parts, remedies)

    monkeypatch.setattr(save, "check_host_memory", spy)
    monkeypatch.setattr(layout, "check_host_memory", spy)
    unlimited = _train_and_close(tmp_path / "unlimited", None, monkeypatch)
    copies, state = checked
    assert 0 < copies < state

    refusal = _train_and_close(tmp_path / "short", str((copies + state - 1) / 2**30), monkeypatch)
    assert isinstance(refusal, str), "both fitted a figure one byte short of them"
    assert refusal.startswith("the optimizer's host state needs") and "master" in refusal
    held = re.search(r"earlier host checks granted and it still holds: (.*?) GiB\)", refusal)
    assert held and {part.split()[0] for part in held.group(1).split(", ")} == {
        "trainable_fp32_values",
        "frozen_fp32_values",
    }, refusal

    exact = _train_and_close(tmp_path / "exact", str((copies + state) / 2**30), monkeypatch)
    assert not isinstance(exact, str), exact
    for name, want in unlimited.items():
        for key in FP32_STATE:
            assert torch.equal(exact[name][key], want[key]), (name, key)
