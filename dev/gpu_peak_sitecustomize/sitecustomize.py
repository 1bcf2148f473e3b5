"""Each process's peak of torch's GPU allocator, for dev/long_sequences.sh and dev/liger_compare.sh.

Python imports ``sitecustomize`` at start-up in every interpreter that has this folder on
PYTHONPATH, the ranks ``accelerate launch`` starts among them. With ``GPU_PEAK_DIR`` set, a
process that used CUDA writes ``GPU_PEAK_DIR/rank<RANK>_<pid>.json`` as it exits normally:
``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` of its device, in bytes (what
the memory plan predicts is the allocated peak; nvidia-smi shows the reserved one plus the CUDA
context). The file is also rewritten every 10 s while the process runs, so a rank ended by a
signal (a time cap, the launcher tearing down after the last step, the host's OOM killer) leaves
the peaks it had reached by then.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import sys
import threading


def _run_the_one_shadowed() -> None:
    """This file takes the place of any sitecustomize later on sys.path (an image's own):
    run that one too, so the processes start as they would without this folder."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        path = os.path.join(entry or ".", "sitecustomize.py")
        if os.path.abspath(entry or ".") != here and os.path.isfile(path):
            spec = importlib.util.spec_from_file_location("_shadowed_sitecustomize", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return


def _write_peak(folder: str) -> None:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return  # the launcher, or a process that never touched the GPU
    # The writer thread's current device is its own (0): a rank's is its LOCAL_RANK's.
    local = os.environ.get("LOCAL_RANK")
    device = (
        int(local)
        if local is not None and torch.cuda.device_count() > int(local)
        else torch.cuda.current_device()
    )
    record = {
        "rank": os.environ.get("RANK"),
        "pid": os.getpid(),
        "device": device,
        "max_allocated_bytes": torch.cuda.max_memory_allocated(device),
        "max_reserved_bytes": torch.cuda.max_memory_reserved(device),
    }
    name = f"rank{record['rank']}_{record['pid']}.json"
    path = os.path.join(folder, name)
    with open(path + ".tmp", "w") as f:  # a reader never sees half a file
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def _write_every(folder: str, seconds: float) -> None:
    while True:
        threading.Event().wait(seconds)
        _write_peak(folder)


if os.environ.get("GPU_PEAK_DIR"):
    os.makedirs(os.environ["GPU_PEAK_DIR"], exist_ok=True)
    atexit.register(_write_peak, os.environ["GPU_PEAK_DIR"])
    threading.Thread(
        target=_write_every, args=(os.environ["GPU_PEAK_DIR"], 10.0), daemon=True
    ).start()

_run_the_one_shadowed()
