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

import os

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
