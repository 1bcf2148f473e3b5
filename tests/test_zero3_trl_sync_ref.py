"""TR-DPO (``sync_ref_model=True``) with SuperOffloadDPOTrainer on DeepSpeed ZeRO-3.

TRL syncs under ZeRO-3 inside ``GatheredParameters(policy + reference params)``, which gathers
through the param of lowest ds_id. Our ZeRO-3 optimizer makes the policy params' gathers wait
for their CPU updates, but models built outside ZeRO-3's Init get their ds_ids when DeepSpeed
wraps them: the reference in DPOTrainer's ``__init__``, the policy when ``train()`` starts. The
reference's param then comes first and its gather waits for nothing, so TRL would copy a policy
whose updates are still in flight. With ``ref_model_mixup_alpha=1`` and a sync every step, the
reference must equal the policy exactly after each step.

One spawned process (DeepSpeed needs its distributed environment), CPU accelerator, fp32, the
download-free toy model; every task of the optimizer's worker starts late, so updates are in
flight when step() returns on every step.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch
from ranks import set_rank_env, spawn_ranks
from zero3_reference import free_port, trainer_zero3_config

STEPS = 3
LATE_S = 0.02  # how late each task of the optimizer's worker starts


def _tr_dpo(rank, port, out_dir) -> None:
    set_rank_env(0, 1, port)
    torch.set_num_threads(1)
    import deepspeed
    from datasets import Dataset
    from test_integration_trl import _preference_rows
    from transformers import TrainerCallback

    from hf_superoffload import SuperOffloadDPOConfig, SuperOffloadDPOTrainer
    from hf_superoffload.toy import build_tiny_llama, make_char_tokenizer

    args = SuperOffloadDPOConfig(
        output_dir=out_dir,
        max_steps=STEPS,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        adam_epsilon=1e-6,
        max_grad_norm=1.0,
        bf16=False,
        max_length=64,
        logging_steps=1,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        data_seed=0,
        sync_ref_model=True,
        ref_model_sync_steps=1,
        ref_model_mixup_alpha=1.0,
        deepspeed=copy.deepcopy(trainer_zero3_config()),
    )
    trainer = SuperOffloadDPOTrainer(
        model=build_tiny_llama(seed=0),
        ref_model=build_tiny_llama(seed=0),
        args=args,
        train_dataset=Dataset.from_list(_preference_rows(8 * STEPS)),
        processing_class=make_char_tokenizer(),
    )
    pairs: list[tuple[dict, dict]] = []
    first_ids = []  # the lowest ds_id of the reference and of the policy

    class LateUpdates(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            worker = trainer.deepspeed.optimizer._stv.worker
            submit = worker.submit
            worker.submit = lambda keys, task: submit(keys, lambda: (time.sleep(LATE_S), task()))

    class RecordAfterSync(TrainerCallback):  # after TRL's SyncRefModelCallback
        def on_step_end(self, args, state, control, **kwargs):
            # TRL wraps the reference in a DeepSpeed engine: its names start with "module.".
            ref_params = dict(trainer.ref_model.module.named_parameters())
            with deepspeed.zero.GatheredParameters(list(ref_params.values())):
                ref = {n: p.detach().clone() for n, p in ref_params.items()}
            trainer.deepspeed.optimizer.synchronize()  # the policy as the step made it
            params = dict(trainer.model.named_parameters())
            with deepspeed.zero.GatheredParameters(list(params.values())):
                stepped = {n: p.detach().clone() for n, p in params.items()}
            pairs.append((ref, stepped))
            first_ids.append([min(p.ds_id for p in ps.values()) for ps in (ref_params, params)])

    trainer.add_callback(LateUpdates())
    trainer.add_callback(RecordAfterSync())
    trainer.train()
    assert type(trainer.deepspeed.optimizer).__name__ == "SuperOffloadZero3Optimizer"
    trainer.deepspeed.destroy()
    torch.save({"pairs": pairs, "first_ids": first_ids}, f"{out_dir}/results.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("zero3_tr_dpo")
    spawn_ranks(_tr_dpo, (free_port(), str(out)), world=1)
    return torch.load(out / "results.pt", weights_only=False)


def test_zero3_tr_dpo_reference_is_the_stepped_policy(runs):
    pairs = runs["pairs"]
    assert len(pairs) == STEPS
    # TRL's gather goes through a reference param: the policy's gather waits do not cover it.
    assert all(ref_id < policy_id for ref_id, policy_id in runs["first_ids"])
    for ref, policy in pairs:
        assert ref.keys() == policy.keys()
        for name in policy:
            torch.testing.assert_close(ref[name], policy[name], rtol=0, atol=0, msg=name)
    # The policy moved: the comparisons are not between untouched copies.
    assert any(not torch.equal(p, pairs[-1][1][n]) for n, p in pairs[0][1].items())
