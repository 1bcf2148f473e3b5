"""`SuperOffloadTrainer` against the plain `transformers.Trainer` with torch's AdamW, on CPU.

Every comparison trains the same tiny random Llama (`hf_superoffload.toy`) on the same random
token batches twice: once with `SuperOffloadTrainer` (`SuperOffloadTrainingArguments`, small
buckets so that several host buckets speculate, replay and roll back, and the "auto" device
tail takes one bucket) and once with `Trainer(optim="adamw_torch")`, torch's default AdamW
arithmetic (the fused variant forms 1 - beta2 in fp32 and differs by rounding). Both runs use
the same seed, so they see the same batches in the same order.

Tolerances: per-step losses rtol 1e-5, logged pre-clip grad norms rtol 1e-4, final params
rtol 1e-4 / atol 1e-6. Measured differences are about 1e-6 relative on losses, 5e-6 relative
on grad norms and 1.2e-7 absolute on params: the engine's CPU Adam and torch's AdamW agree to
fp32 rounding, and a clipping replay adds a few ulp of the undone update.

``adam_epsilon=1e-6`` rather than the Trainer's 1e-8: in a tiny random model some gradient
entries are ~1e-9, where ``sqrt(v_hat)`` is comparable to a 1e-8 eps and the update
``m_hat / (sqrt(v_hat) + eps)`` amplifies one ulp of difference in ``v`` into a visible
change of the param. A larger eps keeps that ratio well conditioned, so the comparison tests
the integration rather than the conditioning of Adam on near-zero gradients.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may touch the network

import threading
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType
from cpu_trainer_args import ADAMW_REFERENCE, SEED, cpu_training_args
from safetensors.torch import load_file
from transformers import Trainer, TrainerCallback, TrainingArguments, get_scheduler

from hf_superoffload import (
    SuperOffloadOptimizer,
    SuperOffloadTrainer,
    SuperOffloadTrainingArguments,
)
from hf_superoffload.integrations.checks import check_supported
from hf_superoffload.toy import build_tiny_llama, tiny_llama_config

VOCAB = 64
SEQ_LEN = 16
BATCH = 4
N_SAMPLES = 96  # 24 batches: one epoch covers 12 steps of 2 accumulated micro-batches
STEPS = 12
LR = ADAMW_REFERENCE["learning_rate"]
WARMUP = ADAMW_REFERENCE["warmup_steps"]
# ~37k params in ~14 buckets: several host buckets plus one "auto" device-tail bucket.
BUCKET_SIZE = 1 << 12
WORKER_PREFIX = "hf_superoffload-worker"


# One intra-op thread for these tiny models (conftest.py says why).
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


# ------------------------------------------------------------------------------------ helpers


def _model():
    config = tiny_llama_config(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4)
    return build_tiny_llama(config, seed=SEED)


def _dataset(n_samples: int = N_SAMPLES):
    generator = torch.Generator().manual_seed(1234)
    ids = torch.randint(4, VOCAB, (n_samples, SEQ_LEN), generator=generator)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def _args(output_dir, superoffload: bool, **overrides) -> TrainingArguments:
    kwargs = {**ADAMW_REFERENCE, "max_steps": STEPS, "per_device_train_batch_size": BATCH}
    kwargs = cpu_training_args(output_dir, **{**kwargs, "data_seed": SEED, **overrides})
    if superoffload:
        kwargs.setdefault("superoffload_bucket_size", BUCKET_SIZE)
        return SuperOffloadTrainingArguments(**kwargs)
    return TrainingArguments(**kwargs)


def _trainer(output_dir, superoffload: bool, callbacks=(), n_samples=N_SAMPLES, **overrides):
    cls = SuperOffloadTrainer if superoffload else Trainer
    return cls(
        model=_model(),
        args=_args(output_dir, superoffload, **overrides),
        train_dataset=_dataset(n_samples),
        callbacks=list(callbacks),
    )


def _step_logs(trainer) -> list[dict]:
    return [log for log in trainer.state.log_history if "loss" in log and "step" in log]


def _params(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _assert_params_close(actual: dict, expected: dict, rtol=1e-4, atol=1e-6) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(
            actual[name], expected[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}"
        )


def _worker_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(WORKER_PREFIX) and t.is_alive()}


def _schedule(steps: int = STEPS) -> list[float]:
    """The lr of each step under the runs' schedule (what the Trainer logs, before it steps)."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
    scheduler = get_scheduler(
        "linear", optimizer, num_warmup_steps=WARMUP, num_training_steps=STEPS
    )
    lrs = []
    for _ in range(steps):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return lrs


# ------------------------------------------------------------------------ trajectory vs Trainer


