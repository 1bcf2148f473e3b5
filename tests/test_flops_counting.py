"""The logged tflops/mfu count each token's attention over its own sequence (a packed
padding-free batch's document, a padded row's real tokens; under sequence parallelism the
ranks' counts add up to the unsharded batch's), DPO's reference forward, not the forward
TRL's SFTTrainer runs for its metrics beside label smoothing, and are left out, with the reason
logged once, for models with frozen matmul weights.

Each count is compared with one written out by hand: per token 6 N (N: every param but the input
embedding's lookup table) plus 12 x layers x hidden x the length of the sequence the token
attends over; a reference forward adds 2 N_ref plus a third of its attention term.
"""

from __future__ import annotations

import logging
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may touch the network

import pytest
import torch
from accelerate import Accelerator
from cpu_trainer_args import no_checkpointing
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from hf_superoffload.integrations.metrics import ThroughputMeter
from hf_superoffload.toy import build_tiny_llama

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _hand_matmul_params(model) -> int:
    """Every param but the (untied) input embedding's table."""
    embedding = model.get_input_embeddings().weight
    return sum(p.numel() for p in model.parameters() if p is not embedding)


def _hand_flops(model, documents: list[int]) -> float:
    """Training FLOPs of a batch whose tokens attend within the given documents."""
    config = model.config
    n = _hand_matmul_params(model)
    lhs = config.num_hidden_layers * config.hidden_size
    return sum(6 * n * d + 12 * lhs * d * d for d in documents)


DOCS = [7, 12, 3, 9]


def test_padding_free_batch_counts_attention_within_each_document():
    """TRL's padding-free collator flattens the documents into one row, with the flash
    attention boundaries (cu_seq_lens_q) and restarting position ids: each token attends over
    its own document, not the whole row."""
    model = build_tiny_llama(seed=0)
    collator = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    batch = collator([{"input_ids": list(range(1, d + 1))} for d in DOCS])
    assert batch["input_ids"].shape == (1, sum(DOCS))
    meter = ThroughputMeter()
    meter.add_batch(batch, model)
    assert meter.tokens == sum(DOCS)
    assert meter.flops == pytest.approx(_hand_flops(model, DOCS), rel=1e-12)
    # The position ids alone (an sdpa or flex run, no flash-attention boundaries) split the
    # row the same way.
    by_positions = ThroughputMeter()
    by_positions.add_batch(
        {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}, model
    )
    assert by_positions.flops == pytest.approx(_hand_flops(model, DOCS), rel=1e-12)


def test_padded_batch_counts_each_rows_real_tokens():
    model = build_tiny_llama(seed=0)
    collator = DataCollatorForLanguageModeling(pad_token_id=0)
    batch = collator([{"input_ids": list(range(1, d + 1))} for d in DOCS])
    assert batch["input_ids"].shape == (len(DOCS), max(DOCS))
    meter = ThroughputMeter()
    meter.add_batch(batch, model)
    assert meter.tokens == sum(DOCS)
    assert meter.flops == pytest.approx(_hand_flops(model, DOCS), rel=1e-12)


def test_rows_without_mask_or_positions_are_whole_sequences():
    model = build_tiny_llama(seed=0)
    meter = ThroughputMeter()
    meter.add_batch({"input_ids": torch.ones(3, 10, dtype=torch.long)}, model)
    assert meter.flops == pytest.approx(_hand_flops(model, [10, 10, 10]), rel=1e-12)


def test_frozen_weights_leave_tflops_out_and_say_why_once(caplog):
    """Training only the head: the frozen layers still run their forward, which counting the
    trainable params alone leaves out, so tflops/mfu are not logged; tokens/s still is."""
    model = build_tiny_llama(seed=0)
    for name, param in model.named_parameters():
        param.requires_grad = name.startswith("lm_head")
    accelerator = Accelerator(cpu=True)
    meter = ThroughputMeter()
    with caplog.at_level(logging.INFO, logger="hf_superoffload"):
        for _ in range(3):
            meter.add_batch({"input_ids": torch.ones(2, 8, dtype=torch.long)}, model)
            out = meter.metrics(accelerator, 1.0)
            assert "tflops" not in out and "mfu" not in out, out
            assert out["tokens_per_second"] > 0
    told = [r.getMessage() for r in caplog.records if "without tflops and mfu" in r.getMessage()]
    assert len(told) == 1, told
    assert "do not train" in told[0] and "model.layers.0" in told[0]


def test_reference_forward_adds_its_forward_flops():
    model, reference = build_tiny_llama(seed=0), build_tiny_llama(seed=1)
    for param in reference.parameters():
        param.requires_grad = False  # a reference model trains nothing, yet runs a forward
    batch = DataCollatorForLanguageModeling(pad_token_id=0)(
        [{"input_ids": list(range(1, d + 1))} for d in DOCS]
    )
    meter = ThroughputMeter()
    meter.add_batch(batch, model, reference_model=reference)
    config = reference.config
    lhs = config.num_hidden_layers * config.hidden_size
    n_ref = _hand_matmul_params(reference)
    forward = sum(2 * n_ref * d + 4 * lhs * d * d for d in DOCS)
    assert meter.flops == pytest.approx(_hand_flops(model, DOCS) + forward, rel=1e-12)


