# Run (on the device machine: source scripts/device_env.sh first):
#   python benchmarks/suite.py --hidden 3072 --layers 28 --seq 4096 --out-dir results
"""Runs several systems on one model point, each in its own process (so one's memory cannot
help or hurt another), and compares them measured in the same run.

Writes ``<out-dir>/suite.csv`` (one row a system, appended; GPU, versions, date and the full
config), ``<out-dir>/suite_<point>.png`` (tokens/s per system), ``<out-dir>/logs/<system>.log``
(each process's output) and prints a table of ratios against no-offload and against each peer.
A system that fails (out of memory, say) gets a row with its status and the last line of its
error, not a number.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ALL = [
    "no_offload",
    "superoffload",
    "deepspeed_zero_offload",
    "deepspeed_superoffload",
    "torchao_offload",
]
MODEL_FLAGS = ("hidden", "layers", "inter", "vocab", "seq", "batch", "steps", "clip")
COLUMNS = [
    "date", "gpu", "torch", "transformers", "system", "status", "params_b", "hidden", "layers",
    "seq", "batch", "clip", "s_per_step", "tokens_per_s", "tflops", "mfu", "peak_gpu_gib",
    "peak_host_rss_gib", "wall_s", "error", "stats", "config",
]  # fmt: skip


# What builds (or loads from its cache) each system's CPU Adam extension.
_DEEPSPEED_CPU_ADAM = "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"
PREBUILD = {
    "superoffload": "from hf_superoffload.ops._build import load_extension; load_extension()",
    "deepspeed_zero_offload": _DEEPSPEED_CPU_ADAM,
    "deepspeed_superoffload": _DEEPSPEED_CPU_ADAM,
}


def prebuild(systems: list[str]) -> None:
    """Builds the systems' CPU extensions together, before any system is timed: the builds
    are minutes of compiler time that would otherwise run one after the other, and nothing
    measured runs beside them."""
    codes = sorted({PREBUILD[s] for s in systems if s in PREBUILD})
    procs = [subprocess.Popen([sys.executable, "-c", code]) for code in codes]
    failed = [p.args[-1] for p in procs if p.wait() != 0]
    if failed:
        sys.exit(f"building a CPU extension failed: {failed}")


def run_system(system: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(HERE / "train_step.py"), "--system", system]
    for flag in MODEL_FLAGS:
        cmd += [f"--{flag}", str(getattr(args, flag))]
    if system == "superoffload":
        cmd += ["--gpu-buckets", args.gpu_buckets, "--warmup", str(args.superoffload_warmup)]
    else:
        cmd += ["--warmup", str(args.warmup)]
    start = time.perf_counter()
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"system": system, "status": "timed out", "error": f"over {args.timeout} s"}
    wall = round(time.perf_counter() - start, 1)
    logs = args.out_dir / "logs"
    logs.mkdir(exist_ok=True)
    (logs / f"{system}.log").write_text(result.stdout + result.stderr)  # e.g. auto's moves
    rows = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode == 0 and rows:
        return {**json.loads(rows[-1]), "status": "ok", "wall_s": wall}
    status, error = classify_failure(result.returncode, result.stderr)
    return {"system": system, "status": status, "error": error[:300], "wall_s": wall}


def classify_failure(returncode: int, stderr: str) -> tuple[str, str]:
    """(status, error) of a system process that gave no result row."""
    if returncode < 0:  # no traceback to read: say what ended it
        signal_name = signal.Signals(-returncode).name
        hint = " (host out of memory?)" if signal_name == "SIGKILL" else ""
        return "killed", signal_name + hint
    tracebacks = stderr.split("Traceback (most recent call last):")
    lines = tracebacks[-1].strip().splitlines() if len(tracebacks) > 1 else []
    error = lines[-1] if lines else f"exit code {returncode}"
    return ("out of memory" if "OutOfMemoryError" in error else "failed"), error


def ratio_table(rows: list[dict]) -> str:
    ok = {r["system"]: r["s_per_step"] for r in rows if r["status"] == "ok"}
    lines = [f"{'system':<24} {'s/step':>8} {'GiB':>7}  speed-up of superoffload over it"]
    ours = ok.get("superoffload")
    for row in rows:
        if row["status"] != "ok":
            lines.append(f"{row['system']:<24} {row['status']}: {row.get('error', '')[:60]}")
            continue
        speedup = f"{row['s_per_step'] / ours:.2f}x" if ours else "n/a"
        lines.append(
            f"{row['system']:<24} {row['s_per_step']:>8.3f} {row['peak_gpu_gib']:>7.1f}  {speedup}"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar([r["system"] for r in ok], [r["tokens_per_s"] for r in ok], color="#4C72B0")
    for i, r in enumerate(ok):
        ax.text(i, r["tokens_per_s"], f"{r['s_per_step']:.2f} s\n{r['peak_gpu_gib']:.0f} GiB",
                ha="center", va="bottom", fontsize=8)  # fmt: skip
    ax.set_ylabel("tokens / s")
    ax.set_title(title, fontsize=9)
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--systems", default=",".join(ALL))
    parser.add_argument("--hidden", type=int, default=3072)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--inter", type=int, default=0)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps of the peers")
    parser.add_argument(
        "--superoffload-warmup", type=int, default=14,
        help="superoffload's: gpu_buckets='auto' tunes itself over the first ~10 steps",
    )  # fmt: skip
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--gpu-buckets", default="auto")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per system")
    parser.add_argument("--out-dir", type=Path, default=Path("results"))
    args = parser.parse_args()

    args.out_dir.mkdir(parents=True, exist_ok=True)
    config = {flag: getattr(args, flag) for flag in (*MODEL_FLAGS, "warmup", "superoffload_warmup")}
    systems = args.systems.split(",")
    unknown = sorted(set(systems) - set(ALL))
    if unknown:
        sys.exit(f"unknown --systems {unknown}; choose from {ALL}")
    prebuild(systems)
    rows = []
    for system in systems:
        row = run_system(system, args)
        row["config"] = json.dumps({**config, "system": system})
        rows.append(row)
        print(
            json.dumps(
                {k: row.get(k) for k in ("system", "status", "s_per_step", "wall_s", "error")}
            )
        )
    first_ok = next((r for r in rows if r["status"] == "ok"), {})
    for row in rows:  # failed rows still say where and when
        for key in ("date", "gpu", "torch", "transformers"):
            row.setdefault(key, first_ok.get(key))
        row.setdefault("clip", args.clip)

    csv_path = args.out_dir / "suite.csv"
    new = not csv_path.exists()
    with open(csv_path, "a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS, extrasaction="ignore")
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow({**row, "stats": json.dumps(row.get("stats"))})
    point = f"h{args.hidden}-l{args.layers}-s{args.seq}-b{args.batch}-clip{args.clip:g}"
    title = f"{first_ok.get('gpu', '?')}, {first_ok.get('params_b', '?')}B params, {point}"
    plot(rows, args.out_dir / f"suite_{point}.png", title)
    print(title)
    print(ratio_table(rows))
    os.sync()


if __name__ == "__main__":
    main()
