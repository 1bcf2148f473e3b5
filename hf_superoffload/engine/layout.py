"""Where the standalone optimizer's state lives: its params planned into buckets in gradient
arrival order, the tail of them chosen for the device, the host memory checked before anything
is allocated, then each bucket's buffers made (the params re-pointed into them).
"""

from __future__ import annotations

import dataclasses

import torch

from .bucket import Bucket, host_grad_dtype
from .buckets import BucketPlan, plan_buckets
from .cast_policy import CastPlan
from .compact_moments import blocks_of
from .copy_out import CopyOutRing
from .grad_slots import GradSlots
from .host_memory import STANDALONE_REMEDIES, check_host_memory, standalone_host_parts
from .link import Link
from .placement import choose_device_buckets
from .replicas import Replicas


@dataclasses.dataclass(frozen=True)
class Layout:
    buckets: list[Bucket]  # in gradient arrival order; the last ``gpu_tail_buckets`` on the device
    slot: dict[int, tuple[Bucket, int]]  # id(param) -> its bucket and its index there
    copy_out: CopyOutRing | None  # where the kernel writes rounded params (see copy_out.py)
    # Compact moments: where the next gradients land while a bucket's deferred update keeps
    # its gradient buffer (grad_slots.py); None otherwise.
    grad_slots: GradSlots | None


def lay_out(
    param_groups: list[dict],
    model: torch.nn.Module | None,
    *,
    bucket_size: int,
    gpu_tail: int | str,
    cap_bytes: int | None,
    accumulating: bool,
    link: Link,
    replicas: Replicas,
    cast: CastPlan,
    dtype: torch.dtype,
    compact: bool = False,
) -> Layout:
    """Plan, place, check and allocate (see the module docstring). With replicas every rank
    keeps the same number of tail buckets (the smallest any rank chose). With ``compact`` the
    moments are compact (compact_moments.py), each param salted with its place among all the
    groups' params."""
    order = {id(p): i for i, p in enumerate(model.parameters())} if model is not None else None
    plans = plan_buckets(param_groups, bucket_size, order)
    chosen = choose_device_buckets(gpu_tail, plans, link.device, cap_bytes, compact)
    first_device = len(plans) - int(replicas.agree(chosen, "min"))
    host_plans = host_held_plans(plans, first_device, gpu_tail, link.is_cuda)
    host_numel = sum(p.numel for p in host_plans)
    blocks = sum(blocks_of(q.numel()) for p in host_plans for q in p.params) if compact else None
    largest = max(p.numel for p in plans)
    parts = standalone_host_parts(host_numel, dtype, cast, accumulating, blocks, largest)
    claim = check_host_memory(parts, STANDALONE_REMEDIES)  # before allocating, not OOM-killed
    salt = {id(p): i for i, p in enumerate(p for g in param_groups for p in g["params"])}
    salts = {plan.index: [salt[id(p)] for p in plan.params] if compact else None for plan in plans}
    # Declared accumulation: the check above counted the gradient sums of these buckets.
    counted = {p.index for p in host_plans} if accumulating else set()
    buckets = [
        Bucket(p, link, p.index >= first_device, cast, salts[p.index], p.index in counted)
        for p in plans
    ]
    slot = {id(p): (bucket, i) for bucket in buckets for i, p in enumerate(bucket.plan.params)}
    # Of the largest bucket, host or device ("auto" moves them): what standalone_host_parts counts.
    grad_slots = GradSlots(link, largest, host_grad_dtype(dtype, cast)) if compact else None
    ring = _copy_out_ring(link, plans, dtype, cast, compact)
    # Claimed while the objects holding each part live (host_memory.HostClaim).
    claim.take("param_copy_out").held_by(ring)
    claim.take("grad_slots").held_by(grad_slots)
    claim.held_by(*buckets)
    return Layout(buckets, slot, ring, grad_slots)


def host_held_plans(
    plans: list[BucketPlan], first_device: int, gpu_tail: int | str, is_cuda: bool
) -> list[BucketPlan]:
    """The buckets whose state the host may hold, which the host check counts: those placed
    there; on a GPU with ``gpu_tail="auto"`` every one, since it may give any tail bucket back
    (measured as fast, over gpu_tail_cap, or after an out-of-memory error)."""
    if not is_cuda or gpu_tail == "auto":
        return plans
    return [p for p in plans if p.index < first_device]


def _copy_out_ring(
    link: Link, plans: list[BucketPlan], dtype: torch.dtype, cast: CastPlan, compact: bool
) -> CopyOutRing | None:
    """One small ring for all buckets when params cross in the model dtype (any bucket may be
    on the host: "auto" moves them); with compact moments always (``copy_out_dtype``)."""
    ring_dtype = copy_out_dtype(dtype, cast.params_on_device, compact)
    if ring_dtype is None:
        return None
    return CopyOutRing(link, max(p.numel for p in plans), ring_dtype)  # standalone_host_parts


def copy_out_dtype(dtype: torch.dtype, params_on_device: bool, compact: bool) -> torch.dtype | None:
    """The copy-out ring's dtype (None: no ring), for model params of ``dtype``. Compact
    moments always write their updates into the ring (a speculative pass leaves the master as
    it was), in the model's dtype: the kernel rounds to nearest even, as the device's cast of
    the fp32 master would, and half the bytes cross."""
    if compact:
        return dtype
    if dtype == torch.float32 or params_on_device:
        return None
    return dtype