class _RecordingMeter(ThroughputMeter):
    """The meter, keeping each micro batch it was given and the FLOPs of each logged window."""

    def __init__(self):
        super().__init__()
        self.batches, self.windows = [], []

    def add_batch(self, inputs, model, sequence_parallel=1, reference_model=None):
        self.batches.append((inputs["attention_mask"].clone(), reference_model))
        super().add_batch(inputs, model, sequence_parallel, reference_model)

    def metrics(self, accelerator, peak):
        self.windows.append(self.flops)
        return super().metrics(accelerator, peak)


@pytest.mark.parametrize("precompute", [False, True], ids=["live-ref", "precompute-ref"])
def test_dpo_trainer_counts_the_reference_forward_it_runs(tmp_path, precompute):
    """SuperOffloadDPOTrainer runs its reference model's forward on every batch unless the
    reference log-probs were computed before training: the logged FLOPs follow."""
    from datasets import Dataset

    from hf_superoffload import SuperOffloadDPOConfig, SuperOffloadDPOTrainer
    from hf_superoffload.toy import make_char_tokenizer

    rows = [{"prompt": f"{i}+{i}=", "chosen": str(2 * i), "rejected": str(2 * i + 1)}
            for i in range(4)]  # fmt: skip
    config = SuperOffloadDPOConfig(
        output_dir=str(tmp_path), use_cpu=True, max_steps=2, per_device_train_batch_size=2,
        logging_steps=1, report_to=[], save_strategy="no", bf16=False, max_length=32,
        disable_tqdm=True, **no_checkpointing(SuperOffloadDPOConfig),
        precompute_ref_log_probs=precompute, superoffload_bucket_size=1 << 14,
    )  # fmt: skip
    model, reference = build_tiny_llama(seed=0), build_tiny_llama(seed=0)
    trainer = SuperOffloadDPOTrainer(
        model=model, ref_model=reference, args=config,
        train_dataset=Dataset.from_list(rows), processing_class=make_char_tokenizer(),
    )  # fmt: skip
    trainer._throughput = meter = _RecordingMeter()
    trainer.train()
    assert len(meter.batches) == len(meter.windows) == 2
    ref_config = reference.config
    lhs = ref_config.num_hidden_layers * ref_config.hidden_size
    for (mask, seen_reference), flops in zip(meter.batches, meter.windows, strict=True):
        lengths = mask.sum(dim=-1).tolist()  # chosen and rejected rows, padded
        expected = _hand_flops(model, lengths)
        if precompute:
            assert seen_reference is None
        else:
            assert seen_reference is trainer.ref_model
            n_ref = _hand_matmul_params(reference)
            expected += sum(2 * n_ref * d + 4 * lhs * d * d for d in lengths)
        assert flops == pytest.approx(expected, rel=1e-12)
    trainer.superoffload_optimizer.close()


def test_label_smoothing_s_metrics_forward_is_not_model_flops(tmp_path):
    """TRL's SFTTrainer (1.16) with label smoothing runs two forwards a micro batch: the one
    the loss comes from (full logits, with gradients) and one without gradients through its
    fused LM head whose outputs feed only its entropy and token-accuracy logs. The second is
    not model FLOPs (the loss does not need it, as it does not need activation checkpointing's
    recomputation): the logged FLOPs are the training forward's and backward's alone."""
    from datasets import Dataset

    from hf_superoffload import SuperOffloadSFTConfig, SuperOffloadSFTTrainer
    from hf_superoffload.toy import make_char_tokenizer

    rows = [{"prompt": f"{i}+{i}=", "completion": str(2 * i)} for i in range(4)]
    config = SuperOffloadSFTConfig(
        output_dir=str(tmp_path), use_cpu=True, max_steps=2, per_device_train_batch_size=2,
        logging_steps=1, report_to=[], save_strategy="no", bf16=False, max_length=32,
        disable_tqdm=True, **no_checkpointing(SuperOffloadSFTConfig),
        label_smoothing_factor=0.1, superoffload_bucket_size=1 << 14,
    )  # fmt: skip
    model = build_tiny_llama(seed=0)
    with pytest.warns(FutureWarning, match="label_smoothing_factor"):
        trainer = SuperOffloadSFTTrainer(
            model=model, args=config, train_dataset=Dataset.from_list(rows),
            processing_class=make_char_tokenizer(),
        )  # fmt: skip
    forwards = []  # (with gradients, through the fused head) of each forward
    model.register_forward_pre_hook(
        lambda module, args, kwargs: forwards.append(
            (torch.is_grad_enabled(), kwargs.get("fused_lm_head", False))
        ),
        with_kwargs=True,
    )
    trainer._throughput = meter = _RecordingMeter()
    trainer.train()
    assert forwards == [(True, False), (False, True)] * 2  # the loss's, then the metrics'
    assert len(meter.batches) == len(meter.windows) == 2
    for (mask, _), flops in zip(meter.batches, meter.windows, strict=True):
        assert flops == pytest.approx(_hand_flops(model, mask.sum(dim=-1).tolist()), rel=1e-12)
    trainer.superoffload_optimizer.close()


