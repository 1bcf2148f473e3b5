"""A CUDA out-of-memory error in forward or backward after gpu_tail='auto' grew the device
tail: the Trainer gives the tail back and runs the accumulation window again, once
(integrations/oom_retry.py).

The GPU tests force a real allocator failure (a forward hook asks for more than the card has)
and check that the buckets moved back free their device memory. On the CPU, where there is no
tail, the release is made to report one: the retried run ends with the params and moments of a
run without the error, bit for bit, with gradient accumulation and dropout; an out-of-memory
error with no tail to give back, or under data-parallel replicas, reaches the user as it came.
"""

from __future__ import annotations

import inspect
import logging
import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy
import pytest
import torch
from engine_reference import EXP_AVG_SQ_TOL, EXP_AVG_TOL, PARAM_TOL
from torch.utils.data import Dataset

from hf_superoffload import (
    SuperOffloadOptimizer,
    SuperOffloadTrainer,
    SuperOffloadTrainingArguments,
)
from hf_superoffload.toy import build_tiny_llama, tiny_llama_config

VOCAB, SEQ, STEPS = 64, 16, 6


class _Tokens(Dataset):
    def __init__(self, n: int = 64):
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(4, VOCAB, (n, SEQ), generator=gen)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _model(device: str, dropout: float = 0.0):
    config = tiny_llama_config(
        vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4, attention_dropout=dropout
    )
    return build_tiny_llama(config, seed=0).to(device)


class _FailOnce:
    """A forward pre-hook that makes the ``at``-th forward fail: on a GPU by asking the
    allocator for more than the card holds (a real CUDA out-of-memory error)."""

    def __init__(self, at: int, device: str):
        self.at, self.device, self.calls = at, device, 0

    def __call__(self, module, args):
        self.calls += 1
        if self.calls != self.at:
            return
        if self.device == "cuda":
            total = torch.cuda.get_device_properties(0).total_memory
            torch.empty(2 * total, dtype=torch.uint8, device="cuda")
        raise torch.OutOfMemoryError("simulated: no GPU to run out of")


class _FailInBackward:
    """A backward hook that raises an out-of-memory error in the ``at``-th backward pass,
    after the layers behind it have given their gradients."""

    def __init__(self, at: int):
        self.at, self.calls = at, 0

    def __call__(self, module, grad_input, grad_output):
        self.calls += 1
        if self.calls == self.at:
            raise torch.OutOfMemoryError("simulated: in the middle of a backward pass")


def _trainer(tmp_path, device: str, accumulation: int = 1, dropout: float = 0.0, **extra):
    args = SuperOffloadTrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=4,
        gradient_accumulation_steps=accumulation, learning_rate=1e-3, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=device == "cpu", bf16=False,
        superoffload_bucket_size=1 << 12, dataloader_num_workers=0, seed=0, **extra,
    )  # fmt: skip
    model = _model(device, dropout)
    # One epoch of whole windows: every step averages `accumulation` micro-batches.
    data = _Tokens(4 * STEPS * accumulation)
    return SuperOffloadTrainer(model=model, args=args, train_dataset=data)


def _trained_state(trainer) -> dict[str, torch.Tensor]:
    """Every param and both moments of each, after training."""
    opt = trainer.superoffload_optimizer
    state = {}
    for name, param in trainer.model.named_parameters():
        state[name] = param.detach().clone()
        for key, value in opt.master_state(param).items():
            if torch.is_tensor(value):
                state[f"{name}/{key}"] = value.detach().clone()
    opt.close()
    return state


def _pretend_a_tail(monkeypatch) -> None:
    """On the CPU there is no GPU tail: the release says it gave one back."""
    monkeypatch.setattr(SuperOffloadOptimizer, "releasable_device_tail", lambda self: 1)
    monkeypatch.setattr(SuperOffloadOptimizer, "release_device_tail", lambda self, reason: 1)


def _layer_noise_from_numpy_and_python(module, args, output):
    """Random draws a model may make outside torch (layer drop, masks): NumPy's and Python's."""
    factor = 1.0 + 1e-2 * float(numpy.random.randn()) + 1e-2 * random.random()
    return (output[0] * factor, *output[1:]) if isinstance(output, tuple) else output * factor


