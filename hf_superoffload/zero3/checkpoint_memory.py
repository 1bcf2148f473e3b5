"""What resuming the ZeRO-3 path from a checkpoint costs in host memory, and what keeps it small.

A rank's optimizer file holds its fp32 masters and both Adam moments: 12 bytes per param of the
rank's partition. DeepSpeed reads it whole beside the live state, which already holds the same
12 bytes/param and the gradient buffers, so a run that fits the host while training may not fit
it while resuming. Ours maps the file (``checkpoint_hooks.read_optimizer_file``) and copies it
into the live state one sub group at a time (``checkpoint_load.py``), handing each sub group's
mapped pages back to the kernel once copied (``release_mapped_pages``): at any moment the process
holds the pages of the saved sub groups being copied, not the file.
"""

from __future__ import annotations

import ctypes
import math
import os

import torch

# Bytes per param of a rank's partition in its optimizer file: fp32 master, exp_avg, exp_avg_sq.
SAVED_BYTES_PER_PARAM = 12
# With compact moments: fp32 master, two codes, and two fp32 scales a block of 256 (at most).
COMPACT_SAVED_BYTES_PER_PARAM = 4 + 2 + 8 / 256
# Set on a rank's state dict that was read memory-mapped: its tensors' pages may be released.
MAPPED_KEY = "hf_superoffload_mapped"

_MADV_DONTNEED = 4  # <sys/mman.h> on Linux
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resume_extra_host_bytes(
    partition_numel: int,
    largest_sub_group_numel: int,
    mapped: bool = True,
    saved_bytes_per_param: float = SAVED_BYTES_PER_PARAM,
) -> int:
    """Host bytes a rank needs while resuming, beyond its live training state (what the
    optimizer already holds when ``load_checkpoint`` starts), for the memory plan.

    ``partition_numel``: the params of this rank's partition (all its sub groups).
    ``largest_sub_group_numel``: the largest sub group of the cut that saved the checkpoint
    (``sub_group_size`` or the largest single param partition above it; our own cut, for a run
    resuming its own checkpoint).
    ``mapped``: the file is in torch's zip format (DeepSpeed's default,
    ``"checkpoint_serialization": true``) and is read by our optimizer; False for a file in
    torch's legacy format, which is read whole.

    Mapped, a saved sub group's pages stay in the process until the sub groups cut from it are
    copied: one sub group when the checkpoint was cut as the live optimizer is, at most two
    (one straddling the next) when it crosses from DeepSpeed's cut; the bound below is the
    latter. The page cache that reading the file leaves is the kernel's to drop, not counted.
    ``saved_bytes_per_param``: 12 (fp32 master and moments), or ``COMPACT_SAVED_BYTES_PER_PARAM``.
    """
    if not mapped:
        return math.ceil(saved_bytes_per_param * partition_numel)
    return math.ceil(saved_bytes_per_param * min(partition_numel, 2 * largest_sub_group_numel))


def release_mapped_pages(tensor: torch.Tensor) -> None:
    """Hand the whole pages of a memory-mapped (read-only, never written) tensor back to the
    kernel: the process's memory drops by them, and a later read would fetch them from the file
    again. Only for tensors of a state dict marked ``MAPPED_KEY``: on ordinary memory this
    would discard data."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = math.ceil(start / _PAGE) * _PAGE, (end // _PAGE) * _PAGE
    if last > first:
        _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)


def _libc():
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _LIBC


_LIBC = None
