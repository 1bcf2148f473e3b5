"""``load_best_model_at_end`` with SuperOffloadTrainer: the fp32 masters after ``train()`` are
exactly those of the best step, whatever the checkpoint's weights files hold (bf16 weights
with ``superoffload_save_dtype="bfloat16"``, or a fused-expert MoE whose saved tensors carry
other names than the model's params); where the masters could not be restored exactly
(``save_only_model=True``: no optimizer state in the checkpoint), training is refused before
its first step.

Each run evaluates and saves every step; ``greater_is_better=True`` on the eval loss makes the
first checkpoint the best (the loss falls), so the best is not the last step. A callback keeps
a copy of the masters after every step, to compare the restored ones with (``torch.equal``).
Models, data and arguments: tests/test_integration_trainer.py's (imported).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may touch the network

import pytest
import torch
from engine_reference import PARAM_TOL
from safetensors import safe_open
from test_integration_trainer import (
    SEED,
    VOCAB,
    _args,
    _assert_params_close,
    _dataset,
    _model,
    _params,
    _step_logs,
)
from trainer_cleanup import OPENED_TRAINERS
from transformers import Trainer, TrainerCallback

from hf_superoffload import SuperOffloadTrainer

pytestmark = pytest.mark.usefixtures("one_intra_op_thread", "close_trainers_optimizers")

STEPS = 4
BEST_EVERY_STEP = {
    "max_steps": STEPS,
    "eval_strategy": "steps",
    "eval_steps": 1,
    "save_strategy": "steps",
    "save_steps": 1,
    "load_best_model_at_end": True,
    "metric_for_best_model": "eval_loss",
    "greater_is_better": True,
}


class _MastersEachStep(TrainerCallback):
    """A copy of every param's fp32 master after each optimizer step, by global step."""

    def __init__(self) -> None:
        self.trainer = None
        self.by_step: dict[int, dict[str, torch.Tensor]] = {}

    def on_step_end(self, args, state, control, **kwargs):
        self.by_step[state.global_step] = _masters(self.trainer)


def _masters(trainer) -> dict[str, torch.Tensor]:
    optimizer = trainer.superoffload_optimizer
    return {
        name: optimizer.master_state(param)["master"]
        for name, param in trainer.model.named_parameters()
        if optimizer.manages(param)
    }


def _trainer(output_dir, superoffload: bool, model=None, **overrides):
    cls = SuperOffloadTrainer if superoffload else Trainer
    trainer = cls(
        model=_model() if model is None else model,
        args=_args(output_dir, superoffload, **{**BEST_EVERY_STEP, **overrides}),
        train_dataset=_dataset(),
        eval_dataset=_dataset(8),
    )
    if superoffload:
        OPENED_TRAINERS.append(trainer)
    return trainer


def _run_capturing(output_dir, model=None, **overrides):
    trainer = _trainer(output_dir, True, model=model, **overrides)
    capture = _MastersEachStep()
    capture.trainer = trainer
    trainer.add_callback(capture)
    trainer.train()
    return trainer, capture.by_step


def _best_step(trainer) -> int:
    best = trainer.state.best_model_checkpoint
    step = int(best.rsplit("-", 1)[1])
    assert step < STEPS, "the best checkpoint must not be the last step's"
    return step


def _assert_exact_best(trainer, by_step) -> None:
    """The masters are the best step's (bit for bit), not bf16 roundings of them, and each
    param holds its master (rounded to the param's dtype)."""
    best = by_step[_best_step(trainer)]
    masters = _masters(trainer)
    assert masters.keys() == best.keys()
    for name, value in best.items():
        assert torch.equal(masters[name], value), name
    assert any(not torch.equal(m.to(torch.bfloat16).float(), m) for m in masters.values())
    for name, param in trainer.model.named_parameters():
        if name in masters:
            assert torch.equal(param.detach(), masters[name].to(param.dtype)), name


