"""A checkpoint's ``optimizer.pt`` as SuperOffloadTrainer reads it: mapped (the state pages in
as it is copied, no second host copy), with empty param groups laid out as the optimizer has
them, and each param's fp32 master found by its place in the param groups, as
``load_state_dict`` finds it. Resuming (save.load_optimizer_state) and restoring the best
checkpoint's masters (best_model.restore_best_masters) both read it so.
"""

from __future__ import annotations

import torch

from ..engine import SuperOffloadOptimizer
from ..engine.state_checks import check_group_sizes


def read_optimizer_state(optimizer: SuperOffloadOptimizer, path: str) -> dict:
    """The optimizer state dict saved at ``path``, mapped, and ``with_empty_groups_of``
    ``optimizer``."""
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return with_empty_groups_of(optimizer, state)


def masters_in_state(
    optimizer: SuperOffloadOptimizer, state: dict
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Each param ``optimizer`` steps, in its order, with the fp32 master ``state`` holds for
    it: the entry under the param's key in the saved group at its place, or None where that
    entry holds no master (torch's layout: a plain Trainer's checkpoint) or there is no entry.
    Param groups of other sizes are refused first (``check_group_sizes``)."""
    check_group_sizes(optimizer.param_groups, state["param_groups"])
    entries = state["state"]
    return [
        (param, entries.get(key, {}).get("master"))
        for group, saved in zip(optimizer.param_groups, state["param_groups"], strict=True)
        for param, key in zip(group["params"], saved["params"], strict=True)
        if optimizer.manages(param)
    ]


def with_empty_groups_of(optimizer, state_dict: dict) -> dict:
    """``state_dict`` with the empty param groups laid out as ``optimizer`` has them. The
    Trainer builds [decay, no-decay] groups and keeps one that is empty (a model whose no-decay
    params are all frozen); checkpoints written before this trainer kept it too lack it. Empty
    groups hold no state, so only their place changes; any other difference is left for
    ``load_state_dict`` to refuse."""
    ours = optimizer.param_groups
    theirs = state_dict.get("param_groups")
    if not isinstance(theirs, list) or len(theirs) == len(ours):
        return state_dict
    filled = [group for group in theirs if group.get("params")]
    if len(filled) != sum(1 for group in ours if group["params"]):
        return state_dict
    remaining = iter(filled)
    groups = [
        next(remaining) if group["params"] else {**_hypers(group), "params": []} for group in ours
    ]
    return {**state_dict, "param_groups": groups}


def _hypers(group: dict) -> dict:
    return {key: value for key, value in group.items() if key != "params"}
