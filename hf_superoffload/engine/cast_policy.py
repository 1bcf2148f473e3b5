"""Where to cast between the model dtype (bf16/fp16) and the fp32 master, per direction.

``cast="auto"``: gradients cross as 16-bit values the kernel upcasts as it reads them; the
fp32 master crosses back and the device casts it. Chosen by host memory traffic, host memory
held and time measured end to end, not by link time alone:

- Gradients: 2 B per element of DMA writes and 2 B of kernel reads, against 4 + 4 for fp32
  gradients cast on the device; the kernel ran 5.7 against 5.3 G elements/s (H100 host, 15
  threads). Nothing makes fp32 gradients cheaper.
- Params: the fp32 master across (4 B of DMA reads from host memory, a cast on the device)
  and the kernel's rounded copy (2 B more of kernel writes, 2 B of DMA reads) cost the same
  host memory traffic; the copy halves the link time. Measured on one H100 (PCIe, 3.4B params, seq 4096,
  clipping every step so the CPU pass is the critical path, 0 tail buckets): 1.565 s/step
  with the copy (52.0 GiB of host memory used) against 1.606 with fp32 across (45.6 GiB),
  and without clipping 1.107 against 1.110. Those copies were a buffer per bucket; the
  standalone engine now shares one small ring between buckets, as the ZeRO-3 path does
  (copy_out.py), so the copy no longer costs host memory. Auto stays fp32 until the ring's
  piecewise copies are measured on a GPU as fast as the per-bucket ones were.

``"gpu"`` (fp32 both ways: 1.534 s/step above) and ``"cpu"`` (16-bit both ways) stay
available to compare on other machines.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

logger = logging.getLogger("hf_superoffload")


@dataclasses.dataclass(frozen=True)
class CastPlan:
    grads_on_device: bool  # True: fp32 grads cross the link; False: model-dtype grads do
    params_on_device: bool  # True: the fp32 master crosses; False: the kernel's rounded copy does
    reason: str


def decide_cast(mode: str, device_type: str, dtype: torch.dtype) -> CastPlan:
    """The plan for ``mode`` on a device of ``device_type`` ("cuda", "cpu"), from these alone
    (nothing is measured), so that a memory plan made before the run knows it too."""
    if mode not in ("auto", "gpu", "cpu"):
        raise ValueError(f"cast must be 'auto', 'gpu' or 'cpu', got {mode!r}.")
    if dtype == torch.float32:
        return CastPlan(True, True, "model params are fp32: nothing to cast")
    if mode == "gpu":
        return CastPlan(True, True, "cast='gpu' requested")
    if mode == "cpu":
        return CastPlan(False, False, "cast='cpu' requested")
    if device_type != "cuda":
        return CastPlan(False, False, "no device link (model on CPU): cast in the CPU pass")
    return CastPlan(False, True, "auto: 16-bit grads (half the host traffic), fp32 params")


def choose_cast_plan(mode: str, device: torch.device, dtype: torch.dtype) -> CastPlan:
    """``decide_cast``'s plan for ``device``, logged."""
    plan = decide_cast(mode, device.type, dtype)
    logger.info(
        "hf_superoffload cast plan: grads cast on %s, params cast on %s (%s)",
        "device" if plan.grads_on_device else "host",
        "device" if plan.params_on_device else "host",
        plan.reason,
    )
    return plan


def rank0_plan(plan: CastPlan, replicas) -> CastPlan:
    """With replicas (engine.replicas.Replicas), rank 0's plan on every rank: it sets the
    dtype they all reduce in."""
    if not replicas.distributed:
        return plan
    grads, params = replicas.from_rank0([plan.grads_on_device, plan.params_on_device])
    return CastPlan(bool(grads), bool(params), f"rank 0's: {plan.reason}")
