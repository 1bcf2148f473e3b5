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

import logging
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
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


def _trainer(tmp_path, device: str, accumulation: int = 1, dropout: float = 0.0):
    args = SuperOffloadTrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=4,
        gradient_accumulation_steps=accumulation, learning_rate=1e-3, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=device == "cpu", bf16=False,
        superoffload_bucket_size=1 << 12, dataloader_num_workers=0, seed=0,
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


@pytest.mark.parametrize("accumulation", [1, 3])
def test_a_retried_window_steps_as_if_nothing_had_failed(tmp_path, monkeypatch, accumulation):
    """The error strikes step 2's last micro-batch half-way through its backward pass, after
    the earlier micro-batches of the window have given their gradients; the release says it
    gave a tail back. The run then ends with a clean run's params and moments, bit for bit:
    the earlier micro-batches ran again (with the dropout masks they drew the first time), and
    the failing one with its own."""
    clean = _trainer(tmp_path / "clean", "cpu", accumulation, dropout=0.3)
    clean.train()
    expected = _trained_state(clean)

    monkeypatch.setattr(SuperOffloadOptimizer, "release_device_tail", lambda self, reason: 1)
    failing = _trainer(tmp_path / "failing", "cpu", accumulation, dropout=0.3)
    failing.model.model.layers[0].register_full_backward_hook(_FailInBackward(2 * accumulation))
    forwards = _FailOnce(0, "cpu")  # counts forward passes, fails none
    failing.model.register_forward_pre_hook(forwards)
    failing.train()
    assert failing.superoffload_stats["oom_retries"] == 1
    assert forwards.calls == STEPS * accumulation + accumulation  # the window ran twice
    got = _trained_state(failing)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    losses = [e["loss"] for e in failing.state.log_history if "loss" in e]
    assert losses == [e["loss"] for e in clean.state.log_history if "loss" in e]


def test_out_of_memory_under_replicas_is_raised_before_anything_changes(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setattr(SuperOffloadOptimizer, "release_device_tail", lambda self, reason: 1)
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


def test_out_of_memory_with_no_tail_to_give_back_is_raised_as_it_came(tmp_path):
    trainer = _trainer(tmp_path, "cpu")
    trainer.model.register_forward_pre_hook(_FailOnce(3, "cpu"))
    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        trainer.train()
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
