"""Speed of the compiled compact-state Adam (8-bit moments) against the exact fp32 kernel.

    python benchmarks/compact_kernel_speed.py                    # 64M elements, 1 and 2 threads
    python benchmarks/compact_kernel_speed.py --numel 16777216 --threads 1,8,16

Passes over one flat range of --numel elements, each with bf16 gradients:

- compact speculative: ``ops.compact_adam(commit=False)``, the STV step: reads the fp32
  master, the gradient and both moments' codes, writes the updated params as bf16.
- compact commit: ``ops.compact_adam(commit=True)`` without a copy-out: writes the master and
  both moments' codes and block scales.
- compact commit + speculative, two passes: the commit of one step, then the speculative pass
  of the next, as an engine with compact moments runs them when it speculates every step.
- compact fused commit + speculative: ``ops.compact_adam_commit_speculate``, the same two
  updates (same bits) in one pass: reads master, both gradients and both moments' codes once,
  writes master, codes, the bf16 params and the new gradient into the pending one.
- exact adam_step: ``ops.adam_step`` with fp32 moments and a bf16 copy-out, the exact path's
  one pass.

"B/elem" counts the bytes each pass must move per element (block scales add 8 B per 256
elements, left out); "GB/s" is that times elements per second. Times are medians over
--repeats calls after --warmup calls (time.perf_counter).
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
from collections.abc import Callable

import torch

# Run from a checkout without installing: the package is the folder above this one.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cpu_adam import cpu_model, median_seconds

HYPER = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
# Bytes moved per element: master 4 + grad 2 + codes 1 + 1 read, out 2 written (speculative);
# the same read, master 4 + codes 2 written (commit); master 4 + two grads 2 x 2 + codes 2
# read, master 4 + codes 2 + out 2 + the kept grad 2 written (fused); param, moments 3 x 4 +
# grad 2 read, 3 x 4 + out 2 written (exact).
SPECULATIVE_B, COMMIT_B, FUSED_B, EXACT_B = 10, 14, 20, 28


def commit_hash() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def passes(n: int) -> list[tuple[str, int, Callable[[], object]]]:
    from hf_superoffload import ops
    from hf_superoffload.ops.compact_state import CompactMoments

    gen = torch.Generator().manual_seed(0)
    master = torch.randn(n, generator=gen)
    grad = (torch.randn(n, generator=gen) * 1e-3).bfloat16()
    pending, new = grad.clone(), (torch.randn(n, generator=gen) * 1e-3).bfloat16()
    out = torch.empty(n, dtype=torch.bfloat16)
    moments = CompactMoments.zeros(n)
    compact = (moments.exp_avg, moments.exp_avg_scale, moments.exp_avg_sq,
               moments.exp_avg_sq_scale)  # fmt: skip
    param, exp_avg, exp_avg_sq = master.clone(), torch.zeros(n), torch.zeros(n)
    steps = {"compact": 0, "exact": 0}

    def speculative():
        ops.compact_adam(master, grad, *compact, step=steps["compact"] + 1, **HYPER,
                         commit=False, out_lowp=out)  # fmt: skip

    def commit():
        steps["compact"] += 1
        ops.compact_adam(master, grad, *compact, step=steps["compact"], **HYPER)

    def two_passes():
        commit()
        speculative()

    def fused():
        steps["compact"] += 1
        halves = ({**HYPER, "step": steps["compact"] + k, "grad_scale": 1.0} for k in (0, 1))
        ops.compact_adam_commit_speculate(master, pending, new, *compact, commit=next(halves),
                                          speculate=next(halves), out_lowp=out)  # fmt: skip

    def exact():
        steps["exact"] += 1
        ops.adam_step(param, grad, exp_avg, exp_avg_sq, step=steps["exact"], **HYPER,
                      out_lowp=out)  # fmt: skip

    commit()  # moments with non-zero codes and scales before any timing
    return [
        ("compact speculative (bf16 out)", SPECULATIVE_B, speculative),
        ("compact commit", COMMIT_B, commit),
        ("compact commit + speculative (2 passes)", COMMIT_B + SPECULATIVE_B, two_passes),
        ("compact fused commit + speculative", FUSED_B, fused),
        ("exact adam_step (bf16 out)", EXACT_B, exact),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=64 * 2**20)
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from hf_superoffload import ops

    ops.prepare()
    methods = passes(args.numel)
    print(
        f"{cpu_model()}, {os.cpu_count()} CPUs, ISA {ops.active_isa()}, torch {torch.__version__}, "
        f"{datetime.date.today()}, commit {commit_hash()}, {args.numel} elements"
    )
    print(f"{'pass':40} {'threads':>7} {'s/pass':>8} {'Melem/s':>9} {'B/elem':>6} {'GB/s':>6}")
    for threads in (int(t) for t in args.threads.split(",")):
        ops.set_num_threads(threads)
        for name, bytes_per_element, fn in methods:
            seconds = median_seconds(fn, args.warmup, args.repeats)
            rate = args.numel / seconds
            print(
                f"{name:40} {threads:>7} {seconds:>8.3f} {rate / 1e6:>9.0f} "
                f"{bytes_per_element:>6} {rate * bytes_per_element / 1e9:>6.1f}"
            )


if __name__ == "__main__":
    main()
