"""The ZeRO-3 path's memory plan (its host side equals what the optimizer allocates: see
tests/test_zero3.py's bf16 case): at the points measured on the H100 (docs/benchmarks.md, "Memory plan") it predicts the
peaks within 10% and says which runs do not fit, and why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers

from hf_superoffload.zero3.memory_plan import Zero3Run, zero3_memory_plan

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
H100_GPU, H100_HOST = int(79.18 * GIB), int(125 * GIB)  # what torch and free(1) report there


def _config(name: str):
    if name == "llama-3.1-8b":
        values = json.loads((ROOT / "hf_superoffload/model_configs/llama-3.1-8b.json").read_text())
        values = {k: v for k, v in values.items() if not k.startswith("_")}
        return transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    return transformers.LlamaConfig(  # the DESIGN.md 3.0B point (benchmarks/train_step.py)
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
        num_key_value_heads=24, vocab_size=32000, max_position_embeddings=4096,
        tie_word_embeddings=False,
    )  # fmt: skip


# Measured on one H100 80GB with 16 cores and 128 GiB host, seq 4096, batch 4, ratio 1.0:
# peak torch-allocated GPU GiB and peak host RSS GiB (docs/data/suite_zero3_h100_*_2026-11-23).
MEASURED = {"3b": (15.26, 46.27), "llama-3.1-8b": (43.07, 107.09)}


@pytest.mark.parametrize("model", sorted(MEASURED))
def test_predicts_the_measured_peaks_within_ten_percent(model):
    plan = zero3_memory_plan(_config(model), Zero3Run(seq=4096, batch=4))
    gpu, host = MEASURED[model]
    assert plan.gpu_bytes / GIB == pytest.approx(gpu, rel=0.10)
    assert plan.host_bytes / GIB == pytest.approx(host, rel=0.10)
    assert plan.shortfalls(H100_GPU, H100_HOST) == []


def test_predicts_the_gpu_tail_at_ratio_0_8_and_the_host_bytes_per_param():
    # Measured 2026-11-24 on the H100 (docs/data/suite_zero3_ratio_h100_3b_seq4096_2026-11-24):
    # 25.73 GiB GPU, 36.99 GiB host RSS at ratio 0.8; 46.1 GiB host at 1.0.
    config = _config("3b")
    tail = zero3_memory_plan(config, Zero3Run(seq=4096, batch=4, ratio=0.8))
    assert tail.gpu_bytes / GIB == pytest.approx(25.73, rel=0.10)
    assert tail.host_bytes / GIB == pytest.approx(36.99, rel=0.10)
    full = zero3_memory_plan(config, Zero3Run(seq=4096, batch=4))
    # 14 B/param (master 4, moments 8, bf16 gradients 2) plus the process at 1.0; the tail's
    # fifth of the state leaves the host.
    assert 14 < full.host_bytes_per_param < 15 and tail.host_bytes_per_param < 13
    assert tail.gpu["optimizer_on_gpu"] == 16 * (full.shape.params - int(full.shape.params * 0.8))


def test_start_up_is_the_host_peak_when_nearly_all_state_is_on_the_gpu():
    config = _config("3b")
    plan = zero3_memory_plan(config, Zero3Run(seq=4096, batch=4, ratio=0.1))
    training = sum(plan.host.values())
    # DeepSpeed's fp32 masters of the whole partition and its bf16 accumulation buffer.
    assert plan.host_start_up == 6 * plan.shape.params + plan.host["process"] > training
    assert plan.host_bytes == plan.host_start_up and "start-up (the peak)" in plan.table()
    mostly_host = zero3_memory_plan(config, Zero3Run(seq=4096, batch=4, ratio=0.8))
    assert mostly_host.host_bytes == sum(mostly_host.host.values())


def test_says_why_a_run_does_not_fit():
    config = _config("llama-3.1-8b")
    # A quarter of the optimizer state on the GPU ran out of GPU memory on the H100.
    gpu_short = zero3_memory_plan(config, Zero3Run(seq=4096, batch=4, ratio=0.75))
    (reason,) = gpu_short.shortfalls(H100_GPU, H100_HOST)
    assert reason.startswith("GPU: needs") and "largest part: optimizer_on_gpu" in reason
    # Accumulating keeps DeepSpeed's accumulation buffer: 2 B/param more than the host has.
    host_short = zero3_memory_plan(config, Zero3Run(seq=4096, batch=4, gradient_accumulation=4))
    (reason,) = host_short.shortfalls(H100_GPU, H100_HOST)
    assert reason.startswith("host: needs") and "smaller model" in reason
    # Two ranks on one host share it; each holds half the state.
    two = zero3_memory_plan(config, Zero3Run(seq=4096, batch=4, ranks=2))
    one = zero3_memory_plan(config, Zero3Run(seq=4096, batch=4))
    assert two.host["moments"] * 2 == pytest.approx(one.host["moments"], abs=16)
    assert two.gpu["gathered_params"] > 0 == one.gpu["gathered_params"]


def test_refuses_a_ratio_outside_zero_to_one():
    with pytest.raises(ValueError, match="ratio must be within"):
        zero3_memory_plan(_config("3b"), Zero3Run(seq=16, batch=1, ratio=1.5))


def _shipped(name: str):
    values = json.loads((ROOT / f"hf_superoffload/model_configs/{name}.json").read_text())
    values = {k: v for k, v in values.items() if not k.startswith("_")}
    values.pop("quantization_config", None)
    return transformers.AutoConfig.for_model(values.pop("model_type"), **values)


@pytest.mark.parametrize(
    ("name", "width"),
    [
        ("gpt-oss-20b", 4 * 2880),  # top-4 experts, each intermediate_size wide
        ("qwen3-30b-a3b", 8 * 768),  # top-8 experts of moe_intermediate_size (not the dense 6144)
        ("llama-3.1-8b", 14336),  # dense: intermediate_size
    ],
)
def test_recomputed_mlp_is_as_wide_as_the_experts_a_token_goes_through(name, width):
    config = _shipped(name)
    plan = zero3_memory_plan(config, Zero3Run(seq=4096, batch=4))
    assert plan.shape.active_intermediate == width
    # Three activations of that width (gate, up and their product) per token, in bf16.
    assert plan.gpu["layer_recompute"] == 3 * 2 * 4096 * 4 * width
