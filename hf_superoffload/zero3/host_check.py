"""Refuse, before DeepSpeed allocates it, a ZeRO-3 optimizer state this host cannot hold.

Each rank holds its partition of the trainable params (``1 / data-parallel ranks`` of them) and,
for the share ``ratio`` offloads, the host state ``optimizer.py`` describes: fp32 master (4
B/param), both moments (8), the gradient buffer in DeepSpeed's accumulation dtype, DeepSpeed's
accumulation buffer when micro-batches accumulate, and the copy-out ring. DeepSpeed's own fp32
gradient buffers are never made (``host_state.py``). While the optimizer is built DeepSpeed
holds the fp32 masters of the whole partition and its accumulation buffer, before the GPU
tail's masters move and that buffer goes: below a ``ratio`` of about 0.4 that start-up is the
peak, and the check counts what it holds beyond training's. Params that ``offload_param``
keeps on the host were partitioned before the optimizer is built and are no longer in the
available memory.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..engine.host_memory import check_host_memory
from ..engine.replicas import Replicas
from .memory_plan import copy_out_bytes, optimizer_host_parts, start_up_host_bytes

REMEDIES = (
    "Use fewer GPUs per host (or more hosts: the state is partitioned over all ranks), keep "
    'part of the optimizer state on the GPU ("ratio" below 1 in "offload_optimizer"), drop '
    '"offload_param" if it is set (it puts the 16-bit params on the host too), train a '
    "smaller model, or free host memory."
)


def zero3_host_parts(init_optimizer, kwargs: dict) -> dict[str, int]:
    """Host bytes per rank of the optimizer DeepSpeed is about to build (its constructor's
    ``kwargs``). Params not yet partitioned count whole (``ds_numel`` is set once they are)."""
    params = [p for g in init_optimizer.param_groups for p in g["params"] if p.requires_grad]
    numel = sum(getattr(p, "ds_numel", p.numel()) for p in params)
    largest = max((getattr(p, "ds_numel", p.numel()) for p in params), default=0)
    group = kwargs.get("dp_process_group")
    ranks = dist.get_world_size(group=group) if dist.is_initialized() else 1
    partition = math.ceil(numel / ranks)
    ratio = getattr(kwargs.get("offload_optimizer_config"), "ratio", 1.0)
    on_host = int(partition * ratio)
    grad = kwargs.get("gradient_accumulation_dtype", torch.float32).itemsize
    low = params[0].dtype.itemsize if params and params[0].dtype != torch.float32 else 0
    copy_out = copy_out_bytes(kwargs.get("sub_group_size", 0), largest, ranks, low)
    accumulating = kwargs.get("gradient_accumulation_steps", 1) > 1
    parts = optimizer_host_parts(partition, on_host, grad, copy_out, accumulating)
    start_up = start_up_host_bytes(partition, grad)
    parts["start_up_beyond_training"] = max(0, start_up - sum(parts.values()))
    return parts


def check_zero3_host_memory(init_optimizer, kwargs: dict, replicas: Replicas) -> None:
    """Refuse this rank's host state if the host cannot hold it for all of its ranks, then
    wait for the other ranks' checks: each measures the available memory before any of them
    allocates (else a late rank would count an early one's buffers twice), and a rank that
    refused ends the others' wait at once, with its error (the optimizer's ``replicas``, whose
    failure watch also ends an NCCL wait)."""
    check_host_memory(zero3_host_parts(init_optimizer, kwargs), REMEDIES)
    replicas.agree(0.0, "max")
