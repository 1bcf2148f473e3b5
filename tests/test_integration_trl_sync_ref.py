"""TR-DPO (``sync_ref_model=True``) with SuperOffloadDPOTrainer, on CPU.

TRL's SyncRefModelCallback mixes the policy into the reference at the end of a sync step,
reading the policy's params directly, while step() may return with CPU Adam updates still in
flight. With ``ref_model_mixup_alpha=1`` and a sync every step, the reference must equal the
policy after each step, and both must follow TRL's DPOTrainer with torch's AdamW (which also
fixes the reference each step's loss is computed against).

Each task of the optimizer's worker starts late, so updates are in flight when step() returns
on every step, not only when the machine is busy.
"""

from __future__ import annotations

import time

import pytest
import torch
from cpu_trainer_args import SEED
from datasets import Dataset
from test_integration_trainer import _assert_params_close, _params
from test_integration_trl import BUCKET_SIZE, _common_args, _preference_rows, _step_losses
from transformers import TrainerCallback
from trl import DPOConfig, DPOTrainer

from hf_superoffload import SuperOffloadDPOConfig, SuperOffloadDPOTrainer
from hf_superoffload.toy import build_tiny_llama, make_char_tokenizer

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

STEPS = 5
LATE_S = 0.02  # how late each task of the optimizer's worker starts


class _LateUpdates(TrainerCallback):
    """Every task of the optimizer's worker starts ``LATE_S`` late: the updates a step queues
    (during backward, and in step()) are still in flight when step() returns."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        worker = self.trainer.superoffload_optimizer._stv.worker
        submit = worker.submit

        def submit_late(buckets, task):
            submit(buckets, lambda: (time.sleep(LATE_S), task()))

        worker.submit = submit_late


class _RecordAfterSync(TrainerCallback):
    """Added after TRL's SyncRefModelCallback: the reference as TRL left it, then the policy
    (its updates landed first: the value the step gave it)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.refs: list[dict] = []
        self.policies: list[dict] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.refs.append(_params(self.trainer.ref_model))
        optimizer = getattr(self.trainer, "superoffload_optimizer", None)
        if optimizer is not None:
            optimizer.synchronize()
        self.policies.append(_params(self.trainer.model))


def _tr_dpo(output_dir, superoffload: bool):
    kwargs = _common_args(
        output_dir,
        max_steps=STEPS,
        per_device_train_batch_size=8,
        sync_ref_model=True,
        ref_model_sync_steps=1,
        ref_model_mixup_alpha=1.0,
    )
    if superoffload:
        config = SuperOffloadDPOConfig(superoffload_bucket_size=BUCKET_SIZE, **kwargs)
        cls = SuperOffloadDPOTrainer
    else:
        config, cls = DPOConfig(**kwargs), DPOTrainer
    trainer = cls(
        model=build_tiny_llama(seed=SEED),
        ref_model=build_tiny_llama(seed=SEED),
        args=config,
        train_dataset=Dataset.from_list(_preference_rows(8 * STEPS)),
        processing_class=make_char_tokenizer(),
    )
    record = _RecordAfterSync(trainer)
    trainer.add_callback(record)
    if superoffload:
        trainer.add_callback(_LateUpdates(trainer))
    trainer.train()
    return trainer, record


def test_tr_dpo_reference_is_the_stepped_policy(tmp_path):
    ours, ours_record = _tr_dpo(tmp_path / "ours", True)
    ref, ref_record = _tr_dpo(tmp_path / "ref", False)
    try:
        assert len(ours_record.refs) == len(ref_record.refs) == STEPS
        for step in range(STEPS):
            # TRL's copy: exactly the policy the step gave, on every step.
            _assert_params_close(ours_record.refs[step], ours_record.policies[step], 0, 0)
            _assert_params_close(ours_record.policies[step], ref_record.policies[step])
            _assert_params_close(ours_record.refs[step], ref_record.refs[step])
        ours_losses, ref_losses = _step_losses(ours), _step_losses(ref)
        assert len(ours_losses) == STEPS
        torch.testing.assert_close(ours_losses, ref_losses, rtol=1e-5, atol=0)
        # The policy moved: the comparisons are not between untouched copies.
        first, last = ours_record.policies[0], ours_record.policies[-1]
        assert any(not torch.equal(p, last[n]) for n, p in first.items())
        assert ours.superoffload_stats["steps"] == STEPS
    finally:
        ours.superoffload_optimizer.close()


def test_refused_when_trl_syncs_without_its_callback(tmp_path, monkeypatch):
    """A TRL whose DPOTrainer syncs the reference some other way: refused when the trainer is
    built (the wait could not be ordered before that sync)."""
    import hf_superoffload.integrations.trl as ours

    monkeypatch.setattr(ours, "SyncRefModelCallback", type("OtherCallback", (), {}))
    config = SuperOffloadDPOConfig(
        superoffload_bucket_size=BUCKET_SIZE,
        **_common_args(tmp_path, max_steps=1, sync_ref_model=True),
    )
    with pytest.raises(RuntimeError, match="set sync_ref_model=False"):
        SuperOffloadDPOTrainer(
            model=build_tiny_llama(seed=SEED),
            ref_model=build_tiny_llama(seed=SEED),
            args=config,
            train_dataset=Dataset.from_list(_preference_rows(8)),
            processing_class=make_char_tokenizer(),
        )
