# Run (on the device machine: source dev/gpu_env.sh first):
#   python benchmarks/suite.py --hidden 3072 --layers 28 --seq 4096 --out-dir results
#   (--systems picks a subset: see --help; all of them do not fit one 600 s device call)
"""Runs several systems on one model point, each in its own process (so one's memory cannot
help or hurt another), and compares them measured in the same run.

Writes ``<out-dir>/suite.csv`` (one row a system, appended as each finishes; GPU, versions,
date and the full config), ``<out-dir>/suite_<point>.png`` (tokens/s per system),
``<out-dir>/logs/<point>/<system>.log`` (each process's output, and ``prebuild.log``) and
prints a table of ratios against no-offload and against each peer. A system that fails (out
of memory, killed, timed out, its extension failed to build) gets a row with its status and
the last line of its error, not a number.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from importlib.metadata import version
from pathlib import Path

import clip_rate
import psutil
from systems import SYSTEMS, zero_extra
from tqdm import tqdm

HERE = Path(__file__).resolve().parent
ALL = [
    "no_offload",
    "superoffload",
    "deepspeed_zero_offload",
    "superoffload_zero3",
    "deepspeed_superoffload",
    "torchao_offload",
    "superoffload_zero3_compact",
    "deepspeed_zero3",
]
MODEL_FLAGS = ("hidden", "layers", "inter", "vocab", "seq", "batch", "steps", "clip", "ratio")
COLUMNS = [
    "date", "gpu", "torch", "transformers", "system", "status", "params_b", "hidden", "layers",
    "seq", "batch", "clip", "s_per_step", "tokens_per_s", "tflops", "mfu", "peak_gpu_gib",
    "peak_host_rss_gib", "peak_host_used_gib", "wall_s", "optimizer", "error", "clip_rate",
    "clip_first", "clipped_share", "warmup_steps", "tail_moves_timed", "stats", "phases",
    "host_rss_gib", "host_bytes", "world", "tokens_per_s_per_gpu", "ranks", "plan_per_rank",
    "config",
]  # fmt: skip


TERM_GRACE_S = 40  # torchrun waits 30 s for its workers to end on SIGTERM before it kills them

# What builds (or loads from its cache) each system's CPU Adam extensions.
_DEEPSPEED_CPU_ADAM = "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"
_OURS = "from hf_superoffload.ops._build import load_extension; load_extension()"
PREBUILD = {
    "superoffload": (_OURS,),
    "deepspeed_zero_offload": (_DEEPSPEED_CPU_ADAM,),
    # DeepSpeed builds DeepSpeedCPUAdam as the base optimizer; ours steps the host sub groups.
    "superoffload_zero3": (_OURS, _DEEPSPEED_CPU_ADAM),
    "superoffload_zero3_compact": (_OURS, _DEEPSPEED_CPU_ADAM),
    "deepspeed_superoffload": (_DEEPSPEED_CPU_ADAM,),
}


def prebuild(systems: list[str], log: Path) -> dict[str, str]:
    """Builds the systems' CPU extensions together, before any system is timed: the builds
    are minutes of compiler time that would otherwise run one after the other, and nothing
    measured runs beside them. Returns {system: error} for the systems whose build failed."""
    codes = sorted({code for s in systems for code in PREBUILD.get(s, ())})
    with open(log, "w") as out:
        procs = {
            code: subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=out)
            for code in codes
        }
        failed = {code for code, proc in procs.items() if proc.wait() != 0}
    return {
        system: f"building its CPU extension failed (see {log})"
        for system in systems
        if failed.intersection(PREBUILD.get(system, ()))
    }


def environment() -> dict:
    """Where and when, for rows of systems that failed before reporting it themselves (read
    without initialising CUDA here: a context in this process would take GPU memory from the
    systems)."""
    gpus = []
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
        smi = subprocess.run(query, capture_output=True, text=True)
        gpus = smi.stdout.strip().splitlines() if smi.returncode == 0 else []
    return {
        "date": datetime.date.today().isoformat(),
        "gpu": gpus[0] if gpus else "no GPU (nvidia-smi found none)",
        "torch": version("torch"),
        "transformers": version("transformers"),
    }


def runs(systems: list[str], gpu_buckets: list[str]) -> list[tuple[str, str, str | None]]:
    """(row name, system, gpu_buckets) per process to run: superoffload once per
    ``--gpu-buckets`` value, the first named plainly (the ratio table's reference), the others
    after their value, e.g. ``superoffload_gpu_buckets_12``."""
    out = []
    for system in systems:
        if system != "superoffload":
            out.append((system, system, None))
            continue
        for i, value in enumerate(gpu_buckets):
            out.append((system if i == 0 else f"{system}_gpu_buckets_{value}", system, value))
    return out


class HostMemoryPeak:
    """The peak of the host's used memory (all processes: psutil's ``used``) above its level
    when the block starts, sampled on a thread. Unlike the trainer's own RSS it counts a
    system's helper processes and their shared memory (DeepSpeed's super_offload runs its CPU
    optimizer in a second process)."""

    def __init__(self, interval: float = 0.5):
        self.interval = interval
        self.peak_bytes = 0
        self._stop = threading.Event()

    def __enter__(self):
        self._baseline = psutil.virtual_memory().used
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while True:
            used = psutil.virtual_memory().used - self._baseline
            self.peak_bytes = max(self.peak_bytes, used)
            if self._stop.wait(self.interval):
                return

    @property
    def peak_gib(self) -> float:
        return round(self.peak_bytes / 2**30, 2)


# The systems hf_superoffload's engines build, which read its engine variables (HF_SUPEROFFLOAD_
# CAST, _MOMENTS, ...). The others, plain DeepSpeed (whose config without super_offload refuses
# them) or PyTorch, read none: they run without them, whatever the suite's environment holds.
READS_ENGINE_VARIABLES = ("superoffload", "superoffload_zero3", "superoffload_zero3_compact")


def system_environment(system: str, nproc: int) -> dict[str, str]:
    from hf_superoffload.zero3.config import ENGINE_VARIABLES

    env = dict(os.environ)
    if system not in READS_ENGINE_VARIABLES:
        for name in ENGINE_VARIABLES:
            env.pop(name, None)
    if nproc > 1:
        # torchrun sets OMP_NUM_THREADS=1, which would starve DeepSpeed's OpenMP CPU Adam:
        # each rank gets its share of the cores, as one process gets all of them.
        threads = max(1, len(os.sched_getaffinity(0)) // nproc)
        env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", str(threads))
    return env


def run_system(
    name: str, system: str, gpu_buckets: str | None, args: argparse.Namespace, logs: Path
) -> dict:
    cmd = [sys.executable, str(HERE / "train_step.py"), "--system", system]
    env = system_environment(system, args.nproc)
    if args.nproc > 1:  # data parallel on N GPUs; rank 0 prints the row of all ranks
        cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
    for flag in MODEL_FLAGS:
        cmd += [f"--{flag}", str(getattr(args, flag))]
    if args.model_config:
        cmd += ["--model-config", str(args.model_config)]
    if args.clip_rate is not None:
        cmd += ["--clip-rate", str(args.clip_rate), "--clip-first", str(args.clip_first)]
    if SYSTEMS[system].has_cast:  # the others refuse one (they have none)
        cmd += ["--cast", args.cast]
    if system == "superoffload":
        cmd += ["--gpu-buckets", gpu_buckets, "--warmup", str(args.superoffload_warmup)]
        if args.gpu_memory_cap is not None:
            cmd += ["--gpu-memory-cap", str(args.gpu_memory_cap)]
    else:
        cmd += ["--warmup", str(args.warmup)]
    start = time.perf_counter()
    with HostMemoryPeak() as host:
        returncode, stdout, stderr = run_logged(cmd, env, args.timeout, logs / f"{name}.log")
    wall = round(time.perf_counter() - start, 1)
    if returncode is None:
        return {"system": name, "status": "timed out", "error": f"over {args.timeout} s",
                "wall_s": wall}  # fmt: skip
    rows = [line for line in stdout.splitlines() if line.startswith("{")]
    if returncode == 0 and rows:
        measured = {
            "system": name,
            "status": "ok",
            "wall_s": wall,
            "peak_host_used_gib": host.peak_gib,
        }
        row = {**json.loads(rows[-1]), **measured}
        mismatch = optimizer_mismatch(row)
        if mismatch:  # train_step.py refuses this itself; never count the wrong system's number
            return {"system": name, "status": "failed", "error": mismatch, "wall_s": wall,
                    "optimizer": row.get("optimizer")}  # fmt: skip
        return row
    status, error = classify_failure(returncode, stderr)
    return {"system": name, "status": status, "error": error[:300], "wall_s": wall}


def run_logged(
    cmd: list[str], env: dict | None, timeout: float, log: Path
) -> tuple[int | None, str, str]:
    """Run one system process, its output written to files as it comes (so a run cut short
    leaves its log, e.g. how far a large model's start-up got); return (exit code, or None if
    it ran past ``timeout``, stdout, stderr). The log ends up as stdout then stderr.

    A timeout sends SIGTERM first: torchrun starts each worker in a session of its own, so
    only torchrun itself can end them, which it does on SIGTERM (a SIGKILL would orphan them,
    holding the GPUs and host memory the next system needs). SIGKILL follows after a grace
    period, to the process's whole group."""
    out_path = log.with_suffix(".stdout")
    with open(out_path, "w") as out, open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=TERM_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            returncode = None
        finally:
            # A worker that outlived its launcher (or a launcher that exited without its
            # workers) would hold the next system's memory: end the group in every case.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    stdout, stderr = out_path.read_text(), log.read_text()
    log.write_text(stdout + stderr)
    out_path.unlink()
    return returncode, stdout, stderr


