"""TRL's SFTTrainer and DPOTrainer with and without SuperOffload, on CPU.

Each test trains the download-free tiny Llama of `hf_superoffload.toy` (random weights, the
character tokenizer) twice on the same data with the same seed: once with the SuperOffload
trainer and config, once with TRL's own trainer and config and `optim="adamw_torch"` (torch's
default AdamW arithmetic; the fused variant differs by rounding in 1 - beta2). Losses must
agree to rtol 1e-5 and the trained (policy) params to rtol 1e-4 / atol 1e-6: the engine's CPU
Adam and torch's AdamW agree to fp32 rounding, and a clipping replay adds a few ulp.

TRL's defaults are overridden where they would change what is compared: ``bf16`` defaults to
True even on CPU (slow autocast, and bf16 rounding would swamp the comparison), gradient
checkpointing defaults to on, the default learning rates (2e-5 SFT, 1e-6 DPO) barely move a
random model, and ``logging_steps`` defaults to 10.

``adam_epsilon=1e-6`` rather than 1e-8: in a tiny random model some gradient entries are ~1e-9,
where ``sqrt(v_hat)`` is comparable to a 1e-8 eps and the update ``m_hat / (sqrt(v_hat) + eps)``
amplifies one ulp of difference in ``v`` into a visible change of the param. A larger eps keeps
that ratio well conditioned, so the comparison tests the integration, not Adam's conditioning.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may touch the network

from pathlib import Path

import pytest
import torch
from cpu_trainer_args import ADAMW_REFERENCE, SEED, cpu_training_args, no_checkpointing
from datasets import Dataset
from test_integration_trainer import _assert_params_close, _params
from transformers import TrainerCallback
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

from hf_superoffload import (
    SuperOffloadDPOConfig,
    SuperOffloadDPOTrainer,
    SuperOffloadSFTConfig,
    SuperOffloadSFTTrainer,
)
from hf_superoffload.toy import build_tiny_llama, make_char_tokenizer

DATA_FILE = Path(__file__).resolve().parents[1] / "examples" / "data" / "arithmetic_sft.jsonl"
BUCKET_SIZE = 1 << 14  # the 0.14M-param toy model in ~10 buckets


# One intra-op thread for these tiny models (conftest.py says why).
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _rows(n: int) -> list[dict[str, str]]:
    with open(DATA_FILE, encoding="utf-8") as f:
        return [json.loads(line) for _, line in zip(range(n), f, strict=False)]


def _common_args(output_dir, **overrides) -> dict:
    # TRL sets `gradient_checkpointing` to True by default (SFTConfig and DPOConfig share the
    # name); `no_checkpointing` turns it off under this transformers' name for it.
    kwargs = {**ADAMW_REFERENCE, **no_checkpointing(SFTConfig), "max_length": 64}
    return cpu_training_args(output_dir, **{**kwargs, "data_seed": SEED, **overrides})


def _step_losses(trainer) -> list[float]:
    return [log["loss"] for log in trainer.state.log_history if "loss" in log and "step" in log]


# ------------------------------------------------------------------------------------- SFT


def _sft(output_dir, superoffload: bool, steps: int):
    kwargs = _common_args(output_dir, max_steps=steps, per_device_train_batch_size=16)
    if superoffload:
        config = SuperOffloadSFTConfig(superoffload_bucket_size=BUCKET_SIZE, **kwargs)
        cls = SuperOffloadSFTTrainer
    else:
        config, cls = SFTConfig(**kwargs), SFTTrainer
    trainer = cls(
        model=build_tiny_llama(seed=SEED),
        args=config,
        train_dataset=Dataset.from_list(_rows(200)),
        processing_class=make_char_tokenizer(),
    )
    trainer.train()
    return trainer


def test_sft_same_losses_and_params_as_sfttrainer(tmp_path):
    """SuperOffloadSFTTrainer follows SFTTrainer + AdamW on the bundled prompt-completion data."""
    steps = 10
    ours = _sft(tmp_path / "ours", True, steps)
    ref = _sft(tmp_path / "ref", False, steps)

    assert not ours.args.bf16 and next(ours.model.parameters()).dtype == torch.float32
    ours_losses, ref_losses = _step_losses(ours), _step_losses(ref)
    assert len(ours_losses) == len(ref_losses) == steps
    torch.testing.assert_close(ours_losses, ref_losses, rtol=1e-5, atol=0)
    assert ours_losses[-1] < ours_losses[0]  # it learned something: the comparison is not vacuous
    _assert_params_close(_params(ours.model), _params(ref.model))
    stats = ours.superoffload_stats
    assert stats["steps"] == steps and stats["rollbacks_nonfinite"] == 0
    assert (
        ours.superoffload_optimizer is not None
    )  # kept after train(), as SFTTrainer keeps its own
    ours.superoffload_optimizer.close()


# ------------------------------------------------------------------------------------- DPO


def _preference_rows(n: int) -> list[dict[str, str]]:
    """Arithmetic prompts; chosen is the right answer, rejected a wrong one (off by 1..9)."""
    rows = []
    for i, row in enumerate(_rows(n)):
        wrong = str(int(row["completion"]) + 1 + i % 9)
        rows.append({"prompt": row["prompt"], "chosen": row["completion"], "rejected": wrong})
    return rows


class _CheckRefNotManaged(TrainerCallback):
    """During training: every policy param is in the optimizer's buckets, no reference param
    is (no hooks, no slot), and the reference params are the same tensors as at the start."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.ref_ptrs = {n: p.data_ptr() for n, p in trainer.ref_model.named_parameters()}
        self.checked = 0

    def on_step_end(self, args, state, control, **kwargs):
        optimizer = self.trainer.superoffload_optimizer
        assert optimizer is not None
        policy = [p for p in self.trainer.model.parameters() if p.requires_grad]
        assert all(optimizer.manages(p) for p in policy)
        assert all(p._post_accumulate_grad_hooks for p in policy)  # the attribute checked below
        assert any(m._forward_pre_hooks for m in self.trainer.model.modules())
        ref_modules = list(self.trainer.ref_model.modules())
        assert not any(m._forward_pre_hooks for m in ref_modules)  # no waits for CPU updates
        for name, param in self.trainer.ref_model.named_parameters():
            assert not optimizer.manages(param), name
            assert not getattr(param, "_post_accumulate_grad_hooks", None), name
            assert param.data_ptr() == self.ref_ptrs[name], name
            assert param.grad is None, name
        self.checked += 1


