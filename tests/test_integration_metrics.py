"""Throughput/MFU/STV metrics in the Trainer's logs, and what wandb records of them."""

from __future__ import annotations

import logging
import time

import pytest
import torch
from wandb_offline import history

from hf_superoffload.integrations.metrics import (
    PEAK_ENV,
    ThroughputMeter,
    log_missing_peak,
    matmul_params,
    model_flops_per_token,
    peak_tflops,
)
from hf_superoffload.toy import build_tiny_llama, tiny_llama_config


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA H200 NVL", 835.0),
        ("NVIDIA GH200 120GB", 989.0),
        ("NVIDIA GH200 480GB", 989.0),
        ("NVIDIA B200", 2250.0),
        ("NVIDIA GB200", 2500.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("Some Other GPU", None),
    ],
)
def test_peak_table(monkeypatch, name, peak):
    monkeypatch.delenv("HF_SUPEROFFLOAD_PEAK_TFLOPS", raising=False)
    assert peak_tflops(name) == peak


def test_peak_override_and_its_errors(monkeypatch):
    monkeypatch.setenv("HF_SUPEROFFLOAD_PEAK_TFLOPS", "123.5")
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 123.5
    monkeypatch.setenv("HF_SUPEROFFLOAD_PEAK_TFLOPS", "fast")
    with pytest.raises(ValueError, match="HF_SUPEROFFLOAD_PEAK_TFLOPS must be a number"):
        peak_tflops("x")


def _meter_after_one_batch() -> ThroughputMeter:
    meter = ThroughputMeter()
    ids = torch.randint(0, 105, (2, 32), generator=torch.Generator().manual_seed(0))
    meter.add_batch({"input_ids": ids}, build_tiny_llama(seed=0))
    return meter


def test_mfu_divides_by_the_peak_given():
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    out = _meter_after_one_batch().metrics(accelerator, 2.0)
    assert out["mfu"] == pytest.approx(out["tflops"] / 2.0)


