"""The device <-> host link: CUDA side streams and events, or their CPU stand-ins.

With a GPU, gradients leave on a D2H stream and params return on an H2D stream, into and
from page-locked host buffers (``host_memory``). With no GPU the model lives on the CPU and
every "transfer" is a synchronous copy on the calling thread, so the same engine logic (and
CI) runs unchanged.
"""

from __future__ import annotations

import contextlib

import torch

from .host_memory import PinnedBuffers


class Link:
    def __init__(self, device: torch.device, pinned: bool = True):
        self.device = device
        self.is_cuda = device.type == "cuda"
        if self.is_cuda:
            self.d2h_stream = torch.cuda.Stream(device)
            self.h2d_stream = torch.cuda.Stream(device)
        # pinned=False (a user's choice): pageable buffers, so every copy blocks its caller.
        self._pinned = PinnedBuffers() if self.is_cuda and pinned else None

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer for transfers: page-locked when a GPU is on the other side."""
        if self._pinned is None:
            return torch.empty(numel, dtype=dtype)
        return self._pinned.empty(numel, dtype)

    def release(self, *buffers: torch.Tensor | None) -> None:
        """Done with these ``host_empty`` buffers (None entries are skipped): unpin them once
        no queued copy can still touch them."""
        if self._pinned is None:
            return
        torch.cuda.synchronize(self.device)
        for buffer in buffers:
            self._pinned.release(buffer)

    def close(self) -> None:
        """Unpin every host buffer; the link is not used afterwards."""
        if self._pinned is not None:
            try:
                torch.cuda.synchronize(self.device)
            finally:  # unpin even after a CUDA error: pinned memory must not leak
                self._pinned.release_all()

    @property
    def pinned_bytes(self) -> int:
        return self._pinned.nbytes if self._pinned is not None else 0

    def d2h(self):
        return torch.cuda.stream(self.d2h_stream) if self.is_cuda else contextlib.nullcontext()

    def h2d(self):
        return torch.cuda.stream(self.h2d_stream) if self.is_cuda else contextlib.nullcontext()

    def record(self) -> torch.cuda.Event | None:
        """An event on the current stream (None on CPU, where work is already done)."""
        if not self.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def d2h_waits_for_compute(self) -> None:
        """Order the D2H stream after everything queued so far on the compute stream."""
        if self.is_cuda:
            self.d2h_stream.wait_stream(torch.cuda.current_stream(self.device))

    def compute_waits_for(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    @staticmethod
    def host_waits_for(event: torch.cuda.Event | None) -> None:
        if event is not None:
            event.synchronize()  # releases the GIL while it waits

    def keep_alive_on_d2h(self, tensor: torch.Tensor) -> None:
        """Tell the caching allocator the D2H stream still reads ``tensor``."""
        if self.is_cuda:
            tensor.record_stream(self.d2h_stream)
