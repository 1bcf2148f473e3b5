"""benchmarks/stream_summary.py: per-stream GPU activity of a profiler trace, and what ended
while the compute stream sat idle."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from stream_summary import summarize_trace


def _event(cat, name, ts_us, dur_us, stream, nbytes=None):
    args = {"stream": stream, **({"bytes": nbytes} if nbytes else {})}
    return {"ph": "X", "cat": cat, "name": name, "ts": ts_us, "dur": dur_us, "args": args}


def test_streams_and_the_compute_gap_with_the_copy_it_waited_for(tmp_path):
    trace = {
        "traceEvents": [
            _event("kernel", "gemm", 1000, 1000, 7),
            _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 1500, 3000, 20, 2_000_000),
            _event("kernel", "compact_kernel", 4500, 200, 20),
            _event("kernel", "gemm", 5000, 1000, 7),
            _event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 6500, 500, 28, 1_000_000),
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 9000},
        ]
    }
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    summary = summarize_trace(str(path))
    assert summary["window_s"] == pytest.approx(0.006)
    streams = summary["streams"]
    assert streams["7"]["kernel_s"] == pytest.approx(0.002)
    assert streams["20"]["memcpy_HtoD_GB"] == pytest.approx(0.002)
    assert streams["20"]["memcpy_HtoD_s"] == pytest.approx(0.003)
    assert streams["28"]["memcpy_DtoH_GB"] == pytest.approx(0.001)
    assert summary["compute_stream"] == "7"
    assert summary["gap_count"] == 1
    (gap,) = summary["largest_gaps"]
    assert gap["from_s"] == pytest.approx(0.001) and gap["gap_s"] == pytest.approx(0.003)
    assert set(gap["others_ending"]) == {
        "20:Memcpy HtoD (Pinned -> Device)",
        "20:compact_kernel",
    }


def test_a_trace_without_gpu_activity_has_no_compute_stream(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": [{"cat": "cpu_op", "name": "x", "ts": 0}]}))
    summary = summarize_trace(str(path))
    assert summary["compute_stream"] is None and summary["streams"] == {}
    assert (summary["gap_count"], summary["largest_gaps"]) == (0, [])
