# Run: python benchmarks/plot_compact_forward.py docs/data/compact_forward_suite_h200_2026-11-27.csv docs/compact_forward_h200_3b_machines.png
"""Seconds a step of fp32 and compact moments on each machine of the compact-forward run log,
one bar a row of its suite CSV (machine, moments, variant), grouped by machine: rows of one
machine compare, rows of two do not."""

from __future__ import annotations

import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Patch

COLOURS = {"superoffload_zero3": "tab:blue", "superoffload_zero3_compact": "tab:orange"}
MOMENTS = {"superoffload_zero3": "fp32 moments", "superoffload_zero3_compact": "compact moments"}


def main(csv_path: str, png_path: str) -> None:
    with open(csv_path, newline="") as handle:
        rows = [r for r in csv.DictReader(handle) if r["s_per_step"]]
    fig, ax = plt.subplots(figsize=(12, 4.5))
    x, ticks, labels, previous = 0.0, [], [], None
    for row in rows:
        if previous is not None and row["run"] != previous:
            x += 0.8  # a gap between machines
        previous = row["run"]
        ax.bar(x, float(row["s_per_step"]), color=COLOURS[row["system"]], width=0.8)
        ticks.append(x)
        labels.append(f"{row['run']} {row['variant'][:40]}".strip())
        x += 1.0
    ax.set_xticks(ticks, labels, rotation=90, fontsize=6)
    ax.set_ylabel("s/step")
    ax.set_title("3.37B, seq 4096, batch 4, ZeRO-3 ratio 1.0, no clipping; 1 x H200 per machine")
    ax.legend(
        handles=[Patch(color=c, label=MOMENTS[system]) for system, c in COLOURS.items()],
        loc="upper left",
    )
    fig.tight_layout()
    fig.savefig(png_path, dpi=130)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
