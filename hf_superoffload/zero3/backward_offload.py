"""The backward side of SuperOffloadZero3Optimizer: each param's reduced gradient partition
into its sub group's gradient buffer at the accumulation boundary, and each host sub group
launched on the STV core once its last awaited partition has landed (step() launches the rest).

Mixed in before DeepSpeedZeroOptimizer_Stage3 (``super()`` is DeepSpeed's). It overrides
DeepSpeed's ``partition_grads``, ``set_gradient_accumulation_boundary`` and
``_offload_grad_partition_at_boundary``, and gives the optimizer ``_has_gradient_partition``,
``_params_expecting_gradients``, ``_launch_the_rest`` and ``_note_presence``. Of the optimizer
it reads ``_stv``, ``_host_parts``, ``_host_part_at``, ``_device_part_at``, ``_device_parts``,
``_accumulates`` and DeepSpeed's partitioning and norms; it writes ``_holds_elements``,
``_pending_params``, ``_launched``, ``_boundary_arrivals``, ``_accumulates``,
``_accumulation_claim``, each sub group's ``present`` and ``norm_for_param_grads``, and the STV
core's ``host_sq_norms``.
"""

from __future__ import annotations

import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import log_dist

from ..engine.host_memory import HostMemoryError, check_host_memory
from ..engine.partition import HostPartition
from ..engine.replicas import shares_failures

HAND_SET_BOUNDARY_REMEDIES = (
    "The accumulation boundary was set by hand (set_gradient_accumulation_boundary(False)) "
    "with gradient_accumulation_steps 1, so DeepSpeed's host accumulation buffer, which the "
    "start-up host check did not count, would be made now: set gradient_accumulation_steps in "
    "the DeepSpeed config (or the Trainer) to the most backward passes per step, so that it is "
    "counted (or refused) before training starts; or use fewer GPUs per host, or free host "
    "memory."
)


