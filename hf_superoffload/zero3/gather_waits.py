"""Param gathers on the ZeRO-3 path wait for the CPU Adam work on the sub groups they read, and
no longer than they must.

``step()`` returns while the worker still updates the host sub groups; each sub group's params
come back to the device partition when its pass is done. A gather that reads a partition must
come after that return. DeepSpeed gathers in two places: for the module about to run, and ahead
of it (prefetch, until ``stage3_max_live_parameters`` params are gathered: 1e9 by default, about
nine decoder layers of a 3B model).

- A gather that copies data (several ranks, params offloaded to the host, quantized partitions)
  reads the partition when it is issued: it waits then, on the training thread.
- With one rank per partition and the partition on the device, DeepSpeed's "gather" only points
  the param at its partition and reads nothing: its handle's ``wait()`` (called when the module
  that uses the param runs) waits instead. Waiting at issue made a prefetch block the training
  thread on sub groups nine layers ahead of the one it was about to run, so after the CPU pass
  ended nine layers were still to compute (0.11 s a step at 3.4B on an H100).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from deepspeed.accelerator import get_accelerator

GATHER_METHODS = ("all_gather_coalesced", "all_gather")  # attributes DeepSpeed sets per param


class WaitsAtUse:
    """A gather handle whose ``wait()`` completes DeepSpeed's handle, then waits for the
    updates of the params it gathered (once)."""

    def __init__(self, handle, wait_for_updates: Callable[[], None]):
        self._handle = handle
        self._wait_for_updates: Callable[[], None] | None = wait_for_updates

    def wait(self, **kwargs) -> None:
        # DeepSpeed's wait first: it may synchronize the current stream, which must not then
        # also hold the host for the params' copies back to the device.
        self._handle.wait(**kwargs)
        if self._wait_for_updates is not None:
            wait, self._wait_for_updates = self._wait_for_updates, None
            wait()


def reads_nothing_when_issued(params: list) -> bool:
    """Whether DeepSpeed's gather of ``params`` only points them at their device partitions
    (one rank per partition, partitions on the accelerator, not quantized)."""
    device_type = get_accelerator().device_name()  # "cpu" under DS_ACCELERATOR=cpu
    return all(
        getattr(p, "ds_zero_partition_world_size", None) == 1
        and getattr(p, "ds_secondary_tensor", None) is None
        and p.ds_tensor.device.type == device_type
        and not hasattr(p.ds_tensor, "ds_quant_scale")
        for p in params
    )


def wrap_gathers(
    param: torch.nn.Parameter,
    wait_for_params: Callable[[list], None],
) -> None:
    """NOTE: replaces DeepSpeed's per-param gather functions (attributes it sets on each ZeRO-3
    param) with ones that wait for the params' updates, at issue or at use (module docstring)."""
    for name in GATHER_METHODS:
        gather = getattr(param, name)

        def gather_updated(*args, _gather=gather, _coalesced=name == GATHER_METHODS[0], **kwargs):
            params = args[0] if args else kwargs.get("param_list", kwargs.get("params"))
            params = [param] if params is None else list(params)
            if _coalesced and reads_nothing_when_issued(params):
                return WaitsAtUse(_gather(*args, **kwargs), lambda: wait_for_params(params))
            wait_for_params(params)
            return _gather(*args, **kwargs)

        setattr(param, name, gather_updated)
