"""CPU Adam benchmark: hf_superoffload.ops against torch AdamW, DeepSpeed CPUAdam and STREAM.

    python benchmarks/cpu_adam.py --numel 8000000 --threads 2          # here
    source dev/gpu_env.sh && python benchmarks/cpu_adam.py --threads 16 --csv out.csv

Every method updates one flat fp32 tensor of --numel params. "GB/s" is effective bandwidth:
the bytes each method must move per param (column B/p) times params/s. An Adam step reads
param, grad, exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq: 7 x 4 = 28 B; writing a
bf16 copy of the param in the same pass adds 2 B; a separate copy-out pass (torch) re-reads the
param, so 28 + 4 + 2 = 34 B. STREAM copy counts 4 B read + 4 B written per element, triad
a = b + s*c 12 B, in-place a += s*b 12 B, so kernel GB/s reads as a fraction of measured memory
bandwidth. Counts follow STREAM and leave out write-allocate reads: copy and triad also read each
destination line before writing it, an in-place update (like Adam's param and moments) does not,
so an Adam kernel can show more GB/s than copy; in-place add is the closest comparison.
Times are medians over --repeats calls after --warmup calls (time.perf_counter).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

# Run from a checkout without installing: the package is the folder above this one.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LR, BETA1, BETA2, EPS, WD = 1e-4, 0.9, 0.999, 1e-8, 0.01
HP = dict(lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=WD)
STEP_B, LOWP_B, COPYOUT_B, COPY_B, TRIAD_B, INPLACE_B = 28, 30, 34, 8, 12, 12
# The engine's real per-bucket work with bf16 gradients: ours reads them as they are (grad 2 B
# instead of 4: 28 B); torch first casts them into an fp32 buffer (2 B read + 4 B written).
LOWGRAD_B, TORCH_LOWGRAD_B = 28, 40
# fmt: off
CSV_FIELDS = ["date", "host_cpu", "gpu", "threads", "numel", "method", "gparams_per_s",
              "gb_per_s", "bytes_per_param", "torch_version", "package_version"]
# fmt: on


def median_seconds(
    fn: Callable[[], object], warmup: int, repeats: int, setup: Callable[[], object] | None = None
) -> float:
    """Median wall time of fn(); setup() runs untimed before each call."""
    times = []
    for i in range(warmup + repeats):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def l3_mib() -> str:
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            size = f.read().strip()  # e.g. "260096K"
        return f"{int(size.rstrip('K')) // 1024} MiB" if size.endswith("K") else size
    except (OSError, ValueError):
        return "unknown"


def gpu_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"


def reason(exc: BaseException) -> str:
    """One line for the table instead of a traceback."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1][:100] if lines else ''}".rstrip(": ")


def our_methods(st: dict, n_threads: int) -> list[tuple[str, int, Callable, Callable | None]]:
    from hf_superoffload import ops

    ops.set_num_threads(n_threads)
    p, g, m, v, low = st["param"], st["grad"], st["exp_avg"], st["exp_avg_sq"], st["lowp"]
    g_low = g.to(torch.bfloat16)
    counter = iter(range(1, 1 << 30))

    def step(out_lowp=None, step=None, grad_scale=1.0, grad=g):
        return ops.adam_step(
            p,
            grad,
            m,
            v,
            step=step or next(counter),
            grad_scale=grad_scale,
            out_lowp=out_lowp,
            **HP,
        )

    def replay():  # redo the speculative step 1 with the gradients clipped by half
        ops.adam_replay(p, g, m, v, step=1, old_grad_scale=1.0, new_grad_scale=0.5, **HP)

    def rollback():
        ops.adam_rollback(p, g, m, v, step=1, **HP)

    def speculate():  # untimed setup: the step that replay and rollback then undo
        step(step=1)

    return [
        ("ours adam_step", STEP_B, step, None),
        ("ours adam_step + bf16 out", LOWP_B, lambda: step(out_lowp=low), None),
        (
            "ours bf16 grad, step + bf16 out",
            LOWGRAD_B,
            lambda: step(out_lowp=low, grad=g_low),
            None,
        ),
        ("ours adam_replay (clip 0.5)", STEP_B, replay, speculate),
        ("ours adam_rollback", STEP_B, rollback, speculate),
    ]


def torch_adamw(st: dict, **kw) -> tuple[torch.nn.Parameter, Callable[[], object]]:
    param = torch.nn.Parameter(st["param"].clone())
    param.grad = st["grad"]
    opt = torch.optim.AdamW([param], lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=WD, **kw)
    return param, opt.step


def torch_methods(st: dict) -> list[tuple[str, int, Callable, Callable | None]]:
    low = st["lowp"]
    param, fused = torch_adamw(st, fused=True)
    _, foreach = torch_adamw(st, foreach=True)

    g_low = st["grad"].to(torch.bfloat16)

    def fused_copy():  # the whole per-bucket work: step, then the bf16 copy for the GPU
        fused()
        low.copy_(param.detach())

    def cast_fused_copy():  # the same from bf16 gradients: upcast them first
        param.grad.copy_(g_low)
        fused_copy()

    return [
        ("torch AdamW fused", STEP_B, fused, None),
        ("torch AdamW fused + bf16 copy", COPYOUT_B, fused_copy, None),
        ("torch bf16 grad cast+fused+copy", TORCH_LOWGRAD_B, cast_fused_copy, None),
        ("torch AdamW foreach", STEP_B, foreach, None),
    ]


