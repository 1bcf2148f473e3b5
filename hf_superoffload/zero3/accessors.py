"""DeepSpeed's accessors of fp32 gradients and optimizer state, answered for the host sub groups
of ``SuperOffloadZero3Optimizer``, whose gradients live in its own buffers (in DeepSpeed's
accumulation dtype) and whose state the CPU worker may still be updating.

DeepSpeed's ``safe_get_full_grad``, ``safe_get_local_fp32_param`` and friends call these
methods of the ZeRO-3 optimizer; the sub groups ``ratio`` keeps on the GPU answer from their
own fp32 gradient buffers there.

Between backward and ``step()`` a host sub group may already have been stepped speculatively.
An accessor that reads its fp32 params or moments, or writes them or its gradients
(``safe_set_full_grad``, ``safe_set_local_grad``, ``safe_set_full_fp32_param``, ...), first
undoes that speculation and waits for the worker, so it sees what DeepSpeed's plain offload
shows (the state before the step) and a write is what the step uses: the sub group then steps
after validation, from the written values. A gradient written in full also sets that param's
norm, so the clip follows the gradient that is stepped (DeepSpeed's ``set_fp32_grad_for_param``
keeps the norm from backward; its ``set_local_grad_for_param`` sets it, as here). The full
writers also take params whose partitions end in padding (their size does not divide by the
ranks), which DeepSpeed's cannot write (``_share_of``).
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
        self._gradients_landed()
        # In a gradient slot while the sub group's buffer keeps a deferred update's gradients.
        grads = self._stv.deferred.current_grad(self._host_part_at[i])
        return grads.narrow(0, offset, numel), i

    def _gradients_landed(self) -> None:
        """The copies of gradient partitions into host memory (queued on DeepSpeed's reduce
        stream) have landed."""
        if not get_accelerator().resolves_data_dependency():
            self.reduce_and_partition_stream.synchronize()

    def _settle_for_access(self, sub_group: int) -> None:
        """Undo a speculation on this host sub group (it then steps after validation), write
        its deferred update and move this step's gradients into its gradient buffer
        (engine/deferred_commits.py), and wait for its worker tasks."""
        part = self._host_part_at.get(sub_group)
        if part is None:
            return
        if part.speculated_with is not None:
            self._stv.retract(part)
        self._gradients_landed()
        self._stv.settle_state([part])

    def set_fp32_grad_for_param(self, value, param):
        if not param.requires_grad:
            return
        share = self._share_of(value, param)
        param_id = self.get_param_id(param)
        self._settle_for_access(self.grad_position[param_id][0])
        written, _ = self._get_fp32_grad_state_partition(param, False)
        with torch.no_grad():
            written.copy_(share)
        self.norm_for_param_grads[param_id] = self._constant_buffered_norm2(
            written.narrow(0, 0, self._real_numel(param))
        )

    def _share_of(self, value, param) -> torch.Tensor:
        """This rank's partition of a full-size ``value`` of ``param``, zeros in the padding
        that ends the last ranks' partitions. DeepSpeed's full writers slice the partition
        past the value's end there: its last rank raises, the others go on to their next
        collective and wait."""
        if value.numel() != param.ds_numel:
            raise ValueError(
                f"a full-size value of this param has {param.ds_numel} elements (shape "
                f"{tuple(param.ds_shape)}), got {value.numel()}; write one of that shape, or "
                "this rank's partition through the safe_set_local_* functions."
            )
        numel, real = param.partition_numel(), self._real_numel(param)
        start = numel * self._get_param_partition_rank(param)
        share = value.detach().new_zeros(numel)
        share[:real] = value.detach().flatten()[start : start + real]
        return share

    def set_local_grad_for_param(self, value, param):
        if not param.requires_grad:
            return
        self._settle_for_access(self.grad_position[self.get_param_id(param)][0])
        super().set_local_grad_for_param(value, param)  # sets the norm too

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
        # DeepSpeed's accessors (safe_get_local_fp32_param, safe_set_full_fp32_param, ...) read
        # or write a sub group's state.
        i = self.grad_position[self.get_param_id(param)][0]
        self._settle_for_access(i)
        if self._compact and optim_state_key is not None:
            return self._decoded_moment(param, i, optim_state_key), i
        return super()._get_fp32_opt_state_partition(param, release_swap_buffers, optim_state_key)

    def _decoded_moment(self, param, i: int, key: str) -> torch.Tensor:
        """A compact moment of ``param``'s partition as fp32 values (a copy: compact codes
        cannot be written through it, and the setters refuse them)."""
        if key not in ("exp_avg", "exp_avg_sq"):
            raise ValueError(
                f"optimizer state {key!r}: with compact moments (HF_SUPEROFFLOAD_MOMENTS=compact) "
                "the accessors read 'exp_avg' and 'exp_avg_sq', decoded to fp32."
            )
        part = self._host_part_at.get(i) or self._device_part_at[i]
        index = next(n for n, p in enumerate(self.fp16_groups[i]) if p is param)
        return part.compact.decoded(index)[0 if key == "exp_avg" else 1]

    def set_full_hp_param(self, value, param, optim_state_key=None):
        self._refuse_compact_write(optim_state_key)
        if not param.requires_grad:
            return
        share = self._share_of(value, param)
        written, _ = self._get_fp32_opt_state_partition(param, False, optim_state_key)
        with torch.no_grad():  # the fp32 masters require grad
            written.copy_(share)  # (no NVMe swap to write back: options.py refuses NVMe offload)

    def set_local_hp_param(self, value, param, optim_state_key=None):
        self._refuse_compact_write(optim_state_key)
        super().set_local_hp_param(value, param, optim_state_key)

    def _refuse_compact_write(self, optim_state_key) -> None:
        if self._compact and optim_state_key is not None:
            raise ValueError(
                f"writing optimizer state {optim_state_key!r} is not supported with compact moments "
                "(HF_SUPEROFFLOAD_MOMENTS=compact: 8-bit codes); write the fp32 master "
                "(safe_set_full_fp32_param), or train with fp32 moments to set moments."
            )
