"""The compact-moment kernel's speed in engine-like conditions: which of them slows it.

    source dev/gpu_env.sh && python benchmarks/compact_in_context.py --memory both --csv out.csv
    python benchmarks/compact_in_context.py --quick          # a CPU-only check, 8M elements

Three passes over one flat state of --numel elements with bf16 gradients, as
compact_kernel_speed.py fills it (randn master, randn * 1e-3 gradients, moments after a step):
compact speculative (``ops.compact_adam(commit=False)``, bf16 into a copy-out buffer), compact
commit (``commit=True``, no copy-out) and exact ``ops.adam_step`` (fp32 moments, bf16 out,
on the same master).
As in the engine, the calls run on its worker thread (engine/worker.py), bound to the CPUs and
sized by the team the engine would choose here (core_split.choose_team; --threads to set it),
while the main thread only waits. Rows, one per pass, condition and memory kind:

- alone: calls of --piece elements (16M, the copy-out buffers' size) over the whole range.
- one call: the whole range in one call: no per-call cost (OpenMP fork/join, Python checks).
- param sizes: calls over the params of Llama-like layers (--hidden 3072: q, o 3072x3072;
  k, v 3072x1024; gate, up, down 3072x8192; two 3072 norms) repeated to cover the range, as
  the engine cuts them: one call a param for the commit, params cut at --piece otherwise.
- + python thread: alone, while another thread runs small torch ops and plain Python (and,
  with CUDA, launches small kernels), as the training thread does; it holds the GIL between
  its torch ops, so the worker may wait for the GIL after each call.
- + gil-free thread: alone, while another thread keeps a core busy in native code that
  releases the GIL (a serial cumsum in L2): a core taken, without the GIL's hand-offs.
- + dma (CUDA): alone, while a side stream copies --dma-mb of pinned memory to the GPU and
  back without pause, as the engine's transfers of params and gradients do.
- + python thread + dma (CUDA).
--memory: the state in pageable memory, or held as the ZeRO-3 engine holds it ("pinned":
master, gradients and copy-out page-locked with cudaHostRegister, moments pageable), or both,
one after the other. Run it again under THP_MEM_ALLOC_ENABLE=1 (torch's allocations of 2 MB and
more on transparent huge pages) to see what the pages' size does. "ratio" is a row's M el/s over alone's, same pass and memory kind.
Times are medians over --repeats passes after one warm-up pass (time.perf_counter).
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import threading
import time
from pathlib import Path

import torch

# Run from a checkout without installing: the package is the folder above this one.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from compact_kernel_speed import HYPER, commit_hash
from cpu_adam import cpu_model, median_seconds

BLOCK = 256  # elements per block scale of the compact moments
PASSES = ("compact speculative", "compact commit", "exact adam_step")
CPU_CONDITIONS = ("alone", "one call", "param sizes", "+ python thread", "+ gil-free thread")
CUDA_CONDITIONS = ("+ dma", "+ python thread + dma")
CSV_FIELDS = ["pass", "condition", "memory", "threads", "calls", "seconds", "melem_per_s",
              "ratio_to_alone", "numel", "background"]  # fmt: skip


def layer_params(hidden: int) -> list[int]:
    """Element counts of one Llama-like layer's params, in order (q, k, v, o, norm, mlp, norm)."""
    kv, mlp = hidden * (hidden // 3), hidden * (hidden * 8 // 3)
    return [hidden * hidden, kv, kv, hidden * hidden, hidden, mlp, mlp, mlp, hidden]


def param_spans(numel: int, hidden: int) -> list[tuple[int, int]]:
    """(offset, numel) of layers' params covering ``numel``; the last one cut at the end."""
    spans, at, layer = [], 0, layer_params(hidden)
    while at < numel:
        for n in layer:
            if at < numel:
                spans.append((at, min(n, numel - at)))
                at += n
    return spans


def cut(spans: list[tuple[int, int]], piece: int) -> list[tuple[int, int, int]]:
    """(offset, numel, start within its param) calls of at most ``piece`` elements."""
    return [(at + s, min(piece, n - s), s) for at, n in spans for s in range(0, n, piece)]


class State:
    """The flat state of both kinds of moments, every tensor pageable, or (``pinned``) held as
    the ZeRO-3 engine holds it: master, gradients and copy-out page-locked by the engine's
    PinnedBuffers (torch's allocation, cudaHostRegister), the moments pageable."""

    def __init__(self, numel: int, pinned: bool, out_numel: int):
        from hf_superoffload.engine.host_memory import PinnedBuffers

        self._pinned = PinnedBuffers() if pinned else None  # unpins when collected

        def locked(n, dtype):
            return self._pinned.empty(n, dtype) if pinned else torch.empty(n, dtype=dtype)

        blocks = -(-numel // BLOCK)
        self.master, self.grad = locked(numel, torch.float32), locked(numel, torch.bfloat16)
        self.codes = [torch.empty(numel, dtype=torch.uint8) for _ in "mv"]
        self.scales = [torch.empty(blocks, dtype=torch.float32) for _ in "mv"]
        self.exp_avg, self.exp_avg_sq = (torch.empty(numel, dtype=torch.float32) for _ in "mv")
        self.out = locked(out_numel, torch.bfloat16)
        gen, chunk = torch.Generator().manual_seed(0), min(numel, 16 * 2**20)
        master, grad = torch.randn(chunk, generator=gen), torch.randn(chunk, generator=gen) * 1e-3
        for at in range(0, numel, chunk):  # the random chunk tiled: fast to fill, same values
            n = min(chunk, numel - at)
            self.master[at : at + n].copy_(master[:n])
            self.grad[at : at + n].copy_(grad[:n])
        for t in (*self.codes, *self.scales, self.exp_avg, self.exp_avg_sq):
            t.zero_()
        self.steps = {"compact": 0, "exact": 0}

    def run(self, name: str, calls: list[tuple[int, int, int]]) -> None:
        """One pass of ``name`` over ``calls``, one kernel call each, as the engine calls it."""
        from hf_superoffload import ops

        key = "exact" if name == "exact adam_step" else "compact"
        if name != "compact speculative":
            self.steps[key] += 1
        step = self.steps[key] + 1 if name == "compact speculative" else self.steps[key]
        for at, n, start in calls:
            first, blocks = at // BLOCK, -(-n // BLOCK)
            master, grad = self.master[at : at + n], self.grad[at : at + n]
            if key == "exact":
                ops.adam_step(master, grad, self.exp_avg[at : at + n],
                              self.exp_avg_sq[at : at + n], step=step, **HYPER,
                              out_lowp=self.out[:n])  # fmt: skip
                continue
            moments = [part for codes, scales in zip(self.codes, self.scales, strict=True)
                       for part in (codes[at : at + n], scales[first : first + blocks])]  # fmt: skip
            spec = name == "compact speculative"
            ops.compact_adam(master, grad, *moments, step=step, **HYPER, element_offset=start,
                             commit=not spec, out_lowp=self.out[:n] if spec else None)  # fmt: skip


def busy_python(stop: threading.Event, stats: dict, cuda: bool) -> None:
    """The training thread's kind of work: small torch ops, plain Python, small launches."""
    x, seen = torch.randn(1024), {}
    dev = torch.ones(1024, device="cuda") if cuda else None
    done = torch.cuda.Event(blocking=True) if cuda else None  # waits without spinning
    while not stop.is_set():
        for k in range(8):  # a module's small ops, and its hooks' plain Python (GIL held)
            x = x.mul(0.999).add_(1e-3)
            seen[k] = sum(i * k for i in range(100)) + len(seen)
        if cuda:
            for _ in range(8):
                dev.mul_(0.999)
            if stats["iterations"] % 64 == 0:
                done.record()
                done.synchronize()
        stats["iterations"] += 1


def gil_free(stop: threading.Event, stats: dict) -> None:
    """One core kept busy in native code that releases the GIL (cumsum is serial in 1-D)."""
    x, out = torch.randn(65536), torch.empty(65536)
    while not stop.is_set():
        torch.cumsum(x, 0, out=out)
        stats["iterations"] += 1


def dma(stop: threading.Event, stats: dict, nbytes: int) -> None:
    """Pinned host memory to the GPU and back on a side stream, without pause."""
    host_out, host_in = (torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in "ab")
    dev_in, dev_out = (torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in "ab")
    stream, done = torch.cuda.Stream(), torch.cuda.Event(blocking=True)
    with torch.cuda.stream(stream):
        while not stop.is_set():
            dev_in.copy_(host_out, non_blocking=True)
            host_in.copy_(dev_out, non_blocking=True)
            done.record(stream)
            done.synchronize()
            stats["bytes"] += 2 * nbytes


class Background:
    """The condition's other threads, running while its passes are timed."""

    def __init__(self, condition: str, cuda: bool, dma_bytes: int):
        self.stop, self.stats = threading.Event(), {"iterations": 0, "bytes": 0}
        targets, self.counts = [], []  # the stats that show each thread under way
        if "python thread" in condition:
            targets.append((busy_python, (cuda,)))
        if "gil-free" in condition:
            targets.append((gil_free, ()))
        self.counts += ["iterations"] if targets else []
        if "dma" in condition:
            targets.append((dma, (dma_bytes,)))
            self.counts.append("bytes")
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._guarded, args=(f, *a), daemon=True)
                        for f, a in targets]  # fmt: skip

    def _guarded(self, target, *args) -> None:
        try:
            target(self.stop, self.stats, *args)
        except BaseException as error:  # re-raised by __exit__: a row without its load is wrong
            self.errors.append(error)

    def __enter__(self):
        started = time.perf_counter()
        for thread in self.threads:
            thread.start()
        while not all(self.stats[c] for c in self.counts):  # under way before the first pass
            if self.errors or time.perf_counter() - started > 60:
                self._halt()
                raise RuntimeError(f"the background threads did not start: {self.errors}")
            time.sleep(0.01)
        self.began, self.before = time.perf_counter(), dict(self.stats)
        return self

    def _halt(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()
        if self.errors:
            raise RuntimeError("a background thread failed; its rows would be wrong") from (
                self.errors[0]
            )

    def __exit__(self, *exc):
        self._halt()
        seconds = time.perf_counter() - self.began
        done = {k: v - self.before[k] for k, v in self.stats.items()}
        notes = []
        if done["iterations"]:
            notes.append(f"{done['iterations'] / seconds / 1e3:.1f}k loops/s")
        if done["bytes"]:
            notes.append(f"dma {done['bytes'] / seconds / 1e9:.1f} GB/s both ways")
        self.note = ", ".join(notes)


def measure(args, memory: str, team, worker, cuda: bool) -> list[dict]:
    """Every condition's rows for the state in ``memory``."""
    pieces = cut([(0, args.numel)], args.piece)
    params = param_spans(args.numel, args.hidden)
    plans = {"alone": pieces, "one call": [(0, args.numel, 0)]}
    conditions = CPU_CONDITIONS + (CUDA_CONDITIONS if cuda else ())
    began = time.perf_counter()
    state = State(args.numel, memory == "pinned", args.numel)
    for name in ("compact commit", "exact adam_step"):  # moments after a step, as in training
        worker.submit((0,), lambda name=name: state.run(name, pieces))
    worker.wait((0,))
    print(f"{memory}: state of {args.numel} elements ready in {time.perf_counter() - began:.1f} s",
          flush=True)  # fmt: skip
    rows, alone = [], {}
    for condition in conditions:
        with Background(condition, cuda, args.dma_mb * 2**20) as background:
            for name in PASSES:
                if condition == "param sizes":
                    calls = cut(params, args.numel if name == "compact commit" else args.piece)
                else:
                    calls = plans.get(condition, pieces)

                def one_pass(name=name, calls=calls):
                    worker.submit((0,), lambda: state.run(name, calls))
                    worker.wait((0,))

                seconds = median_seconds(one_pass, 1, args.repeats)
                rate = args.numel / seconds / 1e6
                alone.setdefault(name, rate)
                rows.append({"pass": name, "condition": condition, "memory": memory,
                             "threads": team.threads, "calls": len(calls),
                             "seconds": round(seconds, 4), "melem_per_s": round(rate, 1),
                             "ratio_to_alone": round(rate / alone[name], 3),
                             "numel": args.numel, "background": ""})  # fmt: skip
                print(f"{memory:8} {condition:22} {name:20} {len(calls):5} calls "
                      f"{seconds:8.4f} s {rate:8.0f} M el/s", flush=True)  # fmt: skip
        for row in rows[-len(PASSES) :]:
            row["background"] = background.note
        if background.note:
            print(f"{memory:8} {condition:22} background: {background.note}", flush=True)
    worker.submit((0,), lambda: None)  # the worker drops its last task, and with it the state
    worker.wait((0,))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=2**30)
    parser.add_argument("--piece", type=int, default=16 * 2**20)
    parser.add_argument("--hidden", type=int, default=3072, help="a multiple of 768")
    parser.add_argument("--memory", choices=("pinned", "pageable", "both"), default="both")
    parser.add_argument("--threads", type=int, default=None, help="default: the engine's")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--dma-mb", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="8M elements, 2 repeats")
    parser.add_argument("--csv", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.numel, args.piece, args.hidden, args.repeats = 8 * 2**20, 2**20, 768, 2
    if args.numel % BLOCK or args.piece % BLOCK or args.numel < 1 or args.piece < 1:
        parser.error(f"--numel and --piece must be positive multiples of {BLOCK}")
    if args.hidden % 768 or args.hidden < 768:
        parser.error("--hidden must be a multiple of 768 (every param a whole number of blocks)")

    from hf_superoffload import ops
    from hf_superoffload.engine.core_split import choose_team, use_team
    from hf_superoffload.engine.worker import Worker

    ops.prepare()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.init()  # one context, made here, before any thread uses it
    device = torch.device("cuda" if cuda else "cpu")
    team = choose_team(device, args.threads)
    use_team(
        team, device.type
    )  # the thread count, the worker's CPUs, torch's threads (as the engine)
    worker = Worker("compact-in-context")
    memories = ["pageable", "pinned"] if args.memory == "both" else [args.memory]
    if not cuda and "pinned" in memories:
        print("no CUDA: pinned memory is unavailable; the state is pageable only", flush=True)
        memories = ["pageable"]
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    cpus = "unbound" if team.cpus is None else f"CPUs {sorted(team.cpus)}"
    print(f"{cpu_model()}, {os.cpu_count()} CPUs, ISA {ops.active_isa()}, torch "
          f"{torch.__version__}, commit {commit_hash()}, GPU "
          f"{torch.cuda.get_device_name() if cuda else 'none'}, transparent huge pages "
          f"{thp.read_text().strip() if thp.exists() else 'unknown'}", flush=True)  # fmt: skip
    print(f"{args.numel} elements, pieces of {args.piece}, {team.threads} threads, {cpus} "
          f"({team.how})", flush=True)  # fmt: skip
    try:
        rows = [row for memory in memories for row in measure(args, memory, team, worker, cuda)]
    finally:
        worker.close()
    if args.csv is not None:
        with args.csv.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
            writer.writeheader()
            writer.writerows(rows)
    print(f"\n{'pass':20} {'condition':22} {'memory':8} {'threads':>7} {'calls':>5} "
          f"{'s/pass':>8} {'M el/s':>8} {'ratio':>6}")  # fmt: skip
    for r in rows:
        print(f"{r['pass']:20} {r['condition']:22} {r['memory']:8} {r['threads']:>7} "
              f"{r['calls']:>5} {r['seconds']:>8.4f} {r['melem_per_s']:>8.0f} "
              f"{r['ratio_to_alone']:>6.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
