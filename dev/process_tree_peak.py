"""Run a command and report the peak host memory of its whole process tree and of each GPU.

    python dev/process_tree_peak.py OUT.json -- accelerate launch ... examples/sft.py ...

Samples every 0.25 s from /proc (no dependencies): the tree's summed anonymous and shared
memory (what training allocates, pinned buffers included), its file-backed resident pages
(memory-mapped checkpoints: the kernel can drop these under pressure) and, with ``nvidia-smi``,
each visible GPU's used memory. Writes the peaks as JSON when the command ends and exits with
its return code, with a once-a-second timeline of the host figures. Used by the device runbooks to report host peaks next to the memory plan.

With ``TRAIN_LOG`` set to the run's ``log_history.jsonl`` (examples/sft.py writes it as it logs)
it also reports the peak until training ended (``train_anon_shmem_gib``, ``train_end_s``: the
trainer's closing ``train_runtime`` entry), apart from the save that follows.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

GIB = 2**30


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def _tree(root: int) -> list[int]:
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo.extend(_children(pid))
    return pids


def _rss_kib(pid: int) -> dict[str, int]:
    fields = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("RssAnon", "RssFile", "RssShmem"):
                    fields[key] = int(value.split()[0])
    except OSError:
        pass
    return fields


def _gpu_used_mib() -> list[int]:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    return [int(x) for x in out.split()]


def main() -> int:
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    out_path, command = sys.argv[1], sys.argv[3:]
    child = subprocess.Popen(command, start_new_session=True)
    peaks = {"anon_shmem_gib": 0.0, "file_gib": 0.0, "gpu_used_gib": []}
    timeline = []  # (seconds, anon + shmem GiB, file-backed GiB), once a second
    done = threading.Event()
    began = time.monotonic()
    train_log = os.environ.get("TRAIN_LOG")
    log_size = [0]

    def training_ended() -> bool:
        try:
            size = os.path.getsize(train_log)
        except OSError:
            return False
        if size == log_size[0]:
            return False
        log_size[0] = size
        with open(train_log) as f:
            return '"train_runtime"' in f.read()

    def sample() -> None:
        while not done.is_set():
            anon = file = 0
            for pid in _tree(child.pid):
                rss = _rss_kib(pid)
                anon += rss.get("RssAnon", 0) + rss.get("RssShmem", 0)
                file += rss.get("RssFile", 0)
            peaks["anon_shmem_gib"] = max(peaks["anon_shmem_gib"], anon * 1024 / GIB)
            peaks["file_gib"] = max(peaks["file_gib"], file * 1024 / GIB)
            now = time.monotonic() - began
            if train_log and "train_end_s" not in peaks:
                peaks["train_anon_shmem_gib"] = peaks["anon_shmem_gib"]
                if training_ended():
                    peaks["train_end_s"] = round(now, 1)
            if not timeline or now - timeline[-1][0] >= 1.0:
                timeline.append(
                    (round(now, 1), round(anon * 1024 / GIB, 2), round(file * 1024 / GIB, 2))
                )
            gpus = _gpu_used_mib()
            if len(peaks["gpu_used_gib"]) < len(gpus):
                peaks["gpu_used_gib"] += [0.0] * (len(gpus) - len(peaks["gpu_used_gib"]))
            for i, mib in enumerate(gpus):
                peaks["gpu_used_gib"][i] = max(peaks["gpu_used_gib"][i], mib / 1024)
            done.wait(0.25)

    def stop(signum, frame) -> None:  # ends the whole tree, not only the command's first process
        os.killpg(child.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    code = child.wait()
    done.set()
    sampler.join()
    peaks = {
        k: (round(v, 2) if isinstance(v, float) else [round(x, 2) for x in v])
        for k, v in peaks.items()
    }
    peaks["returncode"] = code
    peaks["timeline"] = timeline
    with open(out_path, "w") as f:
        json.dump(peaks, f, indent=1)
    return code


if __name__ == "__main__":
    sys.exit(main())
