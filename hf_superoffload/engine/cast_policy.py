"""Where to cast between the model dtype (bf16/fp16) and the fp32 master, per direction.

Gradients: cast to fp32 on the device and move 4 B/element, or move the model dtype (2 B) and
cast on the host. Params: move the fp32 master (4 B) and cast on the device, or have the CPU
Adam write the rounded copy in its own pass (`out_lowp`) and move 2 B. On a fast link
(NVLink-C2C) casting on the device wins; on PCIe moving half the bytes can. The choice comes
from measured bandwidths, not a fixed rule.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from ..ops import adam_step

logger = logging.getLogger("hf_superoffload")

_PROBE_ELEMENTS = 1 << 24  # 16M elements: long enough to time, short enough for start-up


@dataclasses.dataclass(frozen=True)
class CastPlan:
    grads_on_device: bool  # True: fp32 grads cross the link; False: model-dtype grads do
    params_on_device: bool  # True: the fp32 master crosses; False: the kernel's rounded copy does
    reason: str


@dataclasses.dataclass(frozen=True)
class LinkCosts:
    """Seconds per element of each way to move one direction (measured)."""

    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    host_cast_s_per_elem: float  # bf16 -> fp32 on the CPU, one pass
    host_copy_out_s_per_elem: float  # extra kernel time for writing out_lowp


def _timed(fn, repeats: int = 3) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_link(device: torch.device, dtype: torch.dtype) -> LinkCosts:
    n = _PROBE_ELEMENTS
    dev32 = torch.empty(n, device=device)
    host32 = torch.empty(n, pin_memory=True)
    host_low = torch.empty(n, dtype=dtype, pin_memory=True)

    def d2h():
        host32.copy_(dev32, non_blocking=True)
        torch.cuda.synchronize(device)

    def h2d():
        dev32.copy_(host32, non_blocking=True)
        torch.cuda.synchronize(device)

    d2h_bw = 4 * n / _timed(d2h)
    h2d_bw = 4 * n / _timed(h2d)
    host_cast = _timed(lambda: host32.copy_(host_low)) / n
    m, v, g = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    hyper = {"step": 1, "lr": 0.0, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}
    plain = _timed(lambda: adam_step(host32, g, m, v, **hyper))
    with_copy = _timed(lambda: adam_step(host32, g, m, v, **hyper, out_lowp=host_low))
    return LinkCosts(d2h_bw, h2d_bw, host_cast, max(with_copy - plain, 0.0) / n)


def plan_from_costs(costs: LinkCosts) -> CastPlan:
    """Pick the cheaper way per direction. Host-side work counts in full: the CPU is the
    resource the whole step is waiting on, while link time overlaps with backward."""
    grads_device = 4 / costs.d2h_bytes_per_s
    grads_host = 2 / costs.d2h_bytes_per_s + costs.host_cast_s_per_elem
    params_device = 4 / costs.h2d_bytes_per_s
    params_host = 2 / costs.h2d_bytes_per_s + costs.host_copy_out_s_per_elem
    reason = (
        f"measured D2H {costs.d2h_bytes_per_s / 1e9:.1f} GB/s, H2D {costs.h2d_bytes_per_s / 1e9:.1f} "
        f"GB/s, host cast {costs.host_cast_s_per_elem * 1e9:.2f} ns/elem, kernel copy-out "
        f"{costs.host_copy_out_s_per_elem * 1e9:.2f} ns/elem -> per element: grads "
        f"{grads_device * 1e9:.2f} ns (cast on device) vs {grads_host * 1e9:.2f} ns (on host), "
        f"params {params_device * 1e9:.2f} ns vs {params_host * 1e9:.2f} ns"
    )
    return CastPlan(grads_device <= grads_host, params_device < params_host, reason)


def choose_cast_plan(mode: str, device: torch.device, dtype: torch.dtype) -> CastPlan:
    if mode not in ("auto", "gpu", "cpu"):
        raise ValueError(f"cast must be 'auto', 'gpu' or 'cpu', got {mode!r}.")
    if dtype == torch.float32:
        plan = CastPlan(True, True, "model params are fp32: nothing to cast")
    elif mode == "gpu":
        plan = CastPlan(True, True, "cast='gpu' requested")
    elif mode == "cpu":
        plan = CastPlan(False, False, "cast='cpu' requested")
    elif device.type != "cuda":
        plan = CastPlan(False, False, "no device link (model on CPU): cast in the CPU pass")
    else:
        plan = plan_from_costs(measure_link(device, dtype))
    logger.info(
        "hf_superoffload cast plan: grads cast on %s, params cast on %s (%s)",
        "device" if plan.grads_on_device else "host",
        "device" if plan.params_on_device else "host",
        plan.reason,
    )
    return plan
