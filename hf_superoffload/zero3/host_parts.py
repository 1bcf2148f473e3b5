"""The optimizer's host bytes per rank on the ZeRO-3 path, part by part: the figures the
memory plan (memory_plan.py) and the start-up host check (host_check.py) both count, so that
what is planned, what is checked and what the optimizer allocates are one number."""

from __future__ import annotations

import torch

from ..engine.cast_policy import decide_cast
from ..engine.compact_moments import compact_moment_bytes
from ..engine.copy_out import CopyOutRing
from ..engine.grad_slots import grad_slots_bytes
from ..engine.layout import copy_out_dtype
from ..engine.link import Link
from . import checkpoint_memory
from .sub_group_cut import SubGroupSplit


def copy_out_ring_dtype(
    model_dtype: torch.dtype, cast: str | None, device_type: str, compact: bool
) -> torch.dtype | None:
    """The dtype of the copy-out ring (engine/copy_out.py) the optimizer makes for the rounded
    params going back to the model, None where it makes none: the one rule the plan, the
    start-up host check and the optimizer take it from. There is one where params are cast on
    the host (``cast`` "cpu", or "auto" without a GPU: ``decide_cast``, which measures
    nothing, so a plan knows it as well as the optimizer), and with compact moments.
    ``cast`` None: not known (a plan made from the model's config alone): the ring of a cast
    on the host, the most any cast makes (COPY_OUT_SLOTS x COPY_OUT_PIECE elements: 96 MiB in
    bf16)."""
    on_device = cast is not None and decide_cast(cast, device_type, model_dtype).params_on_device
    return copy_out_dtype(model_dtype, on_device, compact)


def copy_out_ring(
    link: Link, host_numels: list[int], ring_dtype: torch.dtype | None
) -> CopyOutRing | None:
    """The optimizer's ring for host sub groups of ``host_numels`` elements (none without
    any, or without ``ring_dtype``), as ``engine.copy_out.copy_out_bytes`` counts it."""
    if ring_dtype is None or not host_numels:
        return None
    return CopyOutRing(link, max(host_numels), ring_dtype)


def optimizer_host_parts(
    partition: int,
    on_host: int,
    grad_bytes: int,
    copy_out: int,
    accumulating: bool,
    compact_blocks: int | None = None,
    largest_host_sub_group: int = 0,
) -> dict[str, int]:
    """The optimizer's host bytes per rank while training, by what holds them (the names of
    ``SuperOffloadZero3Optimizer.host_bytes``): the plan's and the start-up check's.
    ``compact_blocks``: the moments are compact, in that many blocks, and the next gradients
    of a sub group whose update is deferred land in a few gradient slots of the largest host
    sub group (engine/grad_slots.py)."""
    compact = compact_blocks is not None
    moments = compact_moment_bytes(on_host, compact_blocks) if compact else 8 * on_host
    slots = grad_slots_bytes(largest_host_sub_group, grad_bytes) if compact and on_host else 0
    return {
        "master": 4 * on_host,
        "moments": moments,
        "gradients": grad_bytes * on_host,
        "param_copy_out": copy_out if on_host else 0,
        "accumulation": grad_bytes * partition if accumulating else 0,
        "grad_slots": slots,
    }


def micro_batches_accumulate(kwargs: dict, ds_config: dict) -> bool:
    """Whether gradients accumulate over micro-batches on the host (DeepSpeed's accumulation
    buffer is then made): ``gradient_accumulation_steps`` above 1, or a config whose
    ``managed_gradient_accumulation`` is false (the script accumulates by hand)."""
    managed = ds_config.get("managed_gradient_accumulation", True) is not False
    return kwargs.get("gradient_accumulation_steps", 1) > 1 or not managed


def start_up_host_bytes(partition: int, grad_bytes: int, accumulating: bool) -> int:
    """Held while the optimizer is built, before the GPU tail's masters move: DeepSpeed's fp32
    masters of the whole partition, and its accumulation buffer when micro-batches accumulate
    (host_state.py leaves it out otherwise)."""
    return (4 + (grad_bytes if accumulating else 0)) * partition


def resume_extra_host_bytes(split: SubGroupSplit, compact: bool = False) -> int:
    """Host bytes per rank that loading a checkpoint into the built optimizer holds beyond
    training's (``split``: the rank's sub groups): the optimizer file is mapped from disk and
    copied into the live state a sub group at a time, so about two saved sub groups' masters and
    moments at once (``checkpoint_memory.resume_extra_host_bytes`` says why). The one place the
    plan and the host check take this figure from."""
    per_param = (
        checkpoint_memory.COMPACT_SAVED_BYTES_PER_PARAM
        if compact
        else checkpoint_memory.SAVED_BYTES_PER_PARAM
    )
    return checkpoint_memory.resume_extra_host_bytes(
        split.partition, split.largest_sub_group, saved_bytes_per_param=per_param
    )
