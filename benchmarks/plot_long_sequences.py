# Run: python benchmarks/plot_long_sequences.py docs/data/long_sequences_llama31_8b_2xh100_2026-11-26.csv docs/long_sequences_llama31_8b_2xh100.png
"""Seconds a step against sequence length, one line a system, from the CSV that
dev/long_sequences.sh writes: lines join lengths a doubling apart (a length not measured on
these GPUs leaves a gap), a launch stopped before its last step shows as an open marker of its
logged steps, and launches that did not run are left out."""

from __future__ import annotations

import csv
import itertools
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

LABELS = {
    "superoffload": "SuperOffload",
    "superoffload_actoffload": "SuperOffload, layer inputs on the host",
    "zerooffload": "DeepSpeed ZeRO-Offload",
    "zerooffload_actoffload": "ZeRO-Offload, layer inputs on the host",
}


def main(csv_path: str, png_path: str) -> None:
    with open(csv_path, newline="") as handle:
        rows = [r for r in csv.DictReader(handle) if r["s_per_step"]]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system in sorted({r["system"] for r in rows}):
        mine = [r for r in rows if r["system"] == system]
        points = sorted(
            (int(r["seq"]), float(r["s_per_step"])) for r in mine if r["status"] == "ok"
        )
        color = None
        for (a, sa), (b, sb) in itertools.pairwise(points):
            if b == 2 * a:
                (line,) = ax.plot([a, b], [sa, sb], color=color, linestyle="-")
                color = line.get_color()
        label = LABELS.get(system, system)
        (dots,) = ax.plot(
            [p[0] for p in points], [p[1] for p in points], "o", color=color, label=label
        )
        partial = [(int(r["seq"]), float(r["s_per_step"])) for r in mine if r["status"] != "ok"]
        if partial:
            ax.plot(
                [p[0] for p in partial],
                [p[1] for p in partial],
                "o",
                mfc="none",
                color=dots.get_color(),
                label=f"{label}, steps logged before the launch ended",
            )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens, one sequence a step over 2 GPUs)")
    ax.set_ylabel("s / step")
    ax.set_title(f"{rows[0]['model']}, Ulysses over 2 x {rows[0]['gpu']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:3])