@pytest.mark.parametrize("accumulation", [1, 3])
@pytest.mark.parametrize("clipping", ["every step", "never"])
def test_a_retried_window_steps_as_if_nothing_had_failed(
    tmp_path, monkeypatch, accumulation, clipping
):
    """The error strikes step 2's last micro-batch half-way through its backward pass, after
    the earlier micro-batches of the window have given their gradients. The run then ends with
    a clean run's params and moments: the earlier micro-batches ran again, and the failing one,
    each with the random draws (torch's dropout, NumPy's, Python's) of the first time. When
    every step clips, nothing was speculated in the failed backward: bit for bit. When none
    does, the buckets that had speculated there were rolled back algebraically: equal within
    the rollback's bound, the engine's own tolerance against AdamW."""
    norm_cap = 1e-3 if clipping == "every step" else 1e6

    def run(path, fail: bool):
        trainer = _trainer(path, "cpu", accumulation, dropout=0.3, max_grad_norm=norm_cap)
        trainer.model.model.layers[1].register_forward_hook(_layer_noise_from_numpy_and_python)
        forwards = _FailOnce(0, "cpu")  # counts forward passes, fails none
        trainer.model.register_forward_pre_hook(forwards)
        if fail:
            trainer.model.model.layers[0].register_full_backward_hook(
                _FailInBackward(2 * accumulation)
            )
        trainer.train()
        return trainer, forwards.calls

    clean, clean_forwards = run(tmp_path / "clean", fail=False)
    expected = _trained_state(clean)
    _pretend_a_tail(monkeypatch)
    failing, forwards = run(tmp_path / "failing", fail=True)
    assert failing.superoffload_stats["oom_retries"] == 1
    assert forwards == clean_forwards + accumulation  # the window ran twice
    got = _trained_state(failing)
    assert got.keys() == expected.keys()
    speculated = clipping == "never"
    for name, value in expected.items():
        if not speculated:
            assert torch.equal(got[name], value), name
        else:
            tol = EXP_AVG_SQ_TOL if "exp_avg_sq" in name else (
                EXP_AVG_TOL if "exp_avg" in name else PARAM_TOL
            )  # fmt: skip
            torch.testing.assert_close(got[name], value, **tol, msg=name)
    losses = [e["loss"] for e in failing.state.log_history if "loss" in e]
    want = [e["loss"] for e in clean.state.log_history if "loss" in e]
    assert losses == want if not speculated else losses == pytest.approx(want, rel=1e-4)


def test_a_batch_that_is_not_a_dict_trains_as_on_the_trainer(tmp_path):
    """A collator may hand the step a tuple, which a compute_loss of the user's reads."""

    class TupleTrainer(SuperOffloadTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            ids, labels = inputs
            out = model(input_ids=ids, labels=labels)
            return (out.loss, out) if return_outputs else out.loss

    args = SuperOffloadTrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to=[],
        save_strategy="no", use_cpu=True, bf16=False, superoffload_bucket_size=1 << 12,
        dataloader_num_workers=0, remove_unused_columns=False,
    )  # fmt: skip
    trainer = TupleTrainer(
        model=_model("cpu"), args=args, train_dataset=_Tokens(8),
        data_collator=lambda rows: (torch.stack([r["input_ids"] for r in rows]),
                                    torch.stack([r["labels"] for r in rows])),
    )  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 2
    trainer.superoffload_optimizer.close()