@pytest.mark.parametrize(
    ("accumulation", "max_grad_norm", "n_samples"),
    [
        pytest.param(1, 1.0, N_SAMPLES, id="accum1-clip1"),
        pytest.param(2, 1.0, N_SAMPLES, id="accum2-clip1"),
        pytest.param(1, 0.05, N_SAMPLES, id="accum1-clip0.05"),
        pytest.param(1, 0.0, N_SAMPLES, id="accum1-noclip"),
        pytest.param(2, 1.0, 5 * BATCH, id="accum2-partial-window"),
    ],
)
def test_same_trajectory_as_trainer_adamw(tmp_path, accumulation, max_grad_norm, n_samples):
    """Same per-step losses, logged pre-clip grad norms and final params as Trainer + AdamW.

    ``max_grad_norm=0`` turns clipping off; the Trainer then asks for the norm alone (for the
    log), which the engine answers from its backward-time bucket norms. "partial-window": 5
    batches per epoch with accumulation 2, so every epoch ends with a 1-batch window (the
    Trainer syncs at the epoch's last batch) and the run crosses 4 epochs; there the 1-batch
    windows clip and the 2-batch ones do not, so committed, replayed and not-speculated steps
    (the one after a clipped step) alternate. With the full data, clip 1.0 clips every step.
    """
    overrides = {"gradient_accumulation_steps": accumulation, "max_grad_norm": max_grad_norm}
    ours = _trainer(tmp_path / "ours", True, n_samples=n_samples, **overrides)
    ours.train()
    ref = _trainer(tmp_path / "ref", False, n_samples=n_samples, **overrides)
    ref.train()

    ours_logs, ref_logs = _step_logs(ours), _step_logs(ref)
    assert len(ours_logs) == len(ref_logs) == STEPS
    assert [log["step"] for log in ours_logs] == list(range(1, STEPS + 1))
    torch.testing.assert_close(
        [log["loss"] for log in ours_logs], [log["loss"] for log in ref_logs], rtol=1e-5, atol=0
    )
    assert all("grad_norm" in log for log in ours_logs + ref_logs)
    ours_norms = [log["grad_norm"] for log in ours_logs]
    ref_norms = [log["grad_norm"] for log in ref_logs]
    assert all(math.isfinite(n) and n > 0 for n in ours_norms)
    torch.testing.assert_close(ours_norms, ref_norms, rtol=1e-4, atol=0)
    assert [log["learning_rate"] for log in ours_logs] == [log["learning_rate"] for log in ref_logs]
    _assert_params_close(_params(ours.model), _params(ref.model))

    stats = ours.superoffload_stats
    assert stats["steps"] == STEPS
    assert stats["rollbacks_nonfinite"] == 0
    assert stats["rollbacks_hparams"] == 0  # the lr is set before backward, never redone
    if max_grad_norm == 0.05:  # the case must really clip, on every step
        assert min(ref_norms) > 0.05
        # Replayed, or withheld when the norm seen so far already clipped (nothing to undo).
        assert stats["rollbacks_clip"] + stats["speculations_withheld"] > 0
    if n_samples != N_SAMPLES:  # a mixed regime: some steps clip, some do not
        assert min(ref_norms) < max_grad_norm < max(ref_norms)
        assert 0 < stats["rollbacks_clip"] < stats["speculative_steps"]
    if max_grad_norm == 0.0:  # every step speculates and commits
        assert stats["rollbacks_clip"] == 0
        assert stats["speculative_steps"] == STEPS


# ------------------------------------------------------------------------------- the optimizer


