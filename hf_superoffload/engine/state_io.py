"""SuperOffloadOptimizer's checkpoint format: ``state_dict`` and ``load_state_dict``.

The layout is torch's (``{"state": {index: ...}, "param_groups": [...]}``, params numbered
across the groups in order); each entry holds the param's fp32 ``master`` besides AdamW's
``exp_avg``, ``exp_avg_sq`` and ``step``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .optimizer import SuperOffloadOptimizer


def param_state(opt: SuperOffloadOptimizer, param: torch.nn.Parameter) -> dict:
    """Copies of ``param``'s master, moments and step (the caller has synchronized)."""
    bucket, i = opt._slot[id(param)]
    return {
        "master": bucket.views(bucket.master, i).detach().cpu().clone(),
        "exp_avg": bucket.views(bucket.exp_avg, i).cpu().clone(),
        "exp_avg_sq": bucket.views(bucket.exp_avg_sq, i).cpu().clone(),
        "step": bucket.param_step(i),
    }


def state_dict(opt: SuperOffloadOptimizer) -> dict:
    opt.synchronize()
    state, groups, index = {}, [], 0
    for group in opt.param_groups:
        ids = []
        for param in group["params"]:
            if id(param) in opt._slot:
                state[index] = param_state(opt, param)
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}


@torch.no_grad()
def load_state_dict(opt: SuperOffloadOptimizer, state_dict: dict) -> None:
    opt.synchronize()
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(
            f"state_dict has {len(saved_groups)} param groups, this optimizer has "
            f"{len(opt.param_groups)}; build the optimizer with the same groups."
        )
    params = [p for g in opt.param_groups for p in g["params"]]
    for group, saved in zip(opt.param_groups, saved_groups, strict=True):
        if len(group["params"]) != len(saved["params"]):
            raise ValueError("state_dict's param groups differ in size from this optimizer's.")
        group.update({k: v for k, v in saved.items() if k != "params"})
    for index, entry in state_dict["state"].items():
        param = params[int(index)]
        bucket, i = opt._slot[id(param)]
        if tuple(entry["master"].shape) != tuple(param.shape):
            raise ValueError(
                f"state_dict entry {index} has shape {tuple(entry['master'].shape)}, "
                f"param has {tuple(param.shape)}; load into the same model."
            )
        bucket.views(bucket.master, i).copy_(entry["master"])
        bucket.views(bucket.exp_avg, i).copy_(entry["exp_avg"])
        bucket.views(bucket.exp_avg_sq, i).copy_(entry["exp_avg_sq"])
        bucket.set_param_step(i, int(entry["step"]))
    for bucket in opt._buckets:
        bucket.flat_param.copy_(bucket.master)
        if bucket.on_device:
            opt._tail.set_step(bucket)