def test_an_unknown_peak_is_said_once_with_how_to_set_it(caplog):
    """No silent omission: without a peak, mfu is left out and the log says why, once."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    meter = _meter_after_one_batch()
    with caplog.at_level(logging.INFO, logger="hf_superoffload"):
        for _ in range(3):
            out = meter.metrics(accelerator, None)
            assert "tflops" in out and "mfu" not in out
            meter.add_batch(
                {"input_ids": torch.zeros(1, 8, dtype=torch.long)}, build_tiny_llama(seed=0)
            )
    told = [r for r in caplog.records if "mfu is not reported" in r.getMessage()]
    assert len(told) == 1, [r.getMessage() for r in caplog.records]
    assert PEAK_ENV in told[0].getMessage()


def test_an_unknown_gpu_is_a_warning_naming_it_and_the_variable(caplog):
    with caplog.at_level(logging.INFO, logger="hf_superoffload"):
        log_missing_peak("NVIDIA L40S")
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "NVIDIA L40S" in record.getMessage() and PEAK_ENV in record.getMessage()


@pytest.mark.parametrize("tied", [False, True])
def test_flops_per_token_is_6n_plus_attention(tied):
    config = tiny_llama_config(vocab_size=105, tie_word_embeddings=tied)
    model = build_tiny_llama(config, seed=0)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    n = total if tied else total - embedding  # a tied lm_head still does its matmul
    assert matmul_params(model) == n
    expected = 6 * n + 12 * config.num_hidden_layers * config.hidden_size * 32
    assert model_flops_per_token(config, n, 32) == expected


def test_a_mixture_of_experts_counts_the_experts_a_token_is_routed_to():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=8, num_experts_per_tok=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    named = dict(model.named_parameters())
    experts = sum(p.numel() for n, p in named.items() if ".experts." in n)
    assert experts > 0  # the expert weights are named as the count expects
    dense = sum(p.numel() for p in named.values()) - experts - config.vocab_size * 32
    # Each token passes through 2 of the 8 experts: a quarter of their params.
    assert matmul_params(model) == dense + experts // 4


def test_wandb_offline_run_records_throughput_mfu_and_rollbacks(tmp_path, monkeypatch):
    import datasets

    from hf_superoffload import SuperOffloadTrainer, SuperOffloadTrainingArguments

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("HF_SUPEROFFLOAD_PEAK_TFLOPS", "0.5")  # the CPU has no table entry
    ids = torch.randint(0, 105, (16, 32), generator=torch.Generator().manual_seed(0)).tolist()
    args = SuperOffloadTrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=2,
        logging_steps=1, report_to=["wandb"], use_cpu=True, save_strategy="no",
        max_grad_norm=1e-3, disable_tqdm=True, superoffload_bucket_size=4096,
    )  # fmt: skip
    dataset = datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})
    SuperOffloadTrainer(model=build_tiny_llama(seed=0), args=args, train_dataset=dataset).train()
    import wandb

    wandb.finish()  # flushes the run file (a script's exit would do it)

    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    # wandb's writer is another process and may land the last records just after finish()
    # returns (seen once on a loaded 2-core runner): wait for them, within a deadline.
    deadline = time.monotonic() + 30
    while True:
        rows = [row for row in history(run_file) if "train/loss" in row]
        if len(rows) >= 4 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(rows) == 4
    for row in rows:
        assert row["train/tokens_per_second"] > 0
        assert row["train/tflops"] > 0
        assert row["train/mfu"] == pytest.approx(row["train/tflops"] / 0.5)
        for key in (
            "speculative_steps",
            "rollbacks_clip",
            "rollbacks_nonfinite",
            "exposed_cpu_seconds",
            "replay_seconds",
        ):
            assert f"train/stv/{key}" in row
    # max_grad_norm 1e-3 clips every step: the first step's speculation was withheld (its
    # first bucket's norm alone exceeds the threshold) and later steps wait for validation,
    # so there is no rollback to count.
    assert rows[-1]["train/stv/rollbacks_clip"] == 0
    assert rows[-1]["train/stv/speculations_withheld"] >= 1
    assert rows[-1]["train/stv/rollbacks_nonfinite"] == 0


@pytest.mark.parametrize(("max_grad_norm", "clips"), [(1e-3, True), (1e6, False)])
def test_logged_clip_rollbacks_follow_the_threshold(tmp_path, max_grad_norm, clips):
    import datasets

    from hf_superoffload import SuperOffloadTrainer, SuperOffloadTrainingArguments

    ids = torch.randint(0, 105, (16, 32), generator=torch.Generator().manual_seed(1)).tolist()
    args = SuperOffloadTrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2, logging_steps=1,
        report_to=[], use_cpu=True, save_strategy="no", max_grad_norm=max_grad_norm,
        disable_tqdm=True, superoffload_bucket_size=4096,
    )  # fmt: skip
    dataset = datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})
    trainer = SuperOffloadTrainer(model=build_tiny_llama(seed=0), args=args, train_dataset=dataset)
    trainer.train()
    logged = [row["stv/rollbacks_clip"] for row in trainer.state.log_history if "loss" in row]
    assert len(logged) == 4
    withheld = [
        row["stv/speculations_withheld"] for row in trainer.state.log_history if "loss" in row
    ]
    # A clipping step's speculation was replayed or, its norm already above the threshold,
    # withheld (then there is no rollback to count).
    assert (logged[-1] + withheld[-1] > 0) == clips
    assert logged == sorted(logged)  # a cumulative counter


def test_the_end_of_run_counters_are_the_logs_all_rank_ones():
    """A partition speculated (and was rolled back) on one rank and was withheld on another:
    the run's summary gives the counts the logs give (the largest over the ranks), not rank 0's
    own (a 2-GPU recipe printed 0 rollbacks beside logs that said 1)."""
    from hf_superoffload.integrations.metrics import STV_KEYS, all_ranks_stats

    other_rank = {key: 0.0 for key in STV_KEYS} | {"rollbacks_clip": 1.0, "replays": 3.0}

    class TwoRanks:
        num_processes, device = 2, torch.device("cpu")

        def gather(self, values):
            return torch.cat([values, torch.tensor([[other_rank[k] for k in STV_KEYS]])])

    ours = {key: 0.0 for key in STV_KEYS} | {"steps": 5.0, "speculative_steps": 4.0}
    reduced = all_ranks_stats(ours, TwoRanks())
    assert reduced["rollbacks_clip"] == 1.0 and reduced["replays"] == 3.0
    assert reduced["speculative_steps"] == 4.0 and reduced["steps"] == 5.0
