"""Refuse, before DeepSpeed allocates it, a ZeRO-3 optimizer state this host cannot hold.

Each rank holds its partition of the trainable params (``1 / data-parallel ranks`` of them) and,
for the sub groups ``ratio`` offloads, the host state ``optimizer.py`` describes: fp32 master
(4 B/param), both moments (8), the gradient buffer in DeepSpeed's accumulation dtype,
DeepSpeed's accumulation buffer when micro-batches accumulate, and the copy-out ring where the
run's cast makes one (``host_parts.copy_out_ring_dtype``, the optimizer's own rule). Which sub
groups those are comes from ``sub_group_cut``, the rule the optimizer cuts by, applied to the
same inputs: the base optimizer's param groups, DeepSpeed's persistence thresholds,
``sub_group_size`` and the rank's partition. DeepSpeed's own fp32 gradient buffers are never
made (``host_state.py``). Two moments hold more than training: while the optimizer is built
DeepSpeed holds the fp32 masters of the whole partition and its accumulation buffer, before
the GPU tail's masters move and that buffer goes (below a ``ratio`` of about 0.4 that is the
peak); and a resume loads a checkpoint beside the live state (``memory_plan
.resume_extra_host_bytes``). The check counts the larger of the two beyond training's, so a
run that trains here can also resume here. Params that ``offload_param`` keeps on the host
were partitioned before the optimizer is built and are no longer in the available memory.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..engine.copy_out import copy_out_bytes
from ..engine.host_memory import check_host_memory
from ..engine.replicas import Replicas
from .host_parts import (
    copy_out_ring_dtype,
    micro_batches_accumulate,
    optimizer_host_parts,
    resume_extra_host_bytes,
    start_up_host_bytes,
)
from .sub_group_cut import (
    DEEPSPEED_PERSISTENCE_THRESHOLD,
    NO_MODEL_PERSISTENCE_LIMIT,
    Param,
    SubGroupSplit,
    persistent_params,
    split_sub_groups,
    sub_group_blocks,
    sub_group_numels,
)

REMEDIES = (
    "Use fewer GPUs per host (or more hosts: the state is partitioned over all ranks), keep "
    'part of the optimizer state on the GPU ("ratio" below 1 in "offload_optimizer"), drop '
    '"offload_param" if it is set (it puts the 16-bit params on the host too), train a '
    "smaller model, or free host memory. The count leaves room for a resume "
    "(resume_beyond_training: DeepSpeed loads a checkpoint's optimizer state beside the live "
    "state), so that a run that trains here can resume here."
)


def zero3_sub_groups(init_optimizer, kwargs: dict, compact: bool = False) -> SubGroupSplit:
    """The sub groups the optimizer DeepSpeed is about to build (its constructor's
    ``kwargs``) will have, and ``ratio``'s cut of them. Params not yet partitioned count
    whole (``ds_numel`` is set once they are). Persistence is DeepSpeed's mark where
    ``zero.Init`` set it, else its rule, applied in the optimizer's param order (DeepSpeed
    counts ``stage3_model_persistence_threshold`` in the module's: the same unless that limit
    is set)."""
    groups = [
        [p for p in group["params"] if p.requires_grad and _numel(p) > 0]
        for group in init_optimizer.param_groups
    ]
    every = [p for group in groups for p in group]
    marks = persistent_params(
        [_numel(p) for p in every],
        kwargs.get("param_persistence_threshold", DEEPSPEED_PERSISTENCE_THRESHOLD),
        kwargs.get("model_persistence_threshold", NO_MODEL_PERSISTENCE_LIMIT),
    )
    persists = {
        id(p): bool(getattr(p, "ds_persist", False)) or mark
        for p, mark in zip(every, marks, strict=True)
    }
    group = kwargs.get("dp_process_group")
    ranks = dist.get_world_size(group=group) if dist.is_initialized() else 1
    cut = (
        [[Param(_numel(p), persists[id(p)]) for p in params] for params in groups],
        ranks,
        kwargs.get("sub_group_size", 0),  # as the optimizer runs it (options.resolve_sizes)
    )
    blocks = sub_group_blocks(*cut) if compact else ()
    return split_sub_groups(sub_group_numels(*cut), kwargs.get("offload_ratio", 1.0), blocks)


def _numel(param) -> int:
    return getattr(param, "ds_numel", param.numel())


def zero3_host_parts(
    init_optimizer,
    kwargs: dict,
    compact: bool = False,
    ds_config: dict | None = None,
    cast: str | None = None,
    device_type: str = "cuda",
) -> dict[str, int]:
    """Host bytes per rank of the optimizer DeepSpeed is about to build, by what holds them:
    training's parts, and what start-up or a resume holds beyond them (the larger);
    ``compact``: its moments are compact; ``cast`` on a ``device_type`` device: whether the
    copy-out ring is made (None: counted, the most any cast makes)."""
    split = zero3_sub_groups(init_optimizer, kwargs, compact)
    params = [p for g in init_optimizer.param_groups for p in g["params"] if p.requires_grad]
    grad = kwargs.get("gradient_accumulation_dtype", torch.float32).itemsize
    model_dtype = params[0].dtype if params else torch.float32
    ring = copy_out_ring_dtype(model_dtype, cast, device_type, compact)
    copy_out = copy_out_bytes(split.largest_host_sub_group, ring)
    accumulating = micro_batches_accumulate(kwargs, ds_config or {})
    parts = optimizer_host_parts(
        split.partition, split.host_numel, grad, copy_out, accumulating,
        split.host_blocks if compact else None, split.largest_host_sub_group,
    )  # fmt: skip
    start_up = start_up_host_bytes(split.partition, grad, accumulating) - sum(parts.values())
    resume = resume_extra_host_bytes(split, compact)
    parts["start_up_beyond_training"] = start_up if start_up > max(resume, 0) else 0
    parts["resume_beyond_training"] = resume if resume >= start_up else 0
    return parts


def check_zero3_host_memory(
    init_optimizer,
    kwargs: dict,
    replicas: Replicas,
    compact: bool,
    ds_config: dict,
    cast: str,
    device_type: str,
) -> None:
    """Refuse this rank's host state if the host cannot hold it for all of its ranks, then
    wait for the other ranks' checks: each measures the available memory before any of them
    allocates (else a late rank would count an early one's buffers twice), and a rank that
    refused ends the others' wait at once, with its error (the optimizer's ``replicas``, whose
    failure watch also ends an NCCL wait). ``cast`` (the run's) on a ``device_type`` device
    says, as it does to the optimizer, whether the copy-out ring is made. What it grants stays
    claimed while ``replicas`` lives (the optimizer's own, made for it, as the state is), but
    for start-up's extra, gone once DeepSpeed has built the optimizer: no check runs before."""
    parts = zero3_host_parts(init_optimizer, kwargs, compact, ds_config, cast, device_type)
    claim = check_host_memory(parts, REMEDIES)
    claim.take("start_up_beyond_training")  # dropped at once
    claim.held_by(replicas)
    replicas.agree(0.0, "max")