@pytest.mark.parametrize("bf16", [True, False])
def test_bf16_saves_restore_the_exact_masters_of_the_best_step(tmp_path, bf16):
    """superoffload_save_dtype="bfloat16": the checkpoint's weights are rounded, its
    optimizer.pt holds the exact masters; those are what train() ends with. With an fp32 model
    (bf16=False) too: the Trainer loads the rounded weights into the fp32 params."""
    trainer, by_step = _run_capturing(tmp_path, bf16=bf16, superoffload_save_dtype="bfloat16")
    best = trainer.state.best_model_checkpoint
    with safe_open(os.path.join(best, "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        assert {f.get_slice(n).get_dtype() for n in names} == {"BF16"}
    _assert_exact_best(trainer, by_step)


def test_after_the_best_checkpoint_training_continues_like_the_plain_trainer(tmp_path):
    """fp32 model, bf16 saves: the plain Trainer loads the best fp32 weights exactly, and a
    second train() continues from them with the optimizer's moments; ours continues from the
    exact best masters, not from their bf16 rounding, and follows it."""
    ours = _trainer(tmp_path / "ours", True, superoffload_save_dtype="bfloat16")
    ref = _trainer(tmp_path / "ref", False)
    ours.train()
    ref.train()
    assert ours.state.best_model_checkpoint.endswith("checkpoint-1")
    assert ref.state.best_model_checkpoint.endswith("checkpoint-1")
    _assert_params_close(_masters(ours), _params(ref.model), **PARAM_TOL)
    ours.train()
    ref.train()
    ours_losses = [log["loss"] for log in _step_logs(ours)]
    ref_losses = [log["loss"] for log in _step_logs(ref)]
    torch.testing.assert_close(ours_losses, ref_losses, rtol=1e-5, atol=0)
    _assert_params_close(_params(ours.model), _params(ref.model), **PARAM_TOL)


def _tiny_fused_moe():
    """A Qwen3-MoE with two experts: transformers 5 holds each layer's experts as fused params
    (``experts.gate_up_proj``, ``experts.down_proj``) and saves them per expert."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=2,
        num_experts_per_tok=1,
        pad_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return Qwen3MoeForCausalLM(config)


def test_fused_moe_experts_restore_the_exact_masters_of_the_best_step(tmp_path):
    """The saved file names the experts per expert (``experts.0.gate_proj.weight``...), not as
    the model's fused params: the masters come back by their place in the optimizer state."""
    model = _tiny_fused_moe()
    fused = [n for n, _ in model.named_parameters() if n.endswith("experts.gate_up_proj")]
    if not fused:
        pytest.skip("this transformers holds MoE experts as modules, not fused params")
    trainer, by_step = _run_capturing(tmp_path, model=model, bf16=True)
    path = os.path.join(trainer.state.best_model_checkpoint, "model.safetensors")
    with safe_open(path, framework="pt") as f:
        saved = set(f.keys())
    assert not set(fused) & saved and any(".experts.0.gate_proj." in n for n in saved)
    _assert_exact_best(trainer, by_step)


# ----------------------------------------------------------- no optimizer state to restore from


def _refused_before_training(tmp_path, match, model=None, **overrides):
    trainer = _trainer(tmp_path, True, model=model, save_only_model=True, **overrides)
    with pytest.raises(ValueError, match=match):
        trainer.train()
    assert trainer.state.global_step == 0
    assert not any(name.startswith("checkpoint-") for name in os.listdir(tmp_path))


def test_bf16_saves_without_the_optimizer_state_are_refused_before_training(tmp_path):
    _refused_before_training(
        tmp_path, "save_only_model=False", bf16=True, superoffload_save_dtype="bfloat16"
    )


def test_renamed_weights_without_the_optimizer_state_are_refused_before_training(tmp_path):
    """bf16 model, fp32 saves, but the file names the experts otherwise: the masters could be
    found neither in the weights nor in an optimizer state."""
    model = _tiny_fused_moe()
    if not any(n.endswith("experts.gate_up_proj") for n, _ in model.named_parameters()):
        pytest.skip("this transformers holds MoE experts as modules, not fused params")
    _refused_before_training(tmp_path, "experts.gate_up_proj", model=model, bf16=True)


def test_fp32_saves_without_the_optimizer_state_restore_the_masters_from_the_weights(tmp_path):
    """save_only_model=True, fp32 weights under the params' own names: those are the masters."""
    trainer, by_step = _run_capturing(tmp_path, bf16=True, save_only_model=True)
    assert not os.path.exists(os.path.join(trainer.state.best_model_checkpoint, "optimizer.pt"))
    _assert_exact_best(trainer, by_step)


# ------------------------------------------- resuming a plain Trainer's checkpoint, other names


def test_a_plain_trainers_checkpoint_naming_params_otherwise_is_refused_on_resume(tmp_path):
    """A plain Trainer's checkpoint holds no masters, and names the fused experts per expert:
    a bf16 model resumed from it would start their masters from its own rounded values (the
    Trainer's load leaves them unloaded). Refused before a step."""
    model = _tiny_fused_moe()
    if not any(n.endswith("experts.gate_up_proj") for n, _ in model.named_parameters()):
        pytest.skip("this transformers holds MoE experts as modules, not fused params")
    plain = Trainer(
        model=model,
        args=_args(tmp_path, False, max_steps=2, save_strategy="steps", save_steps=2),
        train_dataset=_dataset(),
    )
    plain.train()
    ours = SuperOffloadTrainer(
        model=_tiny_fused_moe(),
        args=_args(tmp_path, True, max_steps=4, save_strategy="steps", save_steps=1, bf16=True),
        train_dataset=_dataset(),
    )
    OPENED_TRAINERS.append(ours)
    with pytest.raises(ValueError, match=r"do not name .*experts.gate_up_proj"):
        ours.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("checkpoint-")) == [
        "checkpoint-2"
    ]
