"""benchmarks/multi_gpu_table.py's comparisons: the scaling of each ZeRO-3 system that ran on one
GPU and on several (ours against its target, DeepSpeed's plain ZeRO-3 as the ceiling), and the
ZeRO-3 path against DDP when nothing clips."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import multi_gpu_table


def _row(system: str, gpus: int, clip: float, tokens_per_gpu: float, s_per_step: float) -> dict:
    return {
        "status": "ok", "system": system, "clip": str(clip), "config": json.dumps({"nproc": gpus}),
        "tokens_per_s_per_gpu": str(tokens_per_gpu), "s_per_step": str(s_per_step),
        "peak_gpu_gib": "12.4", "plan_per_rank": "", "ranks": "",
    }  # fmt: skip


def test_each_zero3_system_scales_against_its_own_single_gpu_row():
    rows = [
        _row("superoffload_zero3", 4, 1.0, 10854, 1.510),
        _row("superoffload_zero3", 1, 1.0, 11624, 1.409),
        _row("deepspeed_zero3", 4, 1.0, 900, 2.0),
        _row("deepspeed_zero3", 1, 1.0, 1000, 1.8),
        _row("superoffload_zero3", 4, 0.0, 12711, 1.289),
        _row("no_offload", 4, 0.0, 13220, 1.239),
    ]
    lines = multi_gpu_table.comparisons(rows)
    assert lines[0] == (
        "scaling, clip 1.0, superoffload_zero3: tokens/s per GPU on 4 GPUs / on 1 GPU = 0.934"
        " (target >= 0.95)"
    )
    assert lines[1] == (
        "scaling, clip 1.0, deepspeed_zero3: tokens/s per GPU on 4 GPUs / on 1 GPU = 0.900"
    )
    assert lines[2].startswith("no clipping, 4 GPUs: ZeRO-3 SuperOffload 1.289 s/step")
    assert lines[2].endswith("0.96x DDP's speed") and len(lines) == 3


def test_a_system_without_its_single_gpu_row_gives_no_scaling():
    rows = [_row("deepspeed_zero3", 4, 1.0, 900, 2.0), _row("superoffload_zero3", 1, 1.0, 1, 1.0)]
    assert multi_gpu_table.comparisons(rows) == []
