"""A few page-locked buffers the CPU Adam writes its rounded params into, shared by all host
partitions, in place of one copy-out buffer per partition.

A partition's model-dtype copy of its updated params is needed only from the kernel's pass
until the host-to-device copy has read it: holding one per partition costs 2 B/param of host
memory for the whole run. The worker thread steps one partition at a time, so a ring of a few
buffers lets the kernel fill one while the link drains the others; a buffer is taken again
only after the copy that last read it has completed.
"""

from __future__ import annotations

import torch

from .link import Link

COPY_OUT_SLOTS = 3  # one being written, one in flight to the device, one spare
# Larger partitions (a 128k-token embedding is one 525M-element param) go through in pieces.
COPY_OUT_PIECE = 1 << 24


def copy_out_bytes(largest_partition: int, ring_dtype: torch.dtype | None) -> int:
    """Bytes of the ring ``CopyOutRing(link, largest_partition, ring_dtype)`` allocates (0
    without a ring): what the memory plans and host checks count for it."""
    if ring_dtype is None:
        return 0
    return COPY_OUT_SLOTS * min(largest_partition, COPY_OUT_PIECE) * ring_dtype.itemsize


class CopyOutRing:
    """Used from the worker thread only (one writer), so it needs no lock."""

    def __init__(
        self,
        link: Link,
        largest_partition: int,
        dtype: torch.dtype,
        slots: int = COPY_OUT_SLOTS,
        piece: int = COPY_OUT_PIECE,
    ):
        if slots < 2:
            raise ValueError(f"a copy-out ring needs at least 2 slots to overlap, got {slots}.")
        self.link = link
        self.piece_numel = min(largest_partition, piece)  # what one buffer holds
        self._buffers = [link.host_empty(self.piece_numel, dtype) for _ in range(slots)]
        self._read_by: list[torch.cuda.Event | None] = [None] * slots  # each slot's last copy
        self._next = 0
        self._taken: int | None = None

    @property
    def buffers(self) -> list[torch.Tensor]:
        return list(self._buffers)

    def take(self, numel: int) -> torch.Tensor:
        """The next buffer, once no copy still reads it; ``handed_to_link`` must follow."""
        if self._taken is not None:
            raise RuntimeError("CopyOutRing.take() twice without handed_to_link()")
        slot = self._next
        if numel > self._buffers[slot].numel():
            raise ValueError(
                f"a partition of {numel} elements does not fit the copy-out ring's "
                f"{self._buffers[slot].numel()}-element buffers"
            )
        self.link.host_waits_for(self._read_by[slot])
        self._taken, self._next = slot, (slot + 1) % len(self._buffers)
        return self._buffers[slot][:numel]

    def handed_to_link(self, copy_done: torch.cuda.Event | None) -> None:
        """The buffer last taken is being read by a copy that completes with ``copy_done``."""
        if self._taken is None:
            raise RuntimeError("CopyOutRing.handed_to_link() without take()")
        self._read_by[self._taken], self._taken = copy_done, None
