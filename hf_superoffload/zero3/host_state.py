"""The host state of SuperOffloadZero3Optimizer's CPU sub groups (device_sub_groups.py holds the
ones ``ratio`` keeps on the GPU): one HostPartition per sub group
over DeepSpeed's fp32 master, with our own gradient buffer in place of DeepSpeed's fp32 one and
the Adam moments registered as the base optimizer's state (so DeepSpeed's checkpoints carry
them); what it weighs; and DeepSpeed's host buffers it frees or keeps pageable.

Mixed in before DeepSpeedZeroOptimizer_Stage3 (``super()`` is DeepSpeed's): DeepSpeed's
constructor calls ``_configure_offloading`` and ``initialize_optimizer_states``.
"""

from __future__ import annotations

import torch

from ..engine.compact_moments import CompactMoments
from ..engine.partition import HostPartition
from ..engine.state_checks import COMPACT_STATE_KEYS
from .param_steps import ParamSteps


def compact_salts(init_optimizer, dp_group) -> dict[int, int]:
    """Each param's rounding-bit salt for compact moments (by id): its place among the base
    optimizer's params, per rank (a rank holds its own partition of it)."""
    from deepspeed import comm as dist

    world, rank = dist.get_world_size(group=dp_group), dist.get_rank(group=dp_group)
    ordered = (p for group in init_optimizer.param_groups for p in group["params"])
    return {id(p): n * world + rank for n, p in enumerate(ordered)}


class HostSubGroup(ParamSteps, HostPartition):
    """A CPU sub group: skips the params without a gradient in a step (``ParamSteps``)."""


