# Run: python benchmarks/plot_lean.py docs/data/lean_h100_3b_seq4096_2026-11-24.csv docs/lean_h100_3b_seq4096.png
"""Speed against peak GPU memory for each system and clip rate, from a CSV of lean-offload
runs (docs/runs/2026-11-24-lean-offload-h100.md): speed as the ratio to no offload's s/step."""

from __future__ import annotations

import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

COLORS = {"0.0": "#55A868", "0.1": "#4C72B0", "0.5": "#8172B2", "1.0": "#C44E52"}


def main(csv_path: str, png_path: str) -> None:
    with open(csv_path, newline="") as handle:
        rows = list(csv.DictReader(handle))
    baseline = min(float(r["s_per_step"]) for r in rows if r["system"] == "no_offload")
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in rows:
        ratio = baseline / float(r["s_per_step"])
        gib = float(r["peak_gpu_gib"])
        if r["system"] != "superoffload":
            ax.scatter(gib, ratio, marker="s", color="black")
            ax.annotate(r["system"], (gib, ratio), fontsize=7, xytext=(4, -10),
                        textcoords="offset points")  # fmt: skip
            continue
        label = r["gpu_buckets"] + (
            f" cap {r['gpu_memory_cap_gib']}" if r["gpu_memory_cap_gib"] else ""
        )
        if r["clip_first"] not in ("", "0"):
            label += f", clips first {r['clip_first']}"
        if "auto" not in r["cast"]:
            label += ", " + r["cast"].split(" (")[1].rstrip(")")
        ax.scatter(gib, ratio, color=COLORS.get(r["clip_rate"], "gray"))
        ax.annotate(label, (gib, ratio), fontsize=6, xytext=(4, 3), textcoords="offset points")
    for rate, color in COLORS.items():
        ax.scatter([], [], color=color, label=f"superoffload, {float(rate):.0%} of steps clip")
    ax.axhline(1.0, color="gray", lw=0.5)
    finish(fig, ax, rows, f"speed / no offload ({baseline:.3f} s/step)", png_path)


def finish(fig, ax, rows: list[dict], ylabel: str, png_path: str) -> None:
    """Axes, title (the rows' GPU and model size), legend, and the file: shared by the
    speed-against-memory plots."""
    ax.set_xlabel("peak GPU memory (GiB)")
    ax.set_ylabel(ylabel)
    ax.set_xlim(left=0)
    ax.set_title(f"{rows[0]['gpu']}, {rows[0]['params_b']}B params, seq 4096, batch 4", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:])
