"""Where the engine's CPU pass time goes: its kernel calls against the worker tasks that make them.

    python benchmarks/compact_pass_profile.py --engine zero3 --moments compact --threads 1
    python benchmarks/compact_pass_profile.py --moments fp32 --hidden 1024 --layers 6 --steps 4

Trains the random Llama of compact_cpu_steps.py (same flags) and times, over the measured
steps, every worker task and every CPU Adam kernel call it makes (``ops.adam_step``,
``ops.compact_adam``, ``ops.compact_adam_commit_speculate``): wall seconds, and the worker
thread's CPU seconds (``time.thread_time``: the OpenMP team's other threads are not in it, so
read it with --threads 1). Then, the training over and the process idle, it makes the same
kernel calls again on the same tensors ("alone"). One JSON line per kernel and one for the
tasks:

- a kernel's ``in_task_Mel_s`` against its ``alone_Mel_s``: what the engine's surroundings (the
  training thread's compute, memory traffic, taking the GIL back after each call) cost inside
  the calls, which the engine's ``cpu_step_seconds`` count;
- the tasks' ``outside_kernel_s``: task time spent outside the kernel calls (choosing the
  pieces, the rounded params' copies to the model, Python between pieces).

--commit-early on|off overrides where compact moments write a validated update (default:
right after validation with a GPU, fused into the next step's pass without one).

Per step figures divide by --steps. On a machine whose cores the training thread shares, wall
seconds also count the time the worker waited for a core; CPU seconds do not.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time

# Run from a checkout without installing: the package is the folder above this one.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import compact_cpu_steps

KERNELS = ("adam_step", "compact_adam", "compact_adam_commit_speculate")


class Recorder:
    """Wraps the kernels and the worker's tasks while ``on``; keeps each call for the replay."""

    def __init__(self):
        self.on = False
        self.calls: list[tuple[str, tuple, dict]] = []
        self.kernel = collections.defaultdict(lambda: [0, 0, 0.0, 0.0])  # calls, el, wall, cpu
        self.tasks = [0, 0.0, 0.0, 0.0, 0.0]  # tasks, wall, cpu, kernel wall, kernel cpu
        self._in_task = threading.local()

    def wrap_kernels(self, ops) -> None:
        for name in KERNELS:
            setattr(ops, name, self._timed_kernel(name, getattr(ops, name)))

    def _timed_kernel(self, name, kernel):
        def call(*args, **kwargs):
            if not self.on:
                return kernel(*args, **kwargs)
            wall, cpu = time.perf_counter(), time.thread_time()
            out = kernel(*args, **kwargs)
            wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
            entry = self.kernel[name]
            entry[0] += 1
            entry[1] += args[0].numel()
            entry[2] += wall
            entry[3] += cpu
            spent = getattr(self._in_task, "spent", None)
            if spent is not None:
                spent[0] += wall
                spent[1] += cpu
            self.calls.append((name, args, kwargs))
            return out

        return call

    def wrap_worker(self, worker_class) -> None:
        submit = worker_class.submit
        recorder = self

        def timed_submit(worker, buckets, task):
            def timed():
                if not recorder.on:
                    return task()
                recorder._in_task.spent = spent = [0.0, 0.0]
                wall, cpu = time.perf_counter(), time.thread_time()
                try:
                    task()
                finally:
                    recorder._in_task.spent = None
                    totals = recorder.tasks
                    totals[0] += 1
                    totals[1] += time.perf_counter() - wall
                    totals[2] += time.thread_time() - cpu
                    totals[3] += spent[0]
                    totals[4] += spent[1]

            return submit(worker, buckets, timed)

        worker_class.submit = timed_submit

    def replay(self, ops, name: str) -> float:
        """Seconds the recorded calls of kernel ``name`` take again, one after the other."""
        kernel = getattr(ops, name)
        calls = [(args, kwargs) for n, args, kwargs in self.calls if n == name]
        started = time.perf_counter()
        for args, kwargs in calls:
            kernel(*args, **kwargs)
        return time.perf_counter() - started


def main() -> None:
    parser = compact_cpu_steps.arguments(__doc__.split("\n")[0])
    parser.add_argument(
        "--commit-early", choices=("auto", "on", "off"), default="auto",
        help="compact moments: write pending updates right after validation (auto: with a GPU)",
    )  # fmt: skip
    args = parser.parse_args()

    from hf_superoffload import ops
    from hf_superoffload.engine.worker import Worker

    recorder = Recorder()
    recorder.wrap_kernels(ops)
    recorder.wrap_worker(Worker)
    _, (step, stv, stats, close), batches = compact_cpu_steps.warmed_up(args)
    if args.commit_early != "auto":  # from the first measured step's validation on
        stv.commit_early = args.commit_early == "on"
    before = dict(stats())
    recorder.on = True
    started = time.perf_counter()
    for ids in batches:
        step(ids)
    stv.worker.wait()
    elapsed = time.perf_counter() - started
    recorder.on = False
    after = dict(stats())
    per_step = 1.0 / args.steps
    head = {"engine": args.engine, "moments": args.moments, "threads": ops.get_num_threads(),
            "commit_early": stv.commit_early,
            "s_per_step": round(elapsed * per_step, 4),
            "cpu_step_seconds": round((after["cpu_step_seconds"] - before["cpu_step_seconds"])
                                      * per_step, 4)}  # fmt: skip
    for name, (calls, elements, wall, cpu) in sorted(recorder.kernel.items()):
        alone = min(recorder.replay(ops, name) for _ in range(2))
        print(json.dumps({**head, "kernel": name, "calls_per_step": calls * per_step,
                          "Mel_per_step": round(elements * per_step / 1e6, 2),
                          "in_task_s": round(wall * per_step, 4),
                          "in_task_cpu_s": round(cpu * per_step, 4),
                          "in_task_Mel_s": round(elements / wall / 1e6),
                          "in_task_cpu_Mel_s": round(elements / max(cpu, 1e-9) / 1e6),
                          "alone_s": round(alone * per_step, 4),
                          "alone_Mel_s": round(elements / alone / 1e6)}))  # fmt: skip
    tasks, wall, cpu, kernel_wall, kernel_cpu = recorder.tasks
    print(json.dumps({**head, "tasks_per_step": tasks * per_step,
                      "task_s": round(wall * per_step, 4),
                      "task_cpu_s": round(cpu * per_step, 4),
                      "outside_kernel_s": round((wall - kernel_wall) * per_step, 4),
                      "outside_kernel_cpu_s": round((cpu - kernel_cpu) * per_step, 4)}))  # fmt: skip
    close()


if __name__ == "__main__":
    main()
