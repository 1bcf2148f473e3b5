"""The ZeRO-3 path's tail: the sub groups DeepSpeed's ``ratio`` keeps on the GPU, stepped by the
engine's DeviceTail (torch's AdamW on the device, the arithmetic of the CPU kernel) after
validation, with the clip coefficient the STV core's verdict gives.

DeepSpeed's own partial offload is not used: it steps those sub groups with a second AdamW whose
first param group is a copy taken at start-up (so an LR schedule never reaches it), whose moments
no checkpoint saves, and which it builds only over its own CPU Adam. Here DeepSpeed is told to
offload everything (``offload_ratio=1.0``) and the first ``1 - ratio`` of the sub groups (the
first layers: the last to get their gradients, whose CPU work could not overlap backward) are
then moved to the device: fp32 master, both moments and fp32 gradients there (16 B/param), the
moments registered as the base optimizer's state of the master, as the host sub groups' are,
so DeepSpeed's checkpoints carry them. On a CPU-only run the "device" is the CPU: the same
code runs, so CI checks it.

Mixed in before DeepSpeedZeroOptimizer_Stage3, beside HostState.
"""

from __future__ import annotations

import torch

from ..engine.device_tail import DeviceTail
from ..engine.partition import HostPartition
from .param_steps import ParamSteps


def device_sub_group_count(ratio: float, sub_groups: int) -> int:
    """How many of the first sub groups stay on the device: DeepSpeed's rule for ``ratio``,
    which the memory plan and the host check count by too (``sub_group_cut.py`` holds it,
    beside the cut into sub groups)."""
    from .sub_group_cut import device_sub_group_count as rule

    return rule(ratio, sub_groups)


class DeviceSubGroup(ParamSteps, HostPartition):
    """One sub group whose fp32 master, moments and fp32 gradients live on the device. The
    DeviceTail's AdamW steps a view per param, so a param without a gradient in a step is
    skipped, as on the host (``ParamSteps``)."""

    def __init__(
        self, index: int, group_index: int, master: torch.Tensor, flat_param, spans, compact=None
    ):
        """``compact``: its CompactMoments (on the device), in place of AdamW's two."""
        moments = (None, None) if compact else (torch.zeros_like(master), torch.zeros_like(master))
        super().__init__(index, group_index, master, *moments, None, None, flat_param)
        self.compact = compact
        self.init_param_steps(spans)
        self.grad = torch.zeros_like(master)  # this step's gradient partitions, in fp32
        self.device_group: dict | None = None  # its param group in the DeviceTail's AdamW


class DeviceSubGroups:
    def _build_device_sub_groups(self, count: int) -> list[DeviceSubGroup]:
        """Move the first ``count`` sub groups' fp32 masters to the device and register them
        with the tail, their moments as the base optimizer's state."""
        device = self._link.device
        self._tail = DeviceTail()
        parts = []
        for i in range(count):
            master = self.fp32_partitioned_groups_flat[i]
            on_device = master.detach().to(device, copy=True)
            on_device.ds_id = getattr(master, "ds_id", None)
            # DeepSpeed's subgroup_to_device still says "cpu": none of its partial-offload
            # branches (its second AdamW) may run.
            self.fp32_partitioned_groups_flat[i] = on_device
            self.optimizer.state.pop(master, None)
            part = DeviceSubGroup(
                i,
                self.sub_group_to_group_id[i],
                on_device,
                self.fp16_partitioned_groups_flat[i],
                self._param_spans(i),
                self._compact_moments(i, device) if self._compact else None,
            )
            self._register_moments(part, on_device)
            self._tail.register(part)
            parts.append(part)
        return parts

    def _step_device_sub_groups(self, coef: float | None) -> None:
        """Step the device sub groups with the validated clip coefficient (None: the step was
        skipped), then clear their gradients for the next step (``present`` says which
        params got one)."""
        parts = self._device_parts
        if coef is not None and parts:
            hypers = [self._stv.hyper(p, p.step + 1) for p in parts]
            self._tail.step(parts, hypers, coef)
        for part in parts:
            part.grad.zero_()

    def device_bytes(self) -> dict[str, int]:
        """Device memory the sub groups ``ratio`` keeps there hold, by what they hold."""
        parts = self._device_parts

        def nbytes(tensors) -> int:
            return sum(t.numel() * t.element_size() for t in tensors)

        return {
            "master": nbytes(p.master for p in parts),
            "gradients": nbytes(p.grad for p in parts),
            "moments": sum(
                p.compact.nbytes() if p.compact else nbytes([p.exp_avg, p.exp_avg_sq])
                for p in parts
            ),
        }