def test_optimizer_built_from_training_arguments(tmp_path):
    """Decay/no-decay groups follow ``get_decay_parameter_names``; hyperparameters come from
    the arguments; the groups equal the ones the plain Trainer builds for the same args."""
    overrides = {
        "learning_rate": 3e-4,
        "adam_beta1": 0.8,
        "adam_beta2": 0.95,
        "adam_epsilon": 1e-7,
        "weight_decay": 0.05,
        "max_grad_norm": 0.5,
        "gradient_accumulation_steps": 3,
    }
    trainer = _trainer(tmp_path / "ours", True, **overrides)
    optimizer = trainer.create_optimizer()
    try:
        assert isinstance(optimizer, SuperOffloadOptimizer)
        assert trainer.superoffload_optimizer is optimizer
        assert trainer.create_optimizer() is optimizer  # built once

        model = trainer.model
        names = {id(p): n for n, p in model.named_parameters()}
        decay = set(trainer.get_decay_parameter_names(model))
        assert decay and decay != set(names.values())  # a real split: norms do not decay
        groups = optimizer.param_groups
        assert len(groups) == 2
        assert {names[id(p)] for p in groups[0]["params"]} == decay
        assert {names[id(p)] for p in groups[1]["params"]} == set(names.values()) - decay
        assert groups[0]["weight_decay"] == 0.05
        assert groups[1]["weight_decay"] == 0.0
        for group in groups:
            assert group["lr"] == 3e-4
            assert tuple(group["betas"]) == (0.8, 0.95)
            assert group["eps"] == 1e-7
        assert optimizer.max_grad_norm == 0.5
        assert optimizer.gradient_accumulation_steps == 3

        ref = _trainer(tmp_path / "ref", False, **overrides)
        ref_groups = ref.create_optimizer().param_groups
        ref_names = {id(p): n for n, p in ref.model.named_parameters()}
        for ours_group, ref_group in zip(groups, ref_groups, strict=True):
            assert [names[id(p)] for p in ours_group["params"]] == [
                ref_names[id(p)] for p in ref_group["params"]
            ]
            for key in ("lr", "betas", "eps", "weight_decay"):
                assert ours_group[key] == ref_group[key], key
    finally:
        optimizer.close()


# ------------------------------------------------------------------------- non-finite gradients


class _NanGradsAtStep(TrainerCallback):
    """Makes one param's gradient NaN during optimizer step ``step`` (0-based), and snapshots
    every param's fp32 master and Adam moments around that step."""

    def __init__(self, trainer, param_name: str, step: int):
        self.trainer, self.param_name, self.step = trainer, param_name, step
        self.handle = None
        self.before = self.after = None

    def _snapshot(self):
        optimizer = self.trainer.superoffload_optimizer
        optimizer.synchronize()
        return {
            name: {**optimizer.master_state(p), "param": p.detach().clone()}
            for name, p in self.trainer.model.named_parameters()
        }

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.before = self._snapshot()
            param = self.trainer.model.get_parameter(self.param_name)
            self.handle = param.register_hook(lambda grad: torch.full_like(grad, math.nan))

    def on_step_end(self, args, state, control, **kwargs):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
            self.after = self._snapshot()


