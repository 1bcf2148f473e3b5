"""DeepSpeed's accessors of fp32 gradients and optimizer state, answered for the host sub groups
of ``SuperOffloadZero3Optimizer``, whose gradients live in its own buffers (in DeepSpeed's
accumulation dtype) and whose state the CPU worker may still be updating.

DeepSpeed's ``safe_get_full_grad``, ``safe_get_local_fp32_param`` and friends call these
methods of the ZeRO-3 optimizer; the sub groups ``ratio`` keeps on the GPU answer from their
own fp32 gradient buffers there.
"""

from __future__ import annotations

import torch
from deepspeed.accelerator import get_accelerator


class HostGradientAccessors:
    """Mixed in before DeepSpeedZeroOptimizer_Stage3 (``super()`` is DeepSpeed's)."""

    def _get_fp32_grad_state_partition(self, param, release_swap_buffers):
        i, offset, numel = self.grad_position[self.get_param_id(param)]
        on_device = self._device_part_at.get(i)
        if on_device is not None:  # fp32 on the device, cleared when the step is taken
            return on_device.grad.narrow(0, offset, numel), i
        part = self._host_part_at[i]
        if not get_accelerator().resolves_data_dependency():
            self.reduce_and_partition_stream.synchronize()  # the copies into it have landed
        return part.host_grad.narrow(0, offset, numel), i

    def get_fp32_grad_partitions(self):
        grad_dict: dict[int, dict[int, torch.Tensor]] = {}
        for group in self.fp16_groups:
            for index, param in enumerate(group):
                grad, i = self._get_fp32_grad_state_partition(param, True)
                grad_dict.setdefault(i, {})[index] = grad.float()
        return grad_dict

    def update_fp32_grad_for_param_vectorized(self, update_func, param_list):
        for param in param_list:
            if param.requires_grad:
                full = self.get_fp32_grad_for_param(param)
                self.set_fp32_grad_for_param(update_func(full, param), param)

    def _get_fp32_opt_state_partition(self, param, release_swap_buffers, optim_state_key=None):
        # DeepSpeed's accessors (safe_get_local_fp32_param, ...) read a sub group's state.
        self._stv.worker.wait([self.grad_position[self.get_param_id(param)][0]])
        return super()._get_fp32_opt_state_partition(param, release_swap_buffers, optim_state_key)
