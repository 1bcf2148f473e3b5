"""Data parallelism by replicas: every rank of a torch.distributed group holds the whole
optimizer state, averages each bucket's gradients with the others before using them, and so
takes bit-identical steps (the same reduced gradients, the same deterministic kernels, the
same verdicts), with no parameter traffic after the first broadcast.

Collectives must be issued in the same order on every rank. Buckets are averaged as they
launch, and under replicas they launch in bucket order (the optimizer holds back a bucket that
completes before an earlier one); decisions taken from local measurements (the cast plan, how
many buckets ``auto`` moves to the GPU) are agreed on first, so all ranks keep the same
placement, and with it the same arithmetic for every bucket.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Replicas:
    """A world of one (no collectives at all) when torch.distributed is not initialised or
    the group has one rank."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device):
        initialised = dist.is_available() and dist.is_initialized()
        self.group = group if group is not None else (dist.group.WORLD if initialised else None)
        self.size = dist.get_world_size(self.group) if self.group is not None else 1
        if self.size == 1:
            self.group = None
            return
        # NCCL reduces CUDA tensors only (on the model's GPU); gloo takes CPU tensors.
        nccl = dist.get_backend(self.group) == "nccl"
        self._scalar_device = device if nccl else torch.device("cpu")
        self._source = dist.get_global_rank(self.group, 0)

    @property
    def distributed(self) -> bool:
        return self.group is not None

    def broadcast_(self, tensors: list[torch.Tensor]) -> None:
        """Make every rank start from rank 0's values (as DDP does at construction)."""
        if self.distributed:
            for tensor in tensors:
                dist.broadcast(tensor, src=self._source, group=self.group)

    def average_(self, tensor: torch.Tensor) -> None:
        """In place: the mean over ranks (sum, then divide: not every backend has AVG). 16-bit
        gradients are summed in fp32, one rounding at the end instead of one per addition."""
        if not self.distributed:
            return
        wide = tensor.float() if tensor.dtype != torch.float32 else tensor
        dist.all_reduce(wide, op=dist.ReduceOp.SUM, group=self.group)
        wide.div_(self.size)
        if wide is not tensor:
            tensor.copy_(wide)

    def agree(self, value: float, op: str) -> float:
        """The ``op`` ("min" or "max") of a local decision over all ranks."""
        if not self.distributed:
            return value
        reduce_op = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]
        holder = torch.tensor([float(value)], dtype=torch.float64, device=self._scalar_device)
        dist.all_reduce(holder, op=reduce_op, group=self.group)
        return holder.item()

    def any_(self, flags: list[bool]) -> list[bool]:
        """Each flag set on any rank."""
        return [bool(v) for v in self.maxima([int(f) for f in flags])]

    def maxima(self, counts: list[int]) -> list[int]:
        """Each count's maximum over all ranks."""
        if not self.distributed:
            return counts
        holder = torch.tensor(counts, dtype=torch.int64, device=self._scalar_device)
        dist.all_reduce(holder, op=dist.ReduceOp.MAX, group=self.group)
        return [int(v) for v in holder.tolist()]

    def from_rank0(self, values: list[float]) -> list[float]:
        """Rank 0's ``values`` on every rank (a decision measured locally, taken once)."""
        if not self.distributed:
            return values
        holder = torch.tensor(values, dtype=torch.float64, device=self._scalar_device)
        dist.broadcast(holder, src=self._source, group=self.group)
        return holder.tolist()
