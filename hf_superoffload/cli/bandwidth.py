"""Host <-> GPU copy bandwidth each way, from page-locked host memory, timed with CUDA events.

A short probe (a 256 MiB buffer, a few copies): enough to tell NVLink-C2C (hundreds of GB/s)
from PCIe (tens), which is what the user needs to know (e.g. to compare cast='gpu' there).
"""

from __future__ import annotations

import torch

PROBE_BYTES = 256 * 2**20
REPEATS = 4


def measure(device: int, nbytes: int = PROBE_BYTES, repeats: int = REPEATS) -> dict[str, float]:
    """Bytes per second host->GPU ("h2d") and GPU->host ("d2h") on GPU ``device``."""
    with torch.cuda.device(device):
        rates = _measure_current(nbytes, repeats)
        torch.cuda.empty_cache()  # hand the probe's memory back to the training that follows
    return rates


def _measure_current(nbytes: int, repeats: int) -> dict[str, float]:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return {
        "h2d": _copy_rate(lambda: gpu.copy_(host, non_blocking=True), nbytes, repeats),
        "d2h": _copy_rate(lambda: host.copy_(gpu, non_blocking=True), nbytes, repeats),
    }


def _copy_rate(copy, nbytes: int, repeats: int) -> float:
    copy()  # warm-up: first-touch and driver set-up stay out of the timing
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        copy()
    end.record()
    end.synchronize()
    return nbytes * repeats / (start.elapsed_time(end) / 1e3)
