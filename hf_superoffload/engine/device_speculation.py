"""Compact moments' speculative pass on the GPU, for host partitions whose params live there.

A speculative pass over compact moments writes no host state, only the rounded params the
model gets (compact_passes.py); the validated update goes into master and moments in a second
pass, during the next forward (deferred_commits.py). On the CPU both passes decode the codes
and take a square root and a division per element, so the CPU Adam did about 1.5x the exact
path's work a step (3.37B params, 15 threads of an H100 host: 0.57 s speculating plus 0.66 s
writing, against 0.77-0.91 s for the exact path's one pass), all of it beside the GPU's
forward and backward. With the params on a GPU the speculative pass runs there instead: each
piece's master, gradients, codes and block scales are copied into one device buffer on the
link's H2D stream and the Triton kernel (ops/compact_triton.py, the CPU kernel's results bit
for bit) writes the params in place. The CPU is left the writes. Per element 8 B cross the
link (fp32 master, both codes, bf16 gradients) where the CPU pass sent 2 (the rounded param).

Copies and kernels queue on the one H2D stream, so the buffer is refilled only after the
kernel that read it; the partition's ``last_h2d`` event, recorded after its last kernel, keeps
the host buffers from being written while a copy still reads them, as for a copy-out.
"""

from __future__ import annotations

import torch

from ..ops.compact_format import BLOCK
from .compact_moments import blocks_of
from .link import Link

# Elements a staged piece holds (a multiple of BLOCK): 128 MiB of staging with bf16 gradients.
DEVICE_SPECULATION_PIECE = 1 << 24


def staging_buffers(
    largest_partition: int, grad_dtype: torch.dtype, device
) -> dict[str, torch.Tensor]:
    """The buffers one staged piece is copied into, in the order ``compact_adam_pass_cuda``
    takes them; made here for the GPU, and on the meta device by the memory plan."""
    piece = min(largest_partition, DEVICE_SPECULATION_PIECE)
    blocks = blocks_of(piece)
    return {
        "master": torch.empty(piece, dtype=torch.float32, device=device),
        "grad": torch.empty(piece, dtype=grad_dtype, device=device),
        "exp_avg": torch.empty(piece, dtype=torch.uint8, device=device),
        "exp_avg_scale": torch.empty(blocks, dtype=torch.float32, device=device),
        "exp_avg_sq": torch.empty(piece, dtype=torch.uint8, device=device),
        "exp_avg_sq_scale": torch.empty(blocks, dtype=torch.float32, device=device),
    }


def device_speculation_bytes(largest_partition: int, grad_dtype: torch.dtype) -> int:
    """GPU bytes ``DeviceSpeculation`` allocates for host partitions of at most
    ``largest_partition`` elements: what the memory plan counts for it."""
    if largest_partition <= 0:
        return 0
    buffers = staging_buffers(largest_partition, grad_dtype, "meta")
    return sum(t.numel() * t.element_size() for t in buffers.values())


class DeviceSpeculation:
    """Used from the worker thread only (one writer), so it needs no lock."""

    def __init__(self, link: Link, largest_partition: int, grad_dtype: torch.dtype):
        if not link.is_cuda:
            raise ValueError("the speculative pass runs on the GPU only with a CUDA link")
        from ..ops.compact_triton import require

        require()  # say now, not in the first backward, if the kernel cannot run
        self.link = link
        self._buffers = staging_buffers(largest_partition, grad_dtype, link.device)
        self.piece_numel = self._buffers["master"].numel()
        if self.piece_numel >= BLOCK and self.piece_numel % BLOCK:
            raise ValueError(f"staged pieces must be whole blocks, got {self.piece_numel}")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers.values())

    def serves(self, part) -> bool:
        """Whether ``part``'s speculative passes run here: compact moments, its params on the
        GPU, its gradients in the dtype staged."""
        return (
            part.compact is not None
            and part.flat_param.is_cuda
            and part.host_grad is not None
            and part.host_grad.dtype == self._buffers["grad"].dtype
        )

    def speculate(self, part, kwargs: dict, scale: float, runs, grad: torch.Tensor) -> int:
        """Update number ``step`` of each run (``kwargs``: the other hyperparameters) with
        gradient scale ``scale`` into ``part.flat_param``, from the host state; returns the
        bytes copied to the device."""
        from ..ops.compact_triton import compact_adam_pass_cuda

        moments, copied = part.compact, 0
        with torch.cuda.device(self.link.device), self.link.h2d():
            for piece in moments.run_pieces(runs, self.piece_numel):
                at, n, segment = piece.at, piece.numel, piece.segment
                sources = [part.master.narrow(0, at, n), grad.narrow(0, at, n)]
                sources += moments.piece_moments(segment, piece.start, n)
                staged = []
                for buffer, source in zip(self._buffers.values(), sources, strict=True):
                    target = buffer[: source.numel()]
                    target.copy_(source, non_blocking=True)
                    staged.append(target)
                    copied += source.numel() * source.element_size()
                compact_adam_pass_cuda(
                    *staged, step=piece.step, grad_scale=scale, salt=segment.salt,
                    element_offset=piece.start, commit=False,
                    out_lowp=part.flat_param.narrow(0, at, n), **kwargs,
                )  # fmt: skip
            # The next forward waits for it; the worker's next pass over the host state too.
            part.h2d_event = part.last_h2d = self.link.record()
        return copied