def optimizer_mismatch(row: dict) -> str | None:
    """Why a result row is not the system it names (the ZeRO optimizer class DeepSpeed built is
    not the one the system expects), or None."""
    expected = row.get("expected_optimizer")
    if expected and row.get("optimizer") != expected:
        return f"optimizer mismatch: expected {expected}, ran {row.get('optimizer')}"
    return None


def classify_failure(returncode: int, stderr: str) -> tuple[str, str]:
    """(status, error) of a system process that gave no result row."""
    if returncode < 0:  # no traceback to read: say what ended it
        number = -returncode
        name = signal.Signals(number).name if number in set(signal.Signals) else f"signal {number}"
        hint = " (host out of memory?)" if name == "SIGKILL" else ""
        return "killed", name + hint
    text = re.sub(r"^\[rank\d+\]: ?", "", stderr, flags=re.MULTILINE)  # torchrun's prefix
    status = "out of memory" if "OutOfMemoryError" in text else "failed"
    if "ChildFailedError" in text:  # torchrun: a worker failed, and its summary ends the log
        root = text.split("Root Cause (first observed failure):")[-1]
        signalled = re.search(r"Signal \d+ \((\w+)\) received", root)
        if signalled:  # e.g. the host's OOM killer took a rank
            hint = " (host out of memory?)" if signalled.group(1) == "SIGKILL" else ""
            return "killed", f"a rank: {signalled.group(1)}{hint}"
        text = text[: text.rfind("Traceback (most recent call last):")]  # not torchrun's own
    tracebacks = text.split("Traceback (most recent call last):")
    block = tracebacks[-1].strip().splitlines() if len(tracebacks) > 1 else []
    # The exception's line: not a frame (indented) nor a torch log line after it ("E1126 ...")
    lines = [line for line in block if line[:1].strip() and not TORCH_LOG.match(line)]
    error = lines[-1] if lines else f"exit code {returncode}"
    return status, error


