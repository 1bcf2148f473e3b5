"""What each CUDA stream did in a profiled window, and what the compute stream waited for.

Reads a Chrome trace written by ``torch.profiler`` (``export_chrome_trace``) and summarizes its
GPU activity (kernels, memcpys, memsets) per stream: busy seconds, bytes copied each way, first
and last activity. For the stream that ran the most kernel time (the compute stream) it lists
the idle gaps over ``min_gap_s`` and, for each, the work of the other streams that ended inside
the gap or within a millisecond after it: what the compute stream most likely waited for.
benchmarks/timeline.py calls it with ``--cuda-trace``; it also runs alone:

    python benchmarks/stream_summary.py trace.json
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def gpu_events(trace: dict) -> list[dict]:
    """The trace's GPU activities as dicts of name, kind, stream, start and end (seconds from
    the first activity) and bytes (memcpys)."""
    raw = [e for e in trace.get("traceEvents", []) if e.get("cat") in GPU_CATEGORIES]
    if not raw:
        return []
    origin = min(e["ts"] for e in raw)
    events = []
    for e in raw:
        args = e.get("args", {})
        start = (e["ts"] - origin) / 1e6
        events.append(
            {"name": e["name"], "kind": e["cat"], "stream": args.get("stream", e.get("tid")),
             "start": start, "end": start + e.get("dur", 0) / 1e6,
             "bytes": args.get("bytes", 0)}
        )  # fmt: skip
    return sorted(events, key=lambda e: e["start"])


def _direction(name: str) -> str:
    for key in ("HtoD", "DtoH", "DtoD", "HtoH"):
        if key in name:
            return key
    return "other"


def per_stream(events: list[dict]) -> dict:
    table: dict = defaultdict(lambda: defaultdict(float))
    for e in events:
        row = table[e["stream"]]
        kind = e["kind"] if e["kind"] != "gpu_memcpy" else "memcpy_" + _direction(e["name"])
        row[kind + "_s"] += e["end"] - e["start"]
        row[kind + "_count"] += 1
        if e["bytes"]:
            row[kind + "_GB"] += e["bytes"] / 1e9
        row["first_s"] = min(row.get("first_s", e["start"]), e["start"])
        row["last_s"] = max(row["last_s"], e["end"])
    return {str(s): {k: round(v, 4) for k, v in row.items()} for s, row in table.items()}


def compute_gaps(events: list[dict], min_gap_s: float = 0.002, limit: int = 20) -> dict:
    kernel_time: dict = defaultdict(float)
    for e in events:
        if e["kind"] == "kernel":
            kernel_time[e["stream"]] += e["end"] - e["start"]
    if not kernel_time:
        return {"compute_stream": None, "gaps_total_s": 0.0, "gap_count": 0, "largest_gaps": []}
    compute = max(kernel_time, key=kernel_time.get)
    mine = [e for e in events if e["stream"] == compute]
    others = [e for e in events if e["stream"] != compute]
    gaps, busy_until = [], mine[0]["end"]
    for e in mine[1:]:
        if e["start"] - busy_until >= min_gap_s:
            lo, hi = busy_until, e["start"]
            ended = [o for o in others if lo <= o["end"] <= hi + 1e-3]
            by_kind: dict = defaultdict(lambda: [0, 0.0])
            for o in ended:
                key = f"{o['stream']}:{o['name'][:48]}"
                by_kind[key][0] += 1
                by_kind[key][1] = max(by_kind[key][1], o["end"])
            gaps.append(
                {"from_s": round(lo, 4), "gap_s": round(hi - lo, 4),
                 "next_kernel": e["name"][:60],
                 "others_ending": {k: [n, round(t, 4)] for k, (n, t) in by_kind.items()}}
            )  # fmt: skip
        busy_until = max(busy_until, e["end"])
    total = sum(g["gap_s"] for g in gaps)
    gaps.sort(key=lambda g: -g["gap_s"])
    return {"compute_stream": str(compute), "gaps_total_s": round(total, 4),
            "gap_count": len(gaps), "largest_gaps": gaps[:limit]}  # fmt: skip


def summarize_trace(path: str, min_gap_s: float = 0.002) -> dict:
    with open(path) as handle:
        events = gpu_events(json.load(handle))
    span = (max(e["end"] for e in events) - events[0]["start"]) if events else 0.0
    return {"window_s": round(span, 4), "streams": per_stream(events),
            **compute_gaps(events, min_gap_s)}  # fmt: skip


if __name__ == "__main__":
    print(json.dumps(summarize_trace(sys.argv[1]), indent=1))
