"""The plan's bytes for a loss over a batch's full logits are what torch allocates for it.

A tiny Llama runs its forward and backward on the CPU under ``TensorPeak`` (every storage the
ops create, until its last tensor goes), at two vocabulary sizes: everything but the logits and
what the loss derives from them is the same at both (the embedding and the LM head are frozen,
so their weights get no gradient), so the difference of the two peaks over the difference of
the logits is the loss's bytes a logit. The plan's figure (``loss_memory``, what
``zero3_memory_plan`` counts as ``logits_and_loss``) must match it within 0.5%: the bytes a
token of the loss (its fp32 sums, the labels) are the same at both sizes and drop out.

Label smoothing is measured as TRL's SFTTrainer (1.16) computes it: transformers' LabelSmoother
over the output of the model's forward without labels, ``shift_labels=True``. The second,
gradient-free forward TRL runs after it through its fused LM head (for its metrics) is not part
of this: on a GPU it scores Triton tiles of at most 4096 x 32768 logits while the smoother
holds two of its tensors, below the smoother's own peaks; on the CPU it scores the whole
vocabulary through torch, which no GPU run does.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tensor_peak import TensorPeak
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.trainer_pt_utils import LabelSmoother

from hf_superoffload.zero3.loss_memory import LOGIT_BYTES, label_smoothing_bytes, model_loss_bytes
from hf_superoffload.zero3.memory_plan import Zero3Run, zero3_memory_plan

ROWS, SEQ = 2, 48
VOCABS = (3000, 6000)
TOLERANCE = 0.005


def _model(vocab: int, dtype: torch.dtype) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(dtype)
    model.get_input_embeddings().requires_grad_(False)
    model.get_output_embeddings().requires_grad_(False)
    return model


def _peak(vocab: int, dtype: torch.dtype, smoothing: bool) -> int:
    """Peak bytes of one training forward and backward of the tiny model."""
    model = _model(vocab, dtype)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (ROWS, SEQ), generator=generator)
    labels = ids.clone()
    labels[:, :5] = -100  # a prompt
    with TensorPeak() as peak:
        if smoothing:  # as TRL's SFTTrainer.compute_loss calls it
            smoother = LabelSmoother(epsilon=0.1)
            loss = smoother(model(input_ids=ids), labels, shift_labels=True)
        else:
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
    return peak.peak


def _measured_bytes_a_logit(dtype: torch.dtype, smoothing: bool) -> float:
    small, large = (_peak(vocab, dtype, smoothing) for vocab in VOCABS)
    return (large - small) / (ROWS * SEQ * (VOCABS[1] - VOCABS[0]))


def _planned_bytes_a_logit(low: int, smoothing: bool) -> float:
    tokens = ROWS * SEQ
    if smoothing:
        return label_smoothing_bytes(tokens, ROWS, 1, low) / tokens
    return model_loss_bytes(tokens, 1) / tokens


@pytest.mark.parametrize("smoothing", [False, True], ids=["model_loss", "label_smoothing"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_planned_loss_bytes_are_what_torch_allocates(dtype, smoothing):
    """The model's own loss takes 12 bytes a logit in bf16 and in fp32 (its upcast copy is the
    logits themselves in fp32, and neither is alive at its backward's peak); label smoothing,
    which never upcasts, about 10 in bf16 and 16 in fp32 (15.75 at seq 48: its shifted copies
    have one position fewer a row)."""
    low = dtype.itemsize
    planned = _planned_bytes_a_logit(low, smoothing)
    measured = _measured_bytes_a_logit(dtype, smoothing)
    assert measured == pytest.approx(planned, rel=TOLERANCE)
    expected = {(2, False): 12, (4, False): 12, (2, True): 10, (4, True): 16}[low, smoothing]
    assert expected * (1 - 1 / SEQ) - 1e-9 <= planned <= expected


def test_the_plan_counts_the_loss_its_run_names():
    """``zero3_memory_plan``'s logits_and_loss is ``loss_bytes``: the model's own loss at
    ``LOGIT_BYTES`` a logit, label smoothing's by the weights' dtype; label smoothing beside a
    fused loss is refused."""
    config = LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=512)
    config.num_hidden_layers = 2
    run = Zero3Run(seq=1024, batch=4)
    tokens = run.seq * run.batch

    def planned(run: Zero3Run) -> int:
        return zero3_memory_plan(config, run).gpu["logits_and_loss"]

    assert planned(run) == LOGIT_BYTES * tokens * 32000
    for low in (2, 4):
        smoothed = dataclasses.replace(run, label_smoothing=True, dtype_bytes=low)
        assert planned(smoothed) == label_smoothing_bytes(tokens, run.batch, 32000, low)
    fused = dataclasses.replace(run, label_smoothing=True, fused_cross_entropy="trl")
    with pytest.raises(ValueError, match="label_smoothing computes the loss from the batch's"):
        planned(fused)