def deepspeed_step(st: dict) -> Callable[[], None]:
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # JIT-builds its C++ op on first use

    param = torch.nn.Parameter(st["param"].clone())
    param.grad = st["grad"]
    opt = DeepSpeedCPUAdam(
        [param], lr=LR, betas=(BETA1, BETA2), eps=EPS, weight_decay=WD, adamw_mode=True
    )
    return opt.step


def run(args: argparse.Namespace) -> list[dict]:
    torch.manual_seed(0)
    n = args.numel
    st = dict(
        param=torch.randn(n),
        grad=torch.randn(n) * 1e-3,
        exp_avg=torch.zeros(n),
        exp_avg_sq=torch.zeros(n),
        lowp=torch.empty(n, dtype=torch.bfloat16, pin_memory=torch.cuda.is_available()),
    )
    rows: list[dict] = []

    def measure(name, bytes_pp, make, setup=None):
        """make() returns the timed callable (or a list of methods); errors become the row."""
        try:
            fn = make()
            methods = fn if isinstance(fn, list) else [(name, bytes_pp, fn, setup)]
        except Exception as exc:
            rows.append(dict(method=name, bytes_per_param=bytes_pp, error=reason(exc)))
            return
        for meth, bpp, f, su in methods:
            try:
                sec = median_seconds(f, args.warmup, args.repeats, su)
                rate = dict(seconds=sec, gparams_per_s=n / sec / 1e9, gb_per_s=n * bpp / sec / 1e9)
                rows.append(dict(method=meth, bytes_per_param=bpp, **rate))
            except Exception as exc:
                rows.append(dict(method=meth, bytes_per_param=bpp, error=reason(exc)))

    measure("ours (hf_superoffload.ops)", STEP_B, lambda: our_methods(st, args.threads))
    measure("torch AdamW", STEP_B, lambda: torch_methods(st))
    measure("DeepSpeedCPUAdam", STEP_B, lambda: deepspeed_step(st))
    src, dst = torch.randn(n), torch.empty(n)
    measure("STREAM copy", COPY_B, lambda: lambda: dst.copy_(src))
    measure("STREAM triad", TRIAD_B, lambda: lambda: torch.add(src, st["grad"], alpha=3, out=dst))
    measure("STREAM in-place add", INPLACE_B, lambda: lambda: dst.add_(src, alpha=1e-3))
    return rows


def lookup(rows: list[dict], method: str) -> dict | None:
    return next((r for r in rows if r["method"] == method and "error" not in r), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--numel", type=int, default=64 * 2**20)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--csv", metavar="PATH", help="append one row per method to this CSV file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    try:
        from hf_superoffload import __version__ as pkg_version
    except ImportError:
        pkg_version = "unavailable"
    try:
        from hf_superoffload.ops import active_isa

        isa = active_isa()
    except Exception as exc:
        isa = f"n/a ({reason(exc)})"
    date = datetime.datetime.now().isoformat(timespec="seconds")
    cpu, gpu = cpu_model(), gpu_name()
    print(
        f"# CPU: {cpu} | threads {args.threads} | ISA {isa} | GPU {gpu} | "
        f"torch {torch.__version__} | hf_superoffload {pkg_version} | {date}"
    )
    print(
        f"# numel {args.numel:,} | Adam state {args.numel * 16 / 2**20:.0f} MiB (L3 {l3_mib()}: "
        f"a smaller state measures cache, not DRAM) | median of {args.repeats} after "
        f"{args.warmup} warm-up"
    )

    rows = run(args)
    print(f"{'method':<32} {'B/p':>4} {'ms':>9} {'Gparam/s':>9} {'GB/s':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['method']:<32} {r['bytes_per_param']:>4} {'failed: ' + r['error']}")
        else:
            print(
                f"{r['method']:<32} {r['bytes_per_param']:>4} {r['seconds'] * 1e3:>9.2f} "
                f"{r['gparams_per_s']:>9.3f} {r['gb_per_s']:>8.1f}"
            )

    ours_lp = lookup(rows, "ours adam_step + bf16 out")
    torch_lp = lookup(rows, "torch AdamW fused + bf16 copy")
    ours = lookup(rows, "ours adam_step")
    stream = {k: lookup(rows, f"STREAM {k}") for k in ("copy", "triad", "in-place add")}
    ratio = "n/a"
    if ours_lp and torch_lp:
        ratio = f"{ours_lp['gparams_per_s'] / torch_lp['gparams_per_s']:.2f}x"
    frac = {
        k: f"{100 * ours['gb_per_s'] / r['gb_per_s']:.0f}%" if ours and r else "n/a"
        for k, r in stream.items()
    }
    print(f"ours(step+bf16) / torch fused(step+bf16 copy) = {ratio}")
    ours_g = lookup(rows, "ours bf16 grad, step + bf16 out")
    torch_g = lookup(rows, "torch bf16 grad cast+fused+copy")
    if ours_g and torch_g:
        print(
            "ours / torch, whole bucket work from bf16 grads = "
            f"{ours_g['gparams_per_s'] / torch_g['gparams_per_s']:.2f}x"
        )
    print(
        f"ours step GB/s as fraction of STREAM copy = {frac['copy']} "
        f"(of triad {frac['triad']}, of in-place add {frac['in-place add']})"
    )

    if args.csv:
        new = not os.path.exists(args.csv) or os.path.getsize(args.csv) == 0
        with open(args.csv, "a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(CSV_FIELDS)
            for r in (r for r in rows if "error" not in r):
                w.writerow([date, cpu, gpu, args.threads, args.numel, r["method"],
                            f"{r['gparams_per_s']:.4f}", f"{r['gb_per_s']:.2f}",
                            r["bytes_per_param"], torch.__version__, pkg_version])  # fmt: skip


if __name__ == "__main__":
    main()