def _dpo(output_dir, superoffload: bool, steps: int, precompute: bool):
    kwargs = _common_args(
        output_dir,
        max_steps=steps,
        per_device_train_batch_size=8,
        precompute_ref_log_probs=precompute,
    )
    if superoffload:
        config = SuperOffloadDPOConfig(superoffload_bucket_size=BUCKET_SIZE, **kwargs)
        cls = SuperOffloadDPOTrainer
    else:
        config, cls = DPOConfig(**kwargs), DPOTrainer
    ref_model = build_tiny_llama(seed=SEED)
    ref_before = _params(ref_model)
    trainer = cls(
        model=build_tiny_llama(seed=SEED),
        ref_model=ref_model,
        args=config,
        train_dataset=Dataset.from_list(_preference_rows(8 * steps)),
        processing_class=make_char_tokenizer(),
    )
    check = _CheckRefNotManaged(trainer) if superoffload else None
    if check is not None:
        trainer.add_callback(check)
    trainer.train()
    return trainer, ref_before, check


@pytest.mark.parametrize("precompute", [True, False], ids=["precompute-ref", "live-ref"])
def test_dpo_same_losses_and_params_as_dpotrainer(tmp_path, precompute):
    """SuperOffloadDPOTrainer follows DPOTrainer + AdamW; only the policy is offloaded, the
    reference model is untouched by the optimizer."""
    steps = 6
    ours, ours_ref_before, check = _dpo(tmp_path / "ours", True, steps, precompute)
    ref, _, _ = _dpo(tmp_path / "ref", False, steps, precompute)

    assert check.checked == steps
    ours_losses, ref_losses = _step_losses(ours), _step_losses(ref)
    assert len(ours_losses) == len(ref_losses) == steps
    torch.testing.assert_close(ours_losses, ref_losses, rtol=1e-5, atol=0)
    assert ours_losses[-1] < ours_losses[0]  # the policy moved towards the chosen answers
    _assert_params_close(_params(ours.model), _params(ref.model))

    assert ours.ref_model is not None
    ref_after = _params(ours.ref_model)
    _assert_params_close(ref_after, ours_ref_before, rtol=0, atol=0)
    # The policy did move away from the (identical at start) reference.
    assert any(not torch.equal(p, ref_after[n]) for n, p in _params(ours.model).items())
    assert ours.superoffload_stats["steps"] == steps
