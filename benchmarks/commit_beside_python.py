"""How much compact moments' commit pass slows a Python-bound thread beside it.

    python benchmarks/commit_beside_python.py                 # 256M elements, the engine's team
    python benchmarks/commit_beside_python.py --quick         # 16M elements, hidden 768

The training thread of a ZeRO-3 forward is bound by Python (module hooks, small launches):
every time the CPU Adam's worker takes the GIL back it waits. This runs, on the worker thread
and its OpenMP team as the engine sizes them, a commit pass over the params of Llama-like layers
(compact_in_context.py's layout) made two ways, while the main thread runs
compact_in_context.py's Python-bound loop:

- a call a param: ``ops.compact_adam(commit=True)`` per param, each on its slices (the views
  and the call take the GIL back several times a param);
- one call: ``ops.compact_adam_pieces`` over the same params (the GIL taken back once).

It prints the loop's rate alone and beside each pass (median of --repeats windows of --seconds),
the ratio to alone, and the passes' kernel calls a second. Both passes write the same bits.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from compact_in_context import BLOCK, busy_python, param_spans
from compact_kernel_speed import HYPER


def _state(numel: int, spans):
    from hf_superoffload import ops

    blocks = sum(-(-n // BLOCK) for _, n in spans)
    state = {
        "master": torch.randn(numel), "grad": torch.randn(numel).bfloat16() * 1e-3,
        "exp_avg": torch.zeros(numel, dtype=torch.uint8), "exp_avg_scale": torch.zeros(blocks),
        "exp_avg_sq": torch.zeros(numel, dtype=torch.uint8), "exp_avg_sq_scale": torch.zeros(blocks),
    }  # fmt: skip
    pieces, first = [], 0
    for salt, (at, n) in enumerate(spans):
        pieces.append(ops.CommitPiece(at, n, first, 1, salt, 0))
        first += -(-n // BLOCK)
    return state, pieces


def _a_call_a_param(state, pieces) -> None:
    from hf_superoffload import ops

    m, ms, v, vs = (
        state[k] for k in ("exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale")
    )
    for p in pieces:
        lo, hi, b = p.at, p.at + p.numel, slice(p.first_block, p.first_block - (-p.numel // BLOCK))
        ops.compact_adam(
            state["master"].narrow(0, lo, p.numel), state["grad"].narrow(0, lo, p.numel),
            m[lo:hi], ms[b], v[lo:hi], vs[b], step=p.step, salt=p.salt, **HYPER,
        )  # fmt: skip


def _one_call(state, pieces) -> None:
    from hf_superoffload import ops

    ops.compact_adam_pieces(*state.values(), pieces, **HYPER)


def _loop_rate(seconds: float, worker_pass=None) -> tuple[float, float]:
    """(Python loops a second over ``seconds``, passes a second) with ``worker_pass`` run
    back to back on the worker meanwhile."""
    stop, stats, passes = threading.Event(), {"iterations": 0}, [0]

    def worker_loop():
        while not stop.is_set():
            worker_pass()
            passes[0] += 1

    thread = threading.Thread(target=worker_loop) if worker_pass else None
    if thread:
        thread.start()
        time.sleep(0.2)
    loop = threading.Thread(target=busy_python, args=(stop, stats, False))
    began = time.perf_counter()
    loop.start()
    time.sleep(seconds)
    before_passes, before_loops = passes[0], stats["iterations"]
    time.sleep(seconds)
    elapsed, loops = time.perf_counter() - began - seconds, stats["iterations"] - before_loops
    done = passes[0] - before_passes
    stop.set()
    loop.join()
    if thread:
        thread.join()
    return loops / elapsed, done / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=256 * 2**20)
    parser.add_argument("--hidden", type=int, default=3072, help="a multiple of 768")
    parser.add_argument("--threads", type=int, default=None, help="default: the engine's")
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="16M elements, hidden 768")
    args = parser.parse_args()
    if args.quick:
        args.numel, args.hidden, args.repeats = 16 * 2**20, 768, 3

    from hf_superoffload import ops
    from hf_superoffload.engine.core_split import choose_team

    ops.prepare()
    team = choose_team(torch.device("cpu"), args.threads, None)
    ops.set_num_threads(team.threads)
    spans = param_spans(args.numel, args.hidden)
    state, pieces = _state(args.numel, spans)
    passes = {"a call a param": lambda: _a_call_a_param(state, pieces),
              "one call": lambda: _one_call(state, pieces)}  # fmt: skip
    print(f"{len(pieces)} params, {args.numel} elements, {team.threads} threads", flush=True)
    rates: dict[str, list[float]] = {"alone": []}
    per_second: dict[str, list[float]] = {}
    for _ in range(args.repeats):  # interleaved, so that drift in the host hits all alike
        rates["alone"].append(_loop_rate(args.seconds)[0])
        for name, one_pass in passes.items():
            loops, done = _loop_rate(args.seconds, one_pass)
            rates.setdefault(name, []).append(loops)
            per_second.setdefault(name, []).append(done)
    alone = statistics.median(rates["alone"])
    print(f"\n{'beside':<16} {'loops/s':>10} {'over alone':>11} {'passes/s':>9} {'calls/s':>8}")
    for name, values in rates.items():
        rate = statistics.median(values)
        done = statistics.median(per_second.get(name, [0.0]))
        calls = done * (len(pieces) if name == "a call a param" else 1)
        print(f"{name:<16} {rate:>10.0f} {rate / alone:>11.3f} {done:>9.2f} {calls:>8.0f}")


if __name__ == "__main__":
    main()
