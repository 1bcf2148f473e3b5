"""A CUDA out-of-memory error in forward or backward after gpu_tail='auto' grew the device
tail: the Trainer gives the tail back and retries the batch once (integrations/oom_retry.py).

The GPU tests force a real allocator failure (a forward hook asks for more than the card has)
and check that the buckets moved back free their device memory; the CPU test checks that an
out-of-memory error with no tail to give back reaches the user as it came.
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


def _model(device: str):
    config = tiny_llama_config(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4)
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


def _trainer(tmp_path, device: str, accumulation: int = 1):
    args = SuperOffloadTrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=4,
        gradient_accumulation_steps=accumulation, learning_rate=1e-3, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=device == "cpu", bf16=False,
        superoffload_bucket_size=1 << 12, dataloader_num_workers=0,
    )  # fmt: skip
    return SuperOffloadTrainer(model=_model(device), args=args, train_dataset=_Tokens())


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
    assert fail.calls == STEPS * accumulation + 1  # one batch ran twice
    assert "CUDA out of memory at optimizer step" in caplog.text
    if accumulation == 2:  # the failing forward was the window's second: one micro-batch lost
        assert "the 1 earlier micro-batches" in caplog.text
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
