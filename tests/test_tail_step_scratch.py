"""The device tail's step makes temporaries beside its state: the memory plans count them with
``step_scratch_bytes``, and here that figure is held against what the step creates (on the
CPU tier by counting the tensors its ops create, on a GPU by the allocator's peak), with the
compact update cut in pieces and still bit for bit its reference."""

from __future__ import annotations

import pytest
import torch
from compact_reference import assert_equal_trajectory, run_compact_reference
from engine_reference import RunConfig, clip_threshold, run_superoffload
from tensor_peak import temporaries_of

from hf_superoffload.engine import device_tail
from hf_superoffload.engine.device_tail import DeviceTail, step_scratch_bytes
from hf_superoffload.zero3.memory_plan import Zero3Run, zero3_memory_plan


def _measure_steps(monkeypatch, cuda: bool) -> list[tuple[int, int, int, int]]:
    """(peak bytes, largest bucket, largest param, params) of every tail step."""
    steps, step = [], DeviceTail.step

    def measured(self, buckets, hypers, coef):
        largest = max((b.master.numel() for b in buckets), default=0)
        count = sum(b.param_count for b in buckets)
        param = max(
            (b.views(b.master, i).numel() for b in buckets for i in range(b.param_count)), default=0
        )
        peak = temporaries_of(lambda: step(self, buckets, hypers, coef), cuda)
        steps.append((peak, largest, param, count))

    monkeypatch.setattr(DeviceTail, "step", measured)
    return steps


def _config(device: str) -> RunConfig:
    cfg = RunConfig(steps=6, two_groups=True)
    return cfg.replace(max_grad_norm=clip_threshold(cfg, "some", device))


def _check_compact(monkeypatch, device: str, piece: int) -> None:
    monkeypatch.setattr(device_tail, "COMPACT_STEP_PIECE", piece)
    steps = _measure_steps(monkeypatch, device == "cuda")
    cfg = _config(device)
    got = run_superoffload(cfg, device, moments="compact", gpu_tail=2)
    assert_equal_trajectory(got, run_compact_reference(cfg, got.grad_norms, device))
    assert steps
    for peak, largest, param, _ in steps:
        assert peak <= step_scratch_bytes(largest, True, device), (peak, largest)
        if device == "cuda":  # the Triton kernel, in place
            assert step_scratch_bytes(largest, True, device) == 0
            continue
        floor = 0.85 * device_tail.COMPACT_STEP_SCRATCH_BYTES * min(param, piece)
        assert peak >= floor, (peak, floor)  # the figure is what it costs, not a wide bound


def _check_exact(monkeypatch, device: str) -> None:
    steps = _measure_steps(monkeypatch, device == "cuda")
    run_superoffload(_config(device), device, gpu_tail=2)
    assert steps
    # The CUDA allocator rounds each tensor up to 512 bytes: one a param here (tiny params; at
    # the plans' sizes a fraction of a MiB).
    rounding = 512 if device == "cuda" else 0
    for peak, largest, _, count in steps:
        assert peak <= step_scratch_bytes(largest, False, device) + rounding * count, (
            peak,
            largest,
        )
    most = max(step_scratch_bytes(largest, False, device) for _, largest, _, _ in steps)
    assert max(peak for peak, _, _, _ in steps) >= 0.85 * most


def test_compact_tail_steps_a_param_in_pieces_within_the_planned_scratch(monkeypatch):
    """Pieces of 1024 elements, smaller than most params: same bits as the whole-param
    reference, and the temporaries of one piece at a time."""
    _check_compact(monkeypatch, "cpu", 1024)


def test_exact_tail_step_within_the_planned_scratch(monkeypatch):
    _check_exact(monkeypatch, "cpu")


def test_the_pieces_are_whole_blocks():
    assert device_tail.COMPACT_STEP_PIECE % 256 == 0


@pytest.mark.parametrize("compact", [False, True], ids=["fp32", "compact"])
def test_the_zero3_plan_counts_the_device_sub_groups_step_scratch(compact):
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=8,
    )  # fmt: skip
    run = Zero3Run(seq=512, batch=1, ranks=1, ratio=0.5, compact_moments=compact)
    plan = zero3_memory_plan(config, run)
    largest = plan.split.largest_device_sub_group
    assert plan.split.device_count and largest
    assert plan.gpu["optimizer_step_scratch"] == step_scratch_bytes(largest, compact, "cuda")
    if compact:  # the Triton kernel steps them in place
        assert plan.gpu["optimizer_step_scratch"] == 0
    all_host = zero3_memory_plan(config, Zero3Run(seq=512, batch=1, ranks=1, ratio=1.0))
    assert all_host.gpu["optimizer_step_scratch"] == 0


@pytest.mark.gpu
def test_compact_tail_step_on_a_gpu_within_the_planned_scratch(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    _check_compact(monkeypatch, "cuda", 1024)


@pytest.mark.gpu
def test_exact_tail_step_on_a_gpu_within_the_planned_scratch(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    _check_exact(monkeypatch, "cuda")


def test_the_plans_gpu_figure_is_its_larger_phase():
    """Forward and backward hold activations, the step after backward its scratch; the
    figure is the larger phase's, not both at once."""
    from transformers import LlamaConfig

    from hf_superoffload.zero3.memory_plan import STEP_PHASE_GPU

    config = LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=8,
    )  # fmt: skip
    for seq, ratio in ((4096, 0.5), (64, 0.0)):
        plan = zero3_memory_plan(config, Zero3Run(seq=seq, batch=1, ratio=ratio))
        training = sum(v for k, v in plan.gpu.items() if k != "optimizer_step_scratch")
        step = sum(plan.gpu[k] for k in STEP_PHASE_GPU)
        assert plan.gpu_bytes == max(training, step)
    assert step > training  # the short sequence with all state on the GPU: the step's phase


def test_the_table_and_a_gpu_shortfall_name_the_peak_phase():
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=8,
    )  # fmt: skip
    plan = zero3_memory_plan(config, Zero3Run(seq=64, batch=1, ratio=0.0))
    assert plan.gpu_peak_phase == "step"
    table = plan.table()
    assert "step phase" in table and "forward/backward phase" in table
    step_row = next(line for line in table.splitlines() if "step phase" in line)
    assert step_row.endswith("(the peak)")
    (gpu,) = [r for r in plan.shortfalls(2**20, 10**15) if r.startswith("GPU")]
    parts = plan.gpu_phases["step"]
    assert "in the step phase" in gpu and f"largest part: {max(parts, key=parts.get)}" in gpu