TORCH_LOG = re.compile(r"[DIWEF]\d{4} \d\d:\d\d:\d\d")


def append_rows(csv_path: Path, rows: list[dict]) -> None:
    if csv_path.exists():
        with open(csv_path, newline="") as handle:
            header = next(csv.reader(handle), None)
        if header != COLUMNS:
            sys.exit(
                f"{csv_path} has other columns (written by another version of suite.py); "
                "pass a new --out-dir"
            )
    new = not csv_path.exists()
    with open(csv_path, "a", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS, extrasaction="ignore")
        if new:
            writer.writeheader()
        for row in rows:
            nested = ("stats", "phases", "host_rss_gib", "host_bytes", "ranks", "plan_per_rank")
            writer.writerow({**row, **{key: json.dumps(row.get(key)) for key in nested}})


def ratio_table(rows: list[dict]) -> str:
    ok = {r["system"]: r["s_per_step"] for r in rows if r["status"] == "ok"}
    # Ours: the standalone engine when it ran, else the ZeRO-3 path (e.g. a multi-GPU suite).
    reference = "superoffload" if "superoffload" in ok else "superoffload_zero3"
    lines = [f"{'system':<24} {'s/step':>8} {'GiB':>7}  speed-up of {reference} over it"]
    ours = ok.get(reference)
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


