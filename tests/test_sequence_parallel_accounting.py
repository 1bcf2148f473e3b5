"""Under Ulysses sequence parallelism the figures a run reports count the ranks that share a
sequence once (the batch on the model card) and count each shard's attention over the whole
sequence (tflops/mfu of a plain Trainer on the ZeRO-3 path, Zero3MetricsCallback), as the
SuperOffload trainers' own meter does.

No ranks are spawned: accelerate's state is given a ``ParallelismConfig`` with ``sp_size`` 2,
what a launched Ulysses run's Accelerator holds (its checks against the launched ranks run in
``Accelerator``, not here).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from accelerate.parallelism_config import ParallelismConfig
from accelerate.state import AcceleratorState
from cpu_trainer_args import cpu_training_args

from hf_superoffload import SuperOffloadTrainer, SuperOffloadTrainingArguments
from hf_superoffload.integrations import model_card, zero3_callback, zero3_save
from hf_superoffload.integrations.metrics import ThroughputMeter
from hf_superoffload.toy import build_tiny_llama

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

SP = 2


@pytest.fixture
def ulysses_state(monkeypatch):
    """accelerate's shared state as a Ulysses run over 2 ranks holds it (sp_size 2)."""
    Accelerator(cpu=True)
    state = AcceleratorState()
    monkeypatch.setattr(
        state, "parallelism_config", ParallelismConfig(sp_size=SP, sp_backend="deepspeed")
    )
    return state


def test_card_batch_counts_ranks_sharing_a_sequence_once():
    # 2 ranks, one Ulysses group: transformers' get_total_train_batch_size is 1 * 2 * (2 // 2).
    args = SimpleNamespace(
        per_device_train_batch_size=1, gradient_accumulation_steps=2, world_size=2, max_steps=5
    )
    assert model_card.training_arguments(args)["effective batch size (sequences)"] == 4
    ulysses = model_card.training_arguments(args, sequence_parallel=SP)
    assert ulysses["effective batch size (sequences)"] == 2
    assert ulysses["sequence parallel (Ulysses) ranks"] == SP


def test_card_of_a_trainer_reads_the_accelerators_sequence_parallel_size(
    tmp_path, monkeypatch, close_trainers_optimizers
):
    args = SuperOffloadTrainingArguments(
        **cpu_training_args(
            tmp_path, per_device_train_batch_size=3, gradient_accumulation_steps=2, max_steps=1
        )
    )
    trainer = SuperOffloadTrainer(model=build_tiny_llama(seed=0), args=args, train_dataset=[])
    monkeypatch.setattr(type(args), "world_size", property(lambda self: 4))  # 2 groups of 2
    monkeypatch.setattr(
        AcceleratorState(),
        "parallelism_config",
        ParallelismConfig(sp_size=SP, sp_backend="deepspeed"),
    )
    total = trainer.get_total_train_batch_size(trainer.args)  # transformers' count
    assert total == 3 * 2 * (4 // SP)
    text = model_card.reproduce_section(trainer)
    assert f"| effective batch size (sequences) | `{total}` |" in text
    assert f"| sequence parallel (Ulysses) ranks | `{SP}` |" in text


def test_plain_trainer_metrics_count_attention_over_the_whole_sequence(ulysses_state, monkeypatch):
    model = build_tiny_llama(seed=0)
    ours = object()  # stands for the SuperOffloadZero3Optimizer DeepSpeed built
    monkeypatch.setattr(zero3_callback, "our_zero3_optimizer", lambda optimizer: ours)
    monkeypatch.setattr(zero3_save, "check_plain_trainer_model", lambda model: None)
    callback = zero3_callback.Zero3MetricsCallback()
    args = SimpleNamespace(parallelism_config=None)  # the accelerator's config is what ran
    callback.on_train_begin(args, None, None, model=model, optimizer=ours)
    shard = torch.randint(0, 105, (2, 16), generator=torch.Generator().manual_seed(0))
    model.train()
    model(input_ids=shard)  # this rank's half of 32-token sequences
    expected = ThroughputMeter()
    expected.add_batch({"input_ids": shard}, model, sequence_parallel=SP)
    assert callback._meter.tokens == shard.numel()
    assert callback._meter.flops == pytest.approx(expected.flops, rel=1e-12)
    one_rank = ThroughputMeter()
    one_rank.add_batch({"input_ids": shard}, model)
    assert callback._meter.flops > one_rank.flops  # the shard length alone undercounts
    callback.on_train_end(args, None, None)
