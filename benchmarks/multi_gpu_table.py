# Run: python benchmarks/multi_gpu_table.py results/suite.csv
#   (dev/multi_gpu.sh prints it last, over the rows of all its stages)
"""The multi-GPU runs of one suite.csv as one short table, then the comparisons they were run
for: tokens/s per GPU on N GPUs against one GPU of the same host (clip 1.0), the ZeRO-3 path
against DDP without offload (no clipping), and each model's measured peaks against the plan.

TFLOPS are per GPU. For an MoE model (a config with ``num_experts_per_tok``) the suite's
figure counts every expert's matmuls; here it is rescaled to the experts a token goes through
(top-k of them), which is the work done. Host B/param is the host RSS summed over the ranks
over all params (the ranks share the host).
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def active_share(row: dict) -> float:
    """The model FLOPs per token of the experts a token uses over those of all experts (1.0
    for a dense model), with the suite's formula: 6 x matmul params + 12 x layers x hidden x
    seq, where the matmul params are all but the input embedding (untied)."""
    config = json.loads(row["config"] or "{}").get("model_config")
    if not config:
        return 1.0
    path = Path(config) if Path(config).is_absolute() else REPO / config
    c = json.loads(path.read_text())
    experts, top_k = c.get("num_experts"), c.get("num_experts_per_tok")
    if not experts or not top_k:
        return 1.0
    layers, hidden = c["num_hidden_layers"], c["hidden_size"]
    moe_layers = layers - len(c.get("mlp_only_layers") or [])
    idle = (experts - top_k) * 3 * hidden * c["moe_intermediate_size"] * moe_layers
    matmul = float(row["params_b"]) * 1e9 - c["vocab_size"] * hidden
    attention = 12 * layers * hidden * int(row["seq"])
    return (6 * (matmul - idle) + attention) / (6 * matmul + attention)


def point(row: dict) -> str:
    config = json.loads(row["config"] or "{}")
    if config.get("model_config"):
        model = Path(config["model_config"]).stem
    elif row["params_b"]:
        model = f"{float(row['params_b']):.2f}B"
    else:  # a failed row has no params count
        model = f"h{config.get('hidden')}-l{config.get('layers')}"
    return f"{model} clip {float(row['clip']):g}"


def cells(row: dict) -> list[str]:
    config = json.loads(row["config"] or "{}")
    gpus = str(config.get("nproc", row["world"] or "?"))
    head = [point(row), row["system"], gpus]
    if row["status"] != "ok":
        return [*head, f"{row['status']}: {row['error'][:70]} ({row['wall_s']} s)"]
    plan = json.loads(row["plan_per_rank"]) if row["plan_per_rank"] not in ("", "null") else None
    ranks = json.loads(row["ranks"]) if row["ranks"] not in ("", "null") else None
    host_rank = max(r["peak_host_rss_gib"] for r in ranks) if ranks else row["peak_host_rss_gib"]
    params = float(row["params_b"]) * 1e9
    b_param = float(row["peak_host_rss_gib"]) * 2**30 / params
    gpu = f"{float(row['peak_gpu_gib']):.1f}" + (f" ({plan['gpu_gib']:.1f})" if plan else "")
    host = f"{float(host_rank):.1f}" + (f" ({plan['host_gib']:.1f})" if plan else "")
    tflops = float(row["tflops"]) * active_share(row)
    return [*head, f"{float(row['s_per_step']):.3f}", f"{float(row['tokens_per_s_per_gpu']):,.0f}",
            f"{tflops:.0f}", gpu, host, f"{b_param:.1f}", f"{row['wall_s']}"]  # fmt: skip


HEADER = ["point", "system", "GPUs", "s/step", "tok/s/GPU", "TFLOPS/GPU", "GPU GiB (plan)",
          "host GiB/rank (plan)", "host B/param", "wall s"]  # fmt: skip


def comparisons(rows: list[dict]) -> list[str]:
    ok = [r for r in rows if r["status"] == "ok"]

    def find(system: str, clip: float, gpus: int, model: bool = False) -> dict | None:
        for r in ok:
            config = json.loads(r["config"] or "{}")
            if (r["system"] == system and float(r["clip"]) == clip
                    and int(config.get("nproc", 1)) == gpus
                    and bool(config.get("model_config")) == model):  # fmt: skip
                return r
        return None

    lines = []
    many = sorted({int(json.loads(r["config"]).get("nproc", 1)) for r in ok} - {1})
    for n in many:
        for system, target in (
            ("superoffload_zero3", " (target >= 0.95)"),
            ("deepspeed_zero3", ""),
        ):
            one, multi = find(system, 1.0, 1), find(system, 1.0, n)
            if one and multi:
                ratio = float(multi["tokens_per_s_per_gpu"]) / float(one["tokens_per_s_per_gpu"])
                lines.append(f"scaling, clip 1.0, {system}: tokens/s per GPU on {n} GPUs / on 1 GPU"
                             f" = {ratio:.3f}{target}")  # fmt: skip
        ours, ddp = find("superoffload_zero3", 0.0, n), find("no_offload", 0.0, n)
        if ours and ddp:
            speed = float(ddp["s_per_step"]) / float(ours["s_per_step"])
            lines.append(f"no clipping, {n} GPUs: ZeRO-3 SuperOffload {float(ours['s_per_step']):.3f}"
                         f" s/step at {float(ours['peak_gpu_gib']):.1f} GiB, DDP without offload "
                         f"{float(ddp['s_per_step']):.3f} s at {float(ddp['peak_gpu_gib']):.1f} GiB:"
                         f" {speed:.2f}x DDP's speed")  # fmt: skip
    for r in ok:
        plan = json.loads(r["plan_per_rank"]) if r["plan_per_rank"] not in ("", "null") else None
        if not plan or not json.loads(r["config"]).get("model_config"):
            continue
        ranks = json.loads(r["ranks"]) if r["ranks"] not in ("", "null") else []
        host = max((x["peak_host_rss_gib"] for x in ranks), default=float(r["peak_host_rss_gib"]))
        lines.append(f"{point(r)}: measured / plan per rank: GPU {float(r['peak_gpu_gib']) / plan['gpu_gib']:.3f}, "
                     f"host {host / plan['host_gib']:.3f}")  # fmt: skip
    return lines


def main() -> None:
    with open(sys.argv[1], newline="") as handle:
        rows = list(csv.DictReader(handle))
    table = [HEADER] + [cells(r) for r in rows]
    full = [line for line in table if len(line) == len(HEADER)]  # a failed row ends early
    widths = [max(len(line[i]) for line in full) for i in range(len(HEADER))]
    for line in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=False)).rstrip())
    for line in comparisons(rows):
        print(line)


if __name__ == "__main__":
    main()