@pytest.mark.parametrize(
    "param_name",
    ["lm_head.weight", "model.embed_tokens.weight"],
    ids=["first-bucket", "last-bucket"],
)
def test_nonfinite_gradients_skip_the_step(tmp_path, param_name):
    """NaN gradients in one param: the step is undone (params, fp32 master and both moments as
    before it), the LR schedule holds for that step, the counter says one skip, training goes
    on. ``lm_head`` gets its gradient first (nothing speculated before the NaN: bit-exact);
    the embedding gets it last (every host bucket was speculated and is rolled back)."""
    bad = 4
    # No clipping on this model (norms ~1.2), so every step speculates, the bad one included.
    trainer = _trainer(tmp_path, True, max_grad_norm=10.0)
    nan_grads = _NanGradsAtStep(trainer, param_name, bad)
    trainer.add_callback(nan_grads)
    trainer.train()

    assert trainer.state.global_step == STEPS
    assert trainer.superoffload_stats["rollbacks_nonfinite"] == 1
    assert trainer.superoffload_stats["steps"] == STEPS
    assert trainer.superoffload_stats["speculative_steps"] == STEPS
    assert trainer.superoffload_stats["rollbacks_clip"] == 0

    logs = _step_logs(trainer)
    assert len(logs) == STEPS
    assert not math.isfinite(logs[bad]["grad_norm"])
    assert all(math.isfinite(log["grad_norm"]) for i, log in enumerate(logs) if i != bad)
    assert all(math.isfinite(log["loss"]) for log in logs)
    # The scheduler did not step after the skipped step: its lr is used again by the next one.
    lrs = [log["learning_rate"] for log in logs]
    schedule = _schedule()
    assert lrs == schedule[: bad + 1] + schedule[bad : STEPS - 1]
    assert lrs[bad] == lrs[bad + 1]

    exact = param_name == "lm_head.weight"
    tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-6, "atol": 1e-7}
    for name, before in nan_grads.before.items():
        after = nan_grads.after[name]
        assert after["step"] == before["step"], name
        for key in ("param", "master", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(after[key], before[key], **tol, msg=f"{name} {key}")
            assert torch.isfinite(after[key]).all(), f"{name} {key}"
    assert any(before["step"] == bad for before in nan_grads.before.values())

    # Training went on after the skip: params moved, and stayed finite.
    final = _params(trainer.model)
    for name, value in final.items():
        assert torch.isfinite(value).all(), name
    assert any(not torch.equal(final[name], nan_grads.after[name]["param"]) for name in final), (
        "no param changed after the skipped step"
    )


# ---------------------------------------------------------------------------- clip counters


@pytest.mark.parametrize(("max_grad_norm", "clipped"), [(1e-3, True), (1e6, False)])
def test_clip_rollbacks_counted(tmp_path, max_grad_norm, clipped):
    """A tiny threshold clips (speculated updates are replayed); a huge one never does."""
    trainer = _trainer(tmp_path, True, max_steps=4, max_grad_norm=max_grad_norm)
    trainer.train()
    stats = trainer.superoffload_stats
    assert stats["steps"] == 4
    assert stats["speculative_steps"] > 0
    if clipped:
        # Replayed, or withheld when the norm seen so far already clipped (nothing to undo).
        assert stats["rollbacks_clip"] + stats["speculations_withheld"] > 0
    else:
        assert stats["rollbacks_clip"] == 0
        assert stats["speculative_steps"] == 4


# ------------------------------------------------------------------------------- checkpoints


def test_a_plain_trainers_checkpoint_resumes_with_its_fp32_weights_as_the_masters(tmp_path):
    """A plain Trainer's checkpoint (fp32 weights, torch AdamW's optimizer.pt: no masters)
    resumed by a bf16 SuperOffloadTrainer: the masters are the checkpoint's fp32 weights, not
    the model's bf16 rounding of them; the moments are AdamW's."""
    args = {"max_steps": 2, "save_strategy": "steps", "save_steps": 2}
    plain = _trainer(tmp_path / "plain", False, **args)
    plain.train()
    checkpoint = tmp_path / "plain" / "checkpoint-2"
    weights = load_file(checkpoint / "model.safetensors")
    adamw = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    loaded = {}

    class AfterTheLoad(TrainerCallback):  # the Trainer has loaded the checkpoint by now
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            opt = resumed.superoffload_optimizer
            names = {id(p): n for n, p in model.named_parameters()}
            for param in (p for group in opt.param_groups for p in group["params"]):
                loaded[names[id(param)]] = (param.dtype, opt.master_state(param))

    resumed = _trainer(tmp_path / "resumed", True, [AfterTheLoad()], bf16=True, **args)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    resumed.superoffload_optimizer.close()
    assert len(loaded) == len(adamw["state"])
    for index, (name, (dtype, state)) in enumerate(loaded.items()):
        assert dtype == torch.bfloat16
        assert torch.equal(state["master"], weights[name]), name
        assert torch.equal(state["exp_avg"], adamw["state"][index]["exp_avg"]), name


def test_resume_from_a_checkpoint_without_the_optimizer_state_is_refused(tmp_path):
    """A save_only_model checkpoint: the plain Trainer would go on at its step with fresh
    moments and schedule; refused before training, naming what is missing."""
    args = {"max_steps": 2, "save_strategy": "steps", "save_steps": 1, "save_only_model": True}
    first = _trainer(tmp_path / "first", True, **args)
    first.train()
    first.superoffload_optimizer.close()
    checkpoint = tmp_path / "first" / "checkpoint-1"
    assert not (checkpoint / "optimizer.pt").exists()
    resumed = _trainer(tmp_path / "resumed", True, **args)
    with pytest.raises(ValueError, match=r"holds no optimizer.pt or scheduler.pt"):
        resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.superoffload_optimizer.stats["steps"] == 0  # no step taken
    resumed.superoffload_optimizer.close()


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0], ids=["clip-every-step", "noclip"])
def test_resume_from_checkpoint_matches_uninterrupted_run(tmp_path, max_grad_norm):
    """6 steps saving at step 3; a fresh trainer resumed from checkpoint-3 ends where the
    uninterrupted run ends, and the checkpoint holds the fp32 master and both moments.

    Without clipping the resumed run is bit-exact. With clip 1.0 every step of this model clips
    (norms ~1.15): the uninterrupted run's step 4 follows a clipped step and so is not
    speculated, while the resumed run's fresh optimizer speculates it and replays with the clip
    coefficient, whose rounding differs by a few ulp (measured: 3.7e-9 absolute).
    """
    ckpt_args = {
        "max_steps": 6,
        "save_strategy": "steps",
        "save_steps": 3,
        "max_grad_norm": max_grad_norm,
        # A fixed tail: "auto" moves buckets by measured timings, so on a loaded machine two
        # identical runs can place them differently, and tail and host buckets round
        # differently (a known defect, issue 11 item 6).
        "superoffload_gpu_tail": "2",
    }
    full = _trainer(tmp_path / "full", True, **ckpt_args)
    full.train()
    checkpoint = tmp_path / "full" / "checkpoint-3"
    assert (checkpoint / "optimizer.pt").is_file()

    resumed = _trainer(tmp_path / "resumed", True, **ckpt_args)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 6
    assert len([log for log in _step_logs(resumed) if log["step"] > 3]) == 3
    tol = {"rtol": 1e-6, "atol": 1e-8} if max_grad_norm else {"rtol": 0, "atol": 0}
    _assert_params_close(_params(resumed.model), _params(full.model), **tol)
    torch.testing.assert_close(
        [log["loss"] for log in _step_logs(resumed) if log["step"] > 3],
        [log["loss"] for log in _step_logs(full) if log["step"] > 3],
        **tol,
    )

    state = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    saved_params = load_file(checkpoint / "model.safetensors")
    names = [n for n, p in full.model.named_parameters() if p.requires_grad]
    decay = set(full.get_decay_parameter_names(full.model))
    ordered = [n for n in names if n in decay] + [n for n in names if n not in decay]
    assert len(state["param_groups"]) == 2
    assert sorted(state["state"]) == list(range(len(ordered)))
    for index, name in enumerate(ordered):
        entry = state["state"][index]
        assert entry["step"] == 3
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert entry[key].dtype == torch.float32, (name, key)
            assert entry[key].shape == saved_params[name].shape, (name, key)
        # The model is fp32, so its saved weights are the master itself.
        torch.testing.assert_close(entry["master"], saved_params[name], rtol=0, atol=0)
        assert entry["exp_avg"].abs().sum() > 0, name
        assert (entry["exp_avg_sq"] >= 0).all() and entry["exp_avg_sq"].sum() > 0, name