def test_trl_metrics_of_a_retried_window_are_counted_once(tmp_path, monkeypatch):
    """TRL's SFTTrainer records each micro-batch's tokens and token accuracy beside the loss;
    after a retried window the logged values are those of a run without the error."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from test_integration_trl import BUCKET_SIZE, _common_args, _rows

    from hf_superoffload import SuperOffloadSFTConfig, SuperOffloadSFTTrainer
    from hf_superoffload.toy import make_char_tokenizer

    def logged(path, fail: bool):
        kwargs = _common_args(
            path, max_steps=4, per_device_train_batch_size=4, gradient_accumulation_steps=2
        )
        config = SuperOffloadSFTConfig(superoffload_bucket_size=BUCKET_SIZE, **kwargs)
        trainer = SuperOffloadSFTTrainer(
            model=build_tiny_llama(seed=0), args=config, train_dataset=Dataset.from_list(_rows(64)),
            processing_class=make_char_tokenizer(),
        )  # fmt: skip
        if fail:  # step 2's last micro-batch, in its backward pass
            trainer.model.model.layers[0].register_full_backward_hook(_FailInBackward(4))
        trainer.train()
        trainer.superoffload_optimizer.close()
        keys = ("num_tokens", "mean_token_accuracy", "entropy")
        return [{k: e[k] for k in keys} for e in trainer.state.log_history if "loss" in e]

    clean = logged(tmp_path / "clean", fail=False)
    _pretend_a_tail(monkeypatch)
    assert logged(tmp_path / "failing", fail=True) == clean


def test_out_of_memory_with_no_tail_to_give_back_changes_nothing(tmp_path, monkeypatch):
    """Raised as it came, before the step's gradients are discarded."""
    trainer = _trainer(tmp_path, "cpu")
    discards = []
    zero_grad = SuperOffloadOptimizer.zero_grad

    def counted(self, *args, **kwargs):
        discards.append(inspect.stack()[1].function)  # who discards the step's gradients
        return zero_grad(self, *args, **kwargs)

    monkeypatch.setattr(SuperOffloadOptimizer, "zero_grad", counted)
    trainer.model.register_forward_pre_hook(_FailOnce(3, "cpu"))
    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        trainer.train()
    assert "release_for_retry" not in discards
    assert trainer.superoffload_optimizer.stats["oom_retries"] == 0
    trainer.superoffload_optimizer.close()


def test_out_of_memory_under_replicas_is_raised_before_anything_changes(
    tmp_path, monkeypatch, caplog
):
    _pretend_a_tail(monkeypatch)
    monkeypatch.setattr(SuperOffloadOptimizer, "replica_count", property(lambda self: 2))
    trainer = _trainer(tmp_path, "cpu")
    trainer.model.register_forward_pre_hook(_FailOnce(3, "cpu"))
    with (
        caplog.at_level(logging.WARNING, logger="hf_superoffload"),
        pytest.raises(torch.OutOfMemoryError, match="simulated"),
    ):
        trainer.train()
    assert "with 2 data-parallel replicas: not retried" in caplog.text
    assert trainer.superoffload_optimizer.stats["oom_retries"] == 0
    trainer.superoffload_optimizer.close()


@pytest.mark.gpu
@pytest.mark.parametrize("accumulation", [1, 2])
def test_out_of_memory_gives_the_tail_back_and_retries_the_batch_once(
    tmp_path, caplog, accumulation
):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    trainer = _trainer(tmp_path, "cuda", accumulation)
    fail = _FailOnce(2 * accumulation, "cuda")  # step 2's last micro-batch
    trainer.model.register_forward_pre_hook(fail)
    with caplog.at_level(logging.WARNING, logger="hf_superoffload"):
        trainer.train()
    stats = trainer.superoffload_stats
    assert stats["oom_retries"] == 1
    assert stats["gpu_tail_buckets"] == 0  # the whole tail went back to the host
    assert trainer.state.global_step == STEPS  # the run went on to the end
    assert fail.calls == STEPS * accumulation + accumulation  # the window ran twice
    assert "CUDA out of memory at optimizer step" in caplog.text
    if accumulation == 2:  # the failing forward was the window's second: both ran again
        assert "running the 2 micro-batches of this accumulation window again" in caplog.text
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses)))
    trainer.superoffload_optimizer.close()


@pytest.mark.gpu
def test_buckets_moved_back_free_their_gpu_memory():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = _model("cuda")
    opt = SuperOffloadOptimizer(model.parameters(), model=model, bucket_size=1 << 12)
    ids = torch.randint(4, VOCAB, (4, SEQ), device="cuda")
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    tail = opt.stats["gpu_tail_params"]
    assert tail > 0  # "auto" keeps a tail on a GPU
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    assert opt.release_device_tail("test") == tail
    freed = before - torch.cuda.memory_allocated()
    assert freed >= 16 * tail  # master, both moments and fp32 gradients: 16 B per element
    assert opt.stats["gpu_tail_buckets"] == 0
    model(input_ids=ids, labels=ids).loss.backward()  # training goes on with host buckets
    opt.step()
    assert opt.stats["steps"] == 3 and not opt.last_step_skipped
    opt.close()
