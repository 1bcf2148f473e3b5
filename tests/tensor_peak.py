"""The peak bytes of tensors that torch ops create inside a block, on any device: a dispatch
mode that counts each new storage until its last tensor is freed. Used where the CUDA
allocator's own peak is not there to ask (the CPU tier)."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class TensorPeak(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self._bytes: dict[int, int] = {}  # storage address -> its bytes
        self._tensors: dict[int, int] = {}  # storage address -> tensors alive on it
        self.live = 0
        self.peak = 0

    def _release(self, address: int) -> None:
        self._tensors[address] -= 1
        if self._tensors[address] == 0:
            del self._tensors[address]
            self.live -= self._bytes.pop(address)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (list, tuple)) else (out,):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            address = storage.data_ptr()
            if address in self._tensors:
                self._tensors[address] += 1
            elif address in _storages(args, kwargs):
                continue  # an input's storage (in place, a view): nothing new
            else:
                self._tensors[address] = 1
                self._bytes[address] = storage.nbytes()
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
            weakref.finalize(tensor, self._release, address)
        return out


def _storages(args, kwargs) -> set[int]:
    leaves = torch.utils._pytree.tree_leaves((args, kwargs or {}))
    return {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}


def temporaries_of(call, cuda: bool) -> int:
    """The peak bytes of the tensors ``call()`` creates: the CUDA allocator's peak above what
    was allocated before it, or, on the CPU, ``TensorPeak``'s count."""
    if not cuda:
        with TensorPeak() as peak:
            call()
        return peak.peak
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    call()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start