# ------------------------------------------------------------------------------- lifecycle


class _RecordWorkers(TrainerCallback):
    def __init__(self, before: set):
        self.before, self.seen = before, set()

    def on_step_end(self, args, state, control, **kwargs):
        self.seen |= _worker_threads() - self.before


def test_optimizer_outlives_train_until_closed(tmp_path):
    """train() ends with the optimizer synchronized but kept, as the plain Trainer keeps its
    own (tests/test_trainer_dropin.py trains twice); close() stops its worker thread."""
    record = _RecordWorkers(_worker_threads())
    trainer = _trainer(tmp_path, True, callbacks=[record], max_steps=2)
    trainer.train()
    assert record.seen, "no SuperOffload worker thread ran during training"
    optimizer = trainer.superoffload_optimizer
    assert isinstance(optimizer, SuperOffloadOptimizer)
    assert trainer.lr_scheduler is not None
    assert trainer.superoffload_stats["steps"] == 2
    optimizer.close()
    for thread in record.seen:
        thread.join(timeout=10)
    assert not any(thread.is_alive() for thread in record.seen)


def test_accelerate_leaves_the_optimizer_state_where_it_is(tmp_path, monkeypatch):
    """Accelerate's device placement would copy the whole state_dict to the GPU and back when
    it prepares the optimizer (12 B/param there): ours is prepared without placement."""
    calls = []
    original = SuperOffloadOptimizer.state_dict
    monkeypatch.setattr(
        SuperOffloadOptimizer, "state_dict", lambda self: calls.append(1) or original(self)
    )
    trainer = _trainer(tmp_path, True, max_steps=2)
    trainer.train()
    assert calls == []  # no save_strategy: nothing else reads the state either


# ----------------------------------------------------------------------------------- errors


def _stub(distributed_type, fp16=False):
    return SimpleNamespace(
        accelerator=SimpleNamespace(distributed_type=distributed_type, num_processes=1),
        args=SimpleNamespace(fp16=fp16),
    )


def test_refuses_fsdp():
    with pytest.raises(ValueError, match="cannot combine with FSDP; use a DeepSpeed ZeRO-3"):
        check_supported(_stub(DistributedType.FSDP))


def test_accepts_deepspeed():  # tests/test_zero3_trainer.py trains through it
    check_supported(_stub(DistributedType.DEEPSPEED))


def test_refuses_fp16():
    with pytest.raises(ValueError, match="fp16"):
        check_supported(_stub(DistributedType.NO, fp16=True))


def test_accepts_a_single_process_without_fp16():
    check_supported(_stub(DistributedType.NO))


@pytest.mark.parametrize("distributed_type", [DistributedType.MULTI_GPU, DistributedType.MULTI_CPU])
def test_accepts_data_parallelism(distributed_type):
    check_supported(_stub(distributed_type))  # tests/test_integration_trainer_ddp.py trains it


def test_refuses_other_distributed_types():
    with pytest.raises(ValueError, match="one process per GPU"):
        check_supported(_stub(DistributedType.XLA))