class BackwardOffload:
    def _has_gradient_partition(self, param) -> bool:
        """Whether this rank's partition of ``param`` holds real elements (not only padding).
        Looked up once per param: it is asked per param in every backward, and DeepSpeed's
        partition rank goes through torch.distributed's group lookups."""
        known = self._holds_elements.get(param.ds_id)
        if known is None:
            rank = self._get_param_partition_rank(param)
            known = self._holds_elements[param.ds_id] = (
                param.partition_numel() * rank < param.ds_numel
            )
        return known

    def _params_expecting_gradients(self) -> dict[int, set[int]]:
        """Per host sub group, the ds_ids whose gradient partitions it waits for."""
        return {
            part.index: {
                p.ds_id
                for p in self.fp16_groups[part.index]
                if p.requires_grad and self._has_gradient_partition(p)
            }
            for part in self._host_parts
        }

    @torch.no_grad()
    def partition_grads(self, params_to_release, grad_partitions):
        boundary = self.is_gradient_accumulation_boundary()
        if not self._accumulates and not (boundary and self.micro_step_id == 0):
            raise RuntimeError(
                "a second backward before step() with gradient_accumulation_steps=1: set "
                "gradient_accumulation_steps in the DeepSpeed config (or the Trainer) to the "
                "number of backward passes per step, or tell DeepSpeed where the boundary is "
                "(engine.set_gradient_accumulation_boundary(False) before each backward but "
                "the last)."
            )
        if boundary and self.micro_step_id == 0:
            # No accumulation: norm and cast on the device, one copy to the host buffer
            # (DeepSpeed's path goes through its accumulation buffer and back first).
            self._offload_boundary_partitions(params_to_release, grad_partitions)
        else:
            self._start_late_accumulations(params_to_release)
            super().partition_grads(params_to_release, grad_partitions)
        if boundary:
            self._note_arrivals(params_to_release)

    def _start_late_accumulations(self, params) -> None:
        """After the window's first backward DeepSpeed adds every gradient partition to its
        accumulation buffer, which for a param that got none so far still holds an earlier
        window's sum: zero that first."""
        if self.micro_step_id == 0:
            return
        window = self._offload_boundary_param_ids
        for param in params:
            if param.ds_id not in window and self._has_gradient_partition(param):
                self._accumulated_partition(param).zero_()

    @shares_failures  # a rank refused here ends the others' next collective with its error
    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """DeepSpeed's engine forwards a boundary the user sets by hand (its documented way to
        accumulate a variable number of micro-batches, with ``coalesce_grad_reduction`` or
        without): a backward that is not at the boundary accumulates, so with
        ``gradient_accumulation_steps`` 1 the accumulation buffer left out at start-up is made
        after all (``host_bytes()["accumulation"]`` counts it), once the host check grants
        it."""
        if not is_boundary and not self._accumulates:
            self._claim_accumulation_buffer()
            self._restore_accumulation_buffer()
            self._accumulates = True
            log_dist(
                "hf_superoffload: the accumulation boundary was set by hand: made the host "
                f"gradient accumulation buffer ({self.grad_partitions_flat_buffer.numel()} "
                "elements per rank)",
                ranks=[0],
            )
        super().set_gradient_accumulation_boundary(is_boundary)

    def _claim_accumulation_buffer(self) -> None:
        """Check that the host holds the accumulation buffer before it is made (the claim is
        held while the optimizer, which holds the buffer, lives). If not, refuse before
        anything of this call changes: the window's CPU work is waited for and its gradients
        stay as they were."""
        numel = self._accumulation_buffer_numel()  # what _restore_accumulation_buffer makes
        parts = {"accumulation": numel * self.gradient_accumulation_dtype.itemsize}
        try:
            self._accumulation_claim = check_host_memory(parts, HAND_SET_BOUNDARY_REMEDIES)
        except HostMemoryError as error:
            self.synchronize()
            raise HostMemoryError(
                f"SuperOffload on ZeRO-3 refused set_gradient_accumulation_boundary(False): "
                f"{error} Nothing was changed."
            ) from error

    def _offload_boundary_partitions(self, params, grad_partitions) -> None:
        for param, grad_partition in zip(params, grad_partitions, strict=True):
            if self._has_gradient_partition(param):
                self._offload_boundary_param_ids.add(param.ds_id)
                self._offload_grad_partition_at_boundary(param, grad_partition, {}, {})
            if param.grad is not None and not get_accelerator().is_synchronized_device():
                param.grad.record_stream(get_accelerator().current_stream())
            param.grad = None

    def _offload_grad_partition_at_boundary(self, param, grad_buffer, *swap_lists) -> None:
        """A param's final gradient partition of this step (on the device): its norm, then
        into its sub group's gradient buffer: on the host as it is, or on the device in fp32
        for the sub groups ``ratio`` keeps there."""
        param_id = self.get_param_id(param)
        i, offset, _ = self.grad_position[param_id]
        self._boundary_arrivals.add(param.ds_id)
        self.norm_for_param_grads[param_id] = self._constant_buffered_norm2(grad_buffer)
        on_device = self._device_part_at.get(i)
        if on_device is not None:
            on_device.grad.narrow(0, offset, grad_buffer.numel()).copy_(grad_buffer.reshape(-1))
            return
        grads = self._stv.deferred.gradient_target(self._host_part_at[i])
        target = grads.narrow(0, offset, grad_buffer.numel())
        target.copy_(grad_buffer.reshape(-1), non_blocking=True)
        self._stv.stats.bytes_d2h += target.numel() * target.element_size()

    def _note_arrivals(self, params) -> None:
        """Launch the host sub groups whose last awaited gradient partition just landed."""
        completed = set()
        for param in params:
            i = self.grad_position[self.get_param_id(param)][0]
            waiting = self._pending_params.get(i)
            if waiting is not None and param.ds_id in waiting:
                waiting.discard(param.ds_id)
                if not waiting:
                    completed.add(i)
        for part in self._host_parts:
            if part.index in completed:
                self._launch(part, speculate=True)

    def _note_presence(self, part: HostPartition) -> None:
        """Which of the sub group's params got a gradient in this window (a param whose
        partition here is only padding counts as having one: its zeros step to zeros)."""
        window = self._offload_boundary_param_ids
        part.present = [
            p.ds_id in window or not self._has_gradient_partition(p)
            for p in self.fp16_groups[part.index]
        ]

    def _launch(self, part: HostPartition, speculate: bool) -> None:
        self._note_presence(part)
        norms = [
            self.norm_for_param_grads[self.get_param_id(p)]
            for p in self.fp16_groups[part.index]
            if self.get_param_id(p) in self.norm_for_param_grads
        ]
        if norms:
            square = torch.stack([n.float() for n in norms]).square().sum().reshape(1)
            self._stv.host_sq_norms[part.index : part.index + 1].copy_(square, non_blocking=True)
        else:
            self._stv.host_sq_norms[part.index] = 0.0
        # Recorded on the stream that queued the copies to the host (DeepSpeed's reduce
        # stream under overlap_comm): the worker reads the gradients once it completes.
        self._launched.add(part.index)
        self._stv.launch(part, self._link.record(), speculate)

    def _launch_the_rest(self) -> None:
        """Sub groups whose params did not all get their last gradient at the boundary. A
        param reduced earlier in the window takes its sum from DeepSpeed's accumulation
        buffer now; a param without a gradient in the window is skipped (``ParamSteps``).
        They step after validation, like every sub group when the boundary was only known
        at step()."""
        self._take_late_gradients()
        for part in self._host_parts:
            if part.index in self._launched:
                continue
            missing = self._pending_params[part.index] - self._offload_boundary_param_ids
            grads = self._stv.deferred.gradient_target(part) if missing else None
            for param in self.fp16_groups[part.index]:
                if param.ds_id in missing:  # read by DeepSpeed's gradient accessors
                    _, offset, numel = self.grad_position[self.get_param_id(param)]
                    grads.narrow(0, offset, numel).zero_()
            self._launch(part, speculate=False)
        for part in self._device_parts:
            self._note_presence(part)

    def _take_late_gradients(self) -> None:
        """Params reduced in this window whose sub group did not get them at the boundary
        (their last gradient came in an earlier micro-batch): their sum, from DeepSpeed's
        accumulation buffer, into the sub group's gradients, with its norm."""
        late = [
            p
            for group in self.fp16_groups
            for p in group
            if p.ds_id in self._offload_boundary_param_ids
            and p.ds_id not in self._boundary_arrivals
            and self._has_gradient_partition(p)
        ]
        if not late:
            return
        if not get_accelerator().resolves_data_dependency():
            self.reduce_and_partition_stream.synchronize()  # DeepSpeed's sums have landed
        device = get_accelerator().current_device_name()
        for param in late:  # into the sub group's gradients (gradient_target)
            summed = self._accumulated_partition(param).to(device, non_blocking=True)
            self._offload_grad_partition_at_boundary(param, summed)