class HostState:
    def _configure_offloading(self, offload_optimizer_config, offload_param_config):
        super()._configure_offloading(offload_optimizer_config, offload_param_config)
        # ``pin_memory`` page-locks our transfer buffers (exact size); DeepSpeed's own host
        # buffers are freed or bypassed here, except its accumulation buffer when it is used.
        self._pin_transfers = self.offload_optimizer_pin_memory
        self.offload_optimizer_pin_memory = self._pin_transfers and self._accumulates

    def _setup_for_real_optimizer(self):
        """DeepSpeed's, without its host accumulation buffer (and per-param views) when
        nothing accumulates: every gradient partition then takes our boundary path and the
        buffer would be dropped unread, after it had set the start-up peak (the partition's
        fp32 masters and this buffer: 6 B/param in bf16, against 4 without it). DeepSpeed
        sizes it from ``fp16_groups``, which nothing else in this set-up reads here (deepspeed
        0.19: the NVMe path, which this optimizer refuses, and its
        ``initialize_optimizer_states``, which ours replaces), so the groups are hidden from
        it meanwhile; tests/test_zero3_start_up_memory.py checks that no buffer is made."""
        if self._accumulates:
            return super()._setup_for_real_optimizer()
        groups = self.fp16_groups
        self.fp16_groups = [[] for _ in groups]
        try:
            return super()._setup_for_real_optimizer()
        finally:
            self.fp16_groups = groups

    def initialize_optimizer_states(self):
        """Nothing: with CPU offload DeepSpeed's only gives every sub group an fp32 gradient
        buffer (4 B/param of host memory) that our own gradient buffers replace, and every
        reader of those buffers on this path is ours. Skipping it keeps 4 B/param out of the
        start-up peak, which below ``ratio`` 0.7 was the run's peak (33.0 GiB against 28.3
        steady at 0.6, 3.37B params on an H100 host)."""

    def _param_spans(self, i: int) -> list[tuple[int, int]]:
        """Each param's (offset, numel) in sub group ``i``'s flat partition."""
        spans = []
        for param in self.fp16_groups[i]:
            _, offset, numel = self.grad_position[self.get_param_id(param)]
            spans.append((offset, numel))
        return spans

    def _compact_moments(self, i: int, device=None) -> CompactMoments:
        """Compact moments of sub group ``i``: a block grid per param partition, each salted
        with the param's place among the optimizer's params and this rank (``_salt_of``)."""
        salts = [self._salt_of[id(p)] for p in self.fp16_groups[i]]
        master = self.fp32_partitioned_groups_flat[i]
        # Copied to the GPU for its speculative passes (device_speculation.py): page-locked.
        staged = device is None and self._device_speculation is not None
        empty = self._link.host_empty if staged else None
        return CompactMoments(self._param_spans(i), salts, master.numel(), device, empty)

    def _register_moments(self, part: HostPartition, master: torch.Tensor) -> None:
        """The partition's moments as the base optimizer's state of ``master`` (DeepSpeed's
        checkpoints carry them): AdamW's two, or the compact codes and block scales."""
        state = self.optimizer.state[master]
        if part.compact is None:
            state.update(exp_avg=part.exp_avg, exp_avg_sq=part.exp_avg_sq)
        else:
            state.update(zip(COMPACT_STATE_KEYS, part.compact.tensors(), strict=True))
        state["step"] = self._step_value(0)

    def _real_numel(self, param) -> int:
        """Elements of ``param`` in this rank's partition of it, its padding left out."""
        numel = param.partition_numel()
        return max(0, min(numel, param.ds_numel - self._get_param_partition_rank(param) * numel))

    def _padding(self, i: int) -> list[tuple[int, int]]:
        """(offset, numel) of the padding in sub group ``i``'s flat partition, which no
        gradient partition writes (its gradients there stay zero)."""
        ranges = []
        for param in self.fp16_groups[i]:
            _, offset, numel = self.grad_position[self.get_param_id(param)]
            real = self._real_numel(param)
            if real < numel:
                ranges.append((offset + real, numel - real))
        return ranges

    @torch.no_grad()
    def _zero_padding(self) -> None:
        """The padding that ends the last ranks' partitions of a param holds whatever memory
        DeepSpeed's partitioning left there (``torch.empty``): zero it in the fp32 masters and
        the 16-bit partitions, so that stepping it (zero gradients, zero moments) keeps it at
        zero and checkpoints are deterministic."""
        for i in range(len(self.fp16_groups)):
            master, low = self.fp32_partitioned_groups_flat[i], self.fp16_partitioned_groups_flat[i]
            for offset, numel in self._padding(i):
                master.narrow(0, offset, numel).zero_()
                if low is not None:
                    low.narrow(0, offset, numel).zero_()

    def _build_host_partitions(self, params_on_device: bool) -> list[HostPartition]:
        """One HostPartition per CPU sub group, over DeepSpeed's fp32 master, with our own
        gradient buffer (DeepSpeed's accumulation dtype, page-locked, exact size) in place of
        DeepSpeed's fp32 one; its moments are registered as the base optimizer's state of
        that master."""
        parts = []
        for i, master in enumerate(self.fp32_partitioned_groups_flat):
            if i in self._device_part_at:
                continue
            staged = params_on_device or self._device_speculation is not None
            if staged and self._link.is_cuda and not master.is_pinned():
                # The H2D copy reads the master: page-locked, or every copy would block.
                pinned = self._link.host_empty(master.numel(), master.dtype)
                master.data = pinned.copy_(master)
            compact = self._compact_moments(i) if self._compact else None
            exp_avg = exp_avg_sq = None
            if compact is None:
                exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
            # Zeroed once: its padding is never written (DeepSpeed's gradient partitions hold
            # the real elements only), and the kernel steps the padding with the rest.
            host_grad = self._link.host_empty(master.numel(), self.gradient_accumulation_dtype)
            host_grad.zero_()
            flat_param = self.fp16_partitioned_groups_flat[i]
            group = self.sub_group_to_group_id[i]
            part = HostSubGroup(i, group, master, exp_avg, exp_avg_sq, host_grad, None, flat_param)
            part.compact = compact
            part.padding = self._padding(i)
            part.init_param_steps(self._param_spans(i))
            self._register_moments(part, master)
            parts.append(part)
        return parts

    def _restore_accumulation_buffer(self) -> None:
        """Make DeepSpeed's host accumulation buffer (and its per-param views), left out at
        start-up, as its constructor does, unpinned: the user set the accumulation boundary
        by hand, so backward passes without a step in between accumulate after all.
        ``host_bytes`` counts it from then on."""
        params = [p for group in self.fp16_groups for p in group]
        buffer = torch.zeros(
            self._accumulation_buffer_numel(),
            dtype=self.gradient_accumulation_dtype,
            device=self.device,
        )
        views = self._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition
        offset = 0
        for param in params:
            views[param.ds_id] = buffer.narrow(0, offset, param.partition_numel())
            offset += param.partition_numel()
        self.grad_partitions_flat_buffer = buffer

    def _accumulation_buffer_numel(self) -> int:
        """Elements of DeepSpeed's host accumulation buffer (in its accumulation dtype): every
        param's gradient partition. ``_restore_accumulation_buffer`` makes it of this size,
        and the hand-set boundary's host check counts it first (backward_offload.py)."""
        return sum(p.partition_numel() for group in self.fp16_groups for p in group)

    def _accumulated_partition(self, param) -> torch.Tensor:
        """This window's sum of ``param``'s gradient partitions in DeepSpeed's accumulation
        buffer (its real elements)."""
        views = self._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition
        return views[param.ds_id].narrow(0, 0, self._real_numel(param))

    def host_bytes(self) -> dict[str, int]:
        """Host memory this rank's optimizer holds, by what it holds."""

        def nbytes(tensors) -> int:
            return sum(t.numel() * t.element_size() for t in tensors if t is not None)

        parts = self._host_parts
        return {
            "master": nbytes(p.master for p in parts),
            "gradients": nbytes(p.host_grad for p in parts),
            "moments": sum(
                p.compact.nbytes() if p.compact else nbytes([p.exp_avg, p.exp_avg_sq])
                for p in parts
            ),
            "param_copy_out": nbytes(self._copy_out.buffers if self._copy_out else []),
            "accumulation": nbytes([self.grad_partitions_flat_buffer]),
            "grad_slots": nbytes(self._grad_slots.buffers if self._grad_slots else []),
        }

    def _step_value(self, step: int):
        """A step count in the base optimizer's own format (DeepSpeed's CPU Adam, and
        HostAdamState in its place: an int; torch's optimizers: a float tensor)."""
        if type(self.optimizer).__name__ in ("DeepSpeedCPUAdam", "HostAdamState"):
            return step
        return torch.tensor(float(step))
