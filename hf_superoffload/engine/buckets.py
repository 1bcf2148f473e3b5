"""Groups parameters into buckets in the order their gradients arrive in backward.

Backward produces gradients roughly in reverse registration order (last layer first), so a
bucket is a run of consecutive parameters of one param group, walked from the end of the
model. The last buckets to receive gradients hold the first layers: those are the tail that
may stay on the device.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class BucketPlan:
    index: int  # position in gradient-arrival order
    group_index: int
    params: list[torch.nn.Parameter]
    offsets: list[int]  # element offset of each param in the bucket's flat buffers
    numel: int


def plan_buckets(
    param_groups: list[dict],
    bucket_size: int,
    model_order: dict[int, int] | None = None,
) -> list[BucketPlan]:
    """Split each group into buckets of at most ``bucket_size`` elements (a bigger param gets
    a bucket of its own) and order all buckets by expected gradient arrival.

    ``model_order`` maps ``id(param)`` to its registration index in the model; without it the
    order of the params across the groups stands in for it.
    """
    if bucket_size < 1:
        raise ValueError(f"bucket_size must be a positive number of elements, got {bucket_size}.")
    rank: dict[int, int] = {}
    for group in param_groups:
        for param in group["params"]:
            rank.setdefault(id(param), len(rank))
    if model_order is not None:
        rank = {key: model_order.get(key, len(model_order) + value) for key, value in rank.items()}

    draft: list[tuple[int, int, list[torch.nn.Parameter]]] = []  # (latest rank, group, params)
    for group_index, group in enumerate(param_groups):
        params = [p for p in group["params"] if p.requires_grad]
        params.sort(key=lambda p: rank[id(p)], reverse=True)
        current: list[torch.nn.Parameter] = []
        size = 0
        for param in params:
            if current and size + param.numel() > bucket_size:
                draft.append((rank[id(current[0])], group_index, current))
                current, size = [], 0
            current.append(param)
            size += param.numel()
        if current:
            draft.append((rank[id(current[0])], group_index, current))

    draft.sort(key=lambda item: item[0], reverse=True)
    plans = []
    for index, (_, group_index, params) in enumerate(draft):
        offsets, total = [], 0
        for param in params:
            offsets.append(total)
            total += param.numel()
        plans.append(BucketPlan(index, group_index, params, offsets, total))
    return plans
