# Run on the device machine (source dev/gpu_env.sh first), one system a run:
#   python benchmarks/timeline.py --system superoffload_zero3 --hidden 3072 --layers 28 --out t.json
"""Where a SuperOffload step's time goes: a timeline of one step after warm-up.

Records, against the step's start (host seconds; the GPU's by CUDA events on the compute
stream):
- every CPU Adam task on the worker thread (kind, partition, start, end), and the worker's waits
  on CUDA events inside them (gradients landing, copy-out ring slots);
- every wait of the training thread for the worker (which partitions, how long);
- each decoder layer's forward start as the host reached it and as the GPU started it;
- the phase boundaries (forward, backward, step).

Prints a summary of the gaps that decide the step time (how long the GPU waited for the CPU
pass and for what) and writes the raw timeline as JSON. A diagnostic, not a benchmark: the
instrumentation costs a little itself.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import sys
import threading
import time

import torch
from stream_summary import summarize_trace
from systems import SYSTEMS, run_environment
from train_step import add_model_arguments, model_config


class Timeline:
    def __init__(self):
        self.t0 = time.perf_counter()
        self.tasks: list[dict] = []
        self.waits: list[dict] = []
        self.event_waits: list[dict] = []
        self.layers: list[dict] = []
        self.marks: dict[str, float] = {}
        self.recording = False
        self.in_forward = False  # layer hooks also fire in backward's recomputation

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def install(self, model: torch.nn.Module) -> None:
        from hf_superoffload.engine import host_steps, link, stv

        timeline = self
        # commit_pending: compact moments' validated update written by a pass of its own (the
        # early write after validation, or before another use of the partition).
        for name in ("speculate", "step", "replay", "rollback", "accumulate", "commit_pending"):
            original = getattr(host_steps.HostSteps, name)

            def timed(self, part, *args, _original=original, _name=name, **kwargs):
                start = timeline.now()
                try:
                    return _original(self, part, *args, **kwargs)
                finally:
                    if timeline.recording:
                        timeline.tasks.append(
                            {"kind": _name, "part": part.index, "start": start,
                             "end": timeline.now()}
                        )  # fmt: skip

            setattr(host_steps.HostSteps, name, timed)

        host_wait = link.Link.host_waits_for

        def timed_host_wait(event):
            start = timeline.now()
            host_wait(event)
            if timeline.recording and event is not None:
                timeline.event_waits.append(
                    {"thread": threading.current_thread().name, "start": start,
                     "end": timeline.now()}
                )  # fmt: skip

        link.Link.host_waits_for = staticmethod(timed_host_wait)

        wait_for_tasks = stv.Stv.wait_for_tasks

        def timed_wait_for_tasks(self, keys):
            keys = list(keys)
            start = timeline.now()
            wait_for_tasks(self, keys)
            if timeline.recording:
                timeline.waits.append({"parts": keys, "start": start, "end": timeline.now()})

        stv.Stv.wait_for_tasks = timed_wait_for_tasks

        conclude = stv.Stv.conclude

        def timed_conclude(self, result, parts):
            timeline.marks.setdefault("conclude", timeline.now())  # step 0's
            return conclude(self, result, parts)

        stv.Stv.conclude = timed_conclude

        for index, layer in enumerate(_decoder_layers(model)):
            layer.register_forward_pre_hook(self._layer_hook(index))

    def _layer_hook(self, index: int):
        def hook(module, args):
            if self.recording and self.in_forward:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                self.layers.append({"layer": index, "host": self.now(), "event": event})

        return hook


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 1:
            return list(module)
    raise ValueError("no decoder layer list found in the model")


def _model_of(system) -> torch.nn.Module:
    return system.engine.module if hasattr(system, "engine") else system.model


def summarize(timeline: Timeline, gpu_of) -> dict:
    tasks = sorted(timeline.tasks, key=lambda t: t["start"])
    after = [t for t in tasks if t["start"] >= timeline.marks.get("conclude", 0.0)]
    busy = sum(t["end"] - t["start"] for t in after)
    span = (after[-1]["end"] - after[0]["start"]) if after else 0.0
    worker_event_wait = sum(
        w["end"] - w["start"] for w in timeline.event_waits if "worker" in w["thread"]
    )
    main_waits = sum(w["end"] - w["start"] for w in timeline.waits)
    layers = timeline.layers
    return {
        "marks": timeline.marks,
        "tasks": len(tasks),
        "tasks_after_conclude": len(after),
        "conclude_to_first_task_s": (after[0]["start"] - timeline.marks["conclude"])
        if after
        else None,
        "cpu_pass_busy_s": busy,
        "cpu_pass_span_s": span,
        "cpu_pass_idle_s": span - busy,
        "worker_event_wait_s": worker_event_wait,
        "training_thread_wait_s": main_waits,
        "training_thread_waits": len(timeline.waits),
        "last_task_end": after[-1]["end"] if after else None,
        "first_layer_host": layers[0]["host"] if layers else None,
        "last_layer_host": layers[-1]["host"] if layers else None,
        "layer_gpu_start_s": [round(gpu_of(entry["event"]), 4) for entry in layers],
        "layer_host_s": [round(entry["host"], 4) for entry in layers],
    }


def _write_profile(profiler: cProfile.Profile, path: str) -> None:
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(60)
    with open(path, "w") as handle:
        handle.write(text.getvalue())


def _two_steps(system, batch, timeline: Timeline, forward_end, profile: str | None) -> None:
    """Step 0's backward and step() and step 1's forward and backward, recorded."""
    for step in range(2):
        profiler = cProfile.Profile() if profile and step == 1 else None
        timeline.in_forward = step == 1
        if profiler:
            profiler.enable()
        loss = system.forward(batch)
        timeline.in_forward = False
        if step == 1:
            forward_end.record()
        forward_profiler = profiler
        if profiler:  # the forward and the backward apart; written after both
            forward_profiler.disable()
            profiler = cProfile.Profile()
            profiler.enable()
        timeline.marks[f"forward_{step}_host_end"] = timeline.now()
        system.backward(loss)
        if profiler:
            profiler.disable()
            _write_profile(forward_profiler, profile + ".forward")
            _write_profile(profiler, profile)
        timeline.marks[f"backward_{step}_host_end"] = timeline.now()
        if step == 0:
            timeline.tasks.clear()
            timeline.waits.clear()
            timeline.event_waits.clear()
            timeline.marks["step_0_start"] = timeline.now()
            step_profiler = cProfile.Profile() if profile else None
            if step_profiler:
                step_profiler.enable()
            system.optimizer_step()
            if step_profiler:
                step_profiler.disable()
                _write_profile(step_profiler, profile + ".step")
            timeline.marks["step_0_host_end"] = timeline.now()


def _cuda_profiler():
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as cuda_profile

    return cuda_profile(activities=[ProfilerActivity.CUDA])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--system",
        choices=["superoffload", "superoffload_zero3", "superoffload_zero3_compact"],
        required=True,
    )
    add_model_arguments(parser)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--gpu-buckets", default="0")
    parser.add_argument("--bucket-size", type=int, default=1 << 25)
    parser.add_argument("--cast", default="auto")
    parser.add_argument("--ratio", type=float, default=1.0)
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--profile", default=None,
        help="write cProfile's top functions (training thread) of step 1's backward to this "
        "file, of its forward to this file + '.forward', and of step 0's optimizer step to "
        "this file + '.step'",
    )  # fmt: skip
    parser.add_argument(
        "--cuda-trace", default=None,
        help="also profile the two recorded steps' CUDA streams (torch.profiler): write the "
        "Chrome trace to this file and print what each stream did (stream_summary.py)",
    )  # fmt: skip
    args = parser.parse_args()
    try:
        os.environ.update(run_environment(args.system, args.cast))
    except ValueError as refusal:
        sys.exit(str(refusal))
    if "hf_superoffload" in sys.modules:
        sys.exit("hf_superoffload was imported before the system's environment was set")
    torch.manual_seed(0)
    config = model_config(args)
    system = SYSTEMS[args.system](config, args)
    timeline = Timeline()
    timeline.install(_model_of(system))
    batch = torch.randint(0, config.vocab_size, (args.batch, args.seq), device="cuda")
    for _ in range(args.warmup):
        system.step(batch)
    torch.cuda.synchronize()
    timeline.recording = True
    start_event = torch.cuda.Event(enable_timing=True)
    timeline.t0 = time.perf_counter()
    start_event.record()
    # Step 0's step() starts the CPU pass that step 1's forward waits for; step 1 ends after
    # its backward, so every task recorded belongs to step 0's pass or step 1's speculation.
    forward_end = torch.cuda.Event(enable_timing=True)
    cuda_profiler = _cuda_profiler() if args.cuda_trace else contextlib.nullcontext()
    with cuda_profiler as profiled:
        _two_steps(system, batch, timeline, forward_end, args.profile)
    end_event = torch.cuda.Event(enable_timing=True)
    end_event.record()
    torch.cuda.synchronize()
    timeline.marks["gpu_end"] = start_event.elapsed_time(end_event) / 1e3
    timeline.marks["forward_1_gpu_end"] = start_event.elapsed_time(forward_end) / 1e3

    def gpu_of(event) -> float:
        return start_event.elapsed_time(event) / 1e3

    summary = summarize(timeline, gpu_of)
    with open(args.out, "w") as handle:
        json.dump(
            {"args": vars(args), "summary": summary, "tasks": timeline.tasks,
             "waits": timeline.waits, "event_waits": timeline.event_waits},
            handle, indent=1,
        )  # fmt: skip
    if args.cuda_trace:
        profiled.export_chrome_trace(args.cuda_trace)
        streams = summarize_trace(args.cuda_trace)
        with open(args.cuda_trace + ".summary.json", "w") as handle:
            json.dump(streams, handle, indent=1)
        print(json.dumps({"cuda_streams": streams}, indent=1))
    short = {k: v for k, v in summary.items() if not isinstance(v, list)}
    print(json.dumps({"system": args.system, **short}, indent=1))


if __name__ == "__main__":
    main()