def test_padding_free_batch_under_sequence_parallelism_is_refused(caplog):
    """A rank's shard of a padding-free row does not show how long its documents are (a
    document may go on in the next rank's shard): no tflops rather than a guess."""
    model = build_tiny_llama(seed=0)
    shard = {
        "input_ids": torch.ones(1, 8, dtype=torch.long),
        "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]),
    }
    meter = ThroughputMeter()
    with caplog.at_level(logging.INFO, logger="hf_superoffload"):
        meter.add_batch(shard, model, sequence_parallel=2)
        out = meter.metrics(Accelerator(cpu=True), 1.0)
    assert "tflops" not in out and out["tokens_per_second"] > 0
    assert any("under sequence parallelism" in r.getMessage() for r in caplog.records)


def _shards(batch: dict, ranks: int) -> list[dict]:
    """Each rank's shard of every row, as DeepSpeed's Ulysses data loader cuts a batch."""
    chunk = batch["input_ids"].shape[-1] // ranks
    return [
        {key: value[:, rank * chunk : (rank + 1) * chunk] for key, value in batch.items()}
        for rank in range(ranks)
    ]


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_padded_batch_under_sequence_parallelism_counts_what_it_counts_unsharded(ranks):
    """TRL's padded batch with the position ids Ulysses needs, cut into ``ranks`` shards: the
    ranks' counts add up to the unsharded batch's, each real token over its row's real tokens
    (not over the padded row)."""
    model = build_tiny_llama(seed=0)
    collator = DataCollatorForLanguageModeling(
        pad_token_id=0, return_position_ids=True, pad_to_multiple_of=ranks
    )
    batch = collator([{"input_ids": list(range(1, d + 1))} for d in DOCS])
    unsharded = ThroughputMeter()
    unsharded.add_batch(batch, model)
    meters = [ThroughputMeter() for _ in range(ranks)]
    for meter, shard in zip(meters, _shards(batch, ranks), strict=True):
        meter.add_batch(shard, model, sequence_parallel=ranks)
    assert sum(meter.tokens for meter in meters) == unsharded.tokens == sum(DOCS)
    assert sum(meter.flops for meter in meters) == pytest.approx(unsharded.flops, rel=1e-12)
    assert unsharded.flops == pytest.approx(_hand_flops(model, DOCS), rel=1e-12)


def test_rows_without_mask_or_positions_under_sequence_parallelism_are_whole_sequences():
    model = build_tiny_llama(seed=0)
    batch = {"input_ids": torch.ones(3, 10, dtype=torch.long)}
    meters = [ThroughputMeter() for _ in range(2)]
    for meter, shard in zip(meters, _shards(batch, 2), strict=True):
        meter.add_batch(shard, model, sequence_parallel=2)
    assert sum(meter.flops for meter in meters) == pytest.approx(
        _hand_flops(model, [10, 10, 10]), rel=1e-12
    )


def test_a_padded_shard_without_positions_is_refused(caplog):
    """Without position ids a rank's shard does not say where in its row its tokens are."""
    model = build_tiny_llama(seed=0)
    shard = {"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": torch.ones(2, 4)}
    meter = ThroughputMeter()
    with caplog.at_level(logging.INFO, logger="hf_superoffload"):
        meter.add_batch(shard, model, sequence_parallel=2)
        out = meter.metrics(Accelerator(cpu=True), 1.0)
    assert "tflops" not in out and out["tokens_per_second"] > 0
    assert any("without position_ids" in r.getMessage() for r in caplog.records)


def test_plain_trainer_with_a_live_reference_model_leaves_tflops_out(monkeypatch, caplog):
    """A plain TRL DPOTrainer on the ZeRO-3 path: the callback counts the policy's forwards but
    cannot see the reference model's, so it leaves tflops out and says why."""
    from types import SimpleNamespace

    from hf_superoffload.integrations import zero3_callback, zero3_save

    model = build_tiny_llama(seed=0)
    ours = object()  # stands for the SuperOffloadZero3Optimizer DeepSpeed built
    monkeypatch.setattr(zero3_callback, "our_zero3_optimizer", lambda optimizer: ours)
    monkeypatch.setattr(zero3_save, "check_plain_trainer_model", lambda model: None)
    accelerator = Accelerator(cpu=True)
    counted = {}
    for precompute in (True, False):
        callback = zero3_callback.Zero3MetricsCallback()
        args = SimpleNamespace(parallelism_config=None, precompute_ref_log_probs=precompute)
        with caplog.at_level(logging.INFO, logger="hf_superoffload"):
            callback.on_train_begin(args, None, None, model=model, optimizer=ours)
            model.train()
            model(input_ids=torch.ones(2, 8, dtype=torch.long))
            counted[precompute] = "tflops" in callback._meter.metrics(accelerator, 1.0)
        callback.on_train_end(args, None, None)
    assert counted == {True: True, False: False}
    assert any("precompute_ref_log_probs=False" in r.getMessage() for r in caplog.records)