def plot_speed_memory(rows: list[dict], path: Path, title: str) -> None:
    """Tokens/s against peak GPU memory, one labelled point per row: offload is worth its
    speed only at the memory it saves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in ok:
        ax.scatter(r["peak_gpu_gib"], r["tokens_per_s"], color="#4C72B0")
        ax.annotate(r["system"], (r["peak_gpu_gib"], r["tokens_per_s"]), fontsize=7,
                    xytext=(4, 4), textcoords="offset points")  # fmt: skip
    ax.set_xlabel("peak GPU memory (GiB)")
    ax.set_ylabel("tokens / s")
    ax.set_xlim(left=0)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--systems", default=",".join(ALL),
        help=f"comma list of {', '.join(ALL)} (default: all; see benchmarks/systems.py)",
    )  # fmt: skip
    parser.add_argument(
        "--model-config", type=Path, default=None,
        help="a config.json: that architecture with random weights (train_step.py's flag)",
    )  # fmt: skip
    parser.add_argument("--hidden", type=int, default=3072)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--inter", type=int, default=0)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps of the peers")
    parser.add_argument(
        "--superoffload-warmup", type=int, default=20,
        help="superoffload's: gpu_tail='auto' may place buckets for up to ~18 steps, and "
        "train_step.py refuses to time while it still does",
    )  # fmt: skip
    parser.add_argument("--clip", type=float, default=1.0)
    clip_rate.add_arguments(parser)
    parser.add_argument(
        "--cast", default="auto",
        help="the SuperOffload systems' cast ('auto', 'gpu' or 'cpu'): superoffload and "
        "superoffload_zero3*; the others have none and run as they are",
    )  # fmt: skip
    parser.add_argument(
        "--gpu-memory-cap", type=float, default=None,
        help="superoffload's gpu_tail_cap in GiB (the tail's optimizer state)",
    )  # fmt: skip
    parser.add_argument(
        "--ratio", type=float, default=1.0,
        help="the DeepSpeed systems' offload_optimizer.ratio (1.0: all optimizer state on the host)",
    )  # fmt: skip
    parser.add_argument(
        "--gpu-buckets", default="auto",
        help="superoffload's n': 'auto' or a count; a comma list runs one superoffload row each "
        "(e.g. auto,12 adds a fixed small tail beside auto)",
    )  # fmt: skip
    parser.add_argument(
        "--timeout", type=int, default=540,
        help="seconds per system (the device machine stops a call at 600 s)",
    )  # fmt: skip
    parser.add_argument(
        "--nproc", type=int, default=1,
        help="GPUs per system (torchrun; --batch is per GPU): no_offload runs as DDP, "
        "superoffload as replicas, the DeepSpeed systems as ZeRO-3 data parallelism",
    )  # fmt: skip
    parser.add_argument("--out-dir", type=Path, default=Path("results"))
    args = parser.parse_args()

    flags = (*MODEL_FLAGS, "warmup", "superoffload_warmup", "clip_rate", "clip_first", "cast",
             "gpu_memory_cap", "nproc")  # fmt: skip
    config = {flag: getattr(args, flag) for flag in flags}
    config["model_config"] = str(args.model_config) if args.model_config else None
    # BENCH_ZERO_EXTRA's zero_optimization keys (the DeepSpeed systems'), checked and kept in
    # every row's config so that rows made with them tell themselves apart.
    try:
        config["zero_extra"] = zero_extra() or None
    except ValueError as error:
        sys.exit(str(error))
    systems = args.systems.split(",")
    unknown = sorted(set(systems) - set(ALL))
    if unknown:
        sys.exit(f"unknown --systems {unknown}; choose from {ALL}")
    shape = args.model_config.stem if args.model_config else f"h{args.hidden}-l{args.layers}"
    point = f"{shape}-s{args.seq}-b{args.batch}-clip{args.clip:g}"
    if args.clip_rate is not None:
        point += f"-rate{args.clip_rate:g}" + (
            f"-first{args.clip_first}" if args.clip_first else ""
        )
    if args.nproc > 1:
        point += f"-gpus{args.nproc}"
    if args.cast != "auto":
        point += f"-cast{args.cast}"
    if args.gpu_memory_cap is not None:
        point += f"-cap{args.gpu_memory_cap:g}"
    logs = args.out_dir / "logs" / point
    logs.mkdir(parents=True, exist_ok=True)
    csv_path = args.out_dir / "suite.csv"
    append_rows(csv_path, [])  # a file of other columns stops the suite before any run
    where = environment()
    build_failures = prebuild(systems, logs / "prebuild.log")
    rows = []
    planned = runs(systems, args.gpu_buckets.split(","))
    # One bar over the system processes (each takes a minute or more); lines go above it.
    progress = tqdm(planned, desc="suite", unit="system", file=sys.stderr, dynamic_ncols=True)
    for name, system, gpu_buckets in progress:
        progress.set_postfix_str(name)
        if system in build_failures:
            row = {"system": name, "status": "failed", "error": build_failures[system]}
        else:
            row = run_system(name, system, gpu_buckets, args, logs)
        run_config = {**config, "system": system}
        if not SYSTEMS[system].has_cast:
            del run_config["cast"]  # not passed: it has none
        if gpu_buckets is not None:
            run_config["gpu_buckets"] = gpu_buckets
        row = {**where, "clip": args.clip, "clip_rate": args.clip_rate, **row,
               "config": json.dumps(run_config)}  # fmt: skip
        append_rows(csv_path, [row])  # row by row: a later hang loses nothing before it
        rows.append(row)
        keys = ("system", "status", "s_per_step", "wall_s", "optimizer", "error")
        summary = {k: row.get(k) for k in keys}
        progress.write(json.dumps(summary), file=sys.stdout)
    first_ok = next((r for r in rows if r["status"] == "ok"), None)
    title = f"{where['gpu']}, {first_ok['params_b'] if first_ok else '?'}B params, {point}"
    if first_ok:
        plot(rows, args.out_dir / f"suite_{point}.png", title)
        plot_speed_memory(rows, args.out_dir / f"suite_{point}_memory.png", title)
    print(title)
    print(ratio_table(rows))
    os.sync()


if __name__ == "__main__":
    main()
