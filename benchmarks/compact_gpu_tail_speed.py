"""Speed of the GPU tail's optimizer step: compact moments through the Triton kernel
(``ops.compact_triton``) and through the plain-PyTorch reference it replaces, against torch's
foreach AdamW over fp32 moments (the exact tail's step), on the same params.

    python benchmarks/compact_gpu_tail_speed.py                    # 0.67B elements, 64M a param
    python benchmarks/compact_gpu_tail_speed.py --numel 268435456 --param 16777216 --csv out.csv

Each row is one validated step of every param (bf16 gradients, as the ZeRO-3 tail holds them),
timed with CUDA events as the median over --repeats steps after --warmup (the first compiles
the kernel); "peak MiB" is the allocator's peak above the state while stepping.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hf_superoffload.ops.compact_adamw import compact_adam_pass
from hf_superoffload.ops.compact_format import CompactMoments
from hf_superoffload.ops.compact_triton import compact_adam_pass_cuda

HYPER = dict(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
PIECE = 1 << 24  # the reference's piece on the tail (device_tail.COMPACT_STEP_PIECE)


def _time(step, warmup: int, repeats: int) -> tuple[float, int]:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    seconds = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1000)
    return statistics.median(seconds), torch.cuda.max_memory_allocated() - base


def _compact(sizes, update):
    masters = [torch.randn(n, device="cuda") for n in sizes]
    grads = [torch.randn(n, device="cuda").bfloat16() for n in sizes]
    moments = [CompactMoments.zeros(n, device="cuda") for n in sizes]
    counter = [0]

    def step():
        counter[0] += 1
        for master, grad, m in zip(masters, grads, moments, strict=True):
            state = (m.exp_avg, m.exp_avg_scale, m.exp_avg_sq, m.exp_avg_sq_scale)
            update(master, grad, state, counter[0])

    return step


def _triton(master, grad, state, step):
    compact_adam_pass_cuda(master, grad, *state, step=step, **HYPER)


def _reference(master, grad, state, step):
    for start in range(0, master.numel(), PIECE):
        n = min(PIECE, master.numel() - start)
        pieces = [state[0][start : start + n], state[1][start // 256 : (start + n + 255) // 256],
                  state[2][start : start + n], state[3][start // 256 : (start + n + 255) // 256]]  # fmt: skip
        compact_adam_pass(master[start : start + n], grad[start : start + n], *pieces,
                          step=step, element_offset=start, **HYPER)  # fmt: skip


def _adamw(sizes):
    params = [torch.randn(n, device="cuda", requires_grad=True) for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, foreach=True, **{"lr": 1e-4, "weight_decay": 0.01})
    return opt.step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=671088640)
    parser.add_argument("--param", type=int, default=67108864)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--csv")
    args = parser.parse_args()
    sizes = [args.param] * (args.numel // args.param)
    sizes += [args.numel - sum(sizes)] if args.numel > sum(sizes) else []
    numel = sum(sizes)
    rows = []
    for name, make in (
        ("fp32 moments, torch AdamW (foreach)", lambda: _adamw(sizes)),
        ("compact moments, Triton kernel", lambda: _compact(sizes, _triton)),
        ("compact moments, plain PyTorch", lambda: _compact(sizes, _reference)),
    ):
        step = make()
        seconds, peak = _time(step, args.warmup, args.repeats)
        rows.append({"step": name, "elements": numel, "seconds": round(seconds, 5),
                     "G_elements_per_s": round(numel / seconds / 1e9, 2),
                     "peak_mib": round(peak / 2**20, 1)})  # fmt: skip
        del step
        torch.cuda.empty_cache()
    base = rows[0]["seconds"]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {numel:,} elements")
    print(f"{'step':40} {'s':>9} {'G el/s':>8} {'x AdamW':>8} {'peak MiB':>9}")
    for r in rows:
        print(f"{r['step']:40} {r['seconds']:9.4f} {r['G_elements_per_s']:8.2f} "
              f"{r['seconds'] / base:8.2f} {r['peak_mib']:9.1f}")  # fmt: skip
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            meta = {"date": datetime.date.today().isoformat(),
                    "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}  # fmt: skip
            writer = csv.DictWriter(f, fieldnames=[*meta, *rows[0]])
            writer.writeheader()
            for r in rows:
                writer.writerow({**meta, **r})


if __name__ == "__main__":
    main()
