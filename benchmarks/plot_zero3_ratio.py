# Run: python benchmarks/plot_zero3_ratio.py docs/data/suite_zero3_ratio_h100_3b_seq4096_2026-11-2[45].csv docs/suite_zero3_ratio_h100_3b_seq4096.png
"""Seconds per step against peak GPU memory on the ZeRO-3 path, one point per run of the suite CSVs
(docs/runs/2026-11-24-zero3-gpu-tail-h100.md): hf_superoffload at each
``ratio`` and DeepSpeed ZeRO-Offload, every step clipping or none (``--clip-rate 0``)."""

from __future__ import annotations

import csv
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from plot_lean import finish

NAMES = {
    "superoffload_zero3": "hf_superoffload on ZeRO-3",
    "deepspeed_zero_offload": "ZeRO-Offload",
}
MARKERS = {"superoffload_zero3": "o", "deepspeed_zero_offload": "s"}


def main(*paths: str) -> None:
    """``paths``: one or more suite CSVs (each row with a ``call`` column), then the PNG."""
    *csv_paths, png_path = paths
    rows = []
    for csv_path in csv_paths:
        with open(csv_path, newline="") as handle:
            rows += [r for r in csv.DictReader(handle) if r["status"] == "ok"]
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in rows:
        never = r["clip_rate"] not in ("", None) and float(r["clip_rate"]) == 0.0
        ratio = json.loads(r["config"])["ratio"]
        gib, seconds = float(r["peak_gpu_gib"]), float(r["s_per_step"])
        color = "#55A868" if never else "#C44E52"
        ax.scatter(gib, seconds, marker=MARKERS[r["system"]], color=color)
        label = f"ratio {ratio:g}, call {r['call']}"
        ax.annotate(label, (gib, seconds), fontsize=6, xytext=(4, 3), textcoords="offset points")
    for system, marker in MARKERS.items():
        ax.scatter([], [], marker=marker, color="gray", label=NAMES[system])
    ax.scatter([], [], color="#C44E52", label="every step clips")
    ax.scatter([], [], color="#55A868", label="no step clips (--clip-rate 0)")
    ax.set_ylim(bottom=0)
    finish(fig, ax, rows, "s/step", png_path)


if __name__ == "__main__":
    main(*sys.argv[1:])
