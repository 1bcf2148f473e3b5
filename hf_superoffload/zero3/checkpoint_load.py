"""Resume SuperOffloadZero3Optimizer from a rank's ZeRO-3 optimizer file, in place.

DeepSpeed's loader hands the whole file (fp32 masters and both moments: 12 B/param of the
rank's partition) to torch's ``Optimizer.load_state_dict``, which keeps the loaded tensors as
the new state; the live ones are dropped only afterwards. Here the file is memory-mapped
(``checkpoint_hooks.py``) and each sub group's master and moments are copied from the mapping
straight into the tensors the kernels update, so no second copy of the state is ever made.
The file may have been cut into sub groups by DeepSpeed's own rule (a run without
``super_offload``) or by ours: ``checkpoint_layout.py`` matches them param by param.
"""

from __future__ import annotations

import torch

from ..engine.state_checks import COMPACT_STATE_KEYS
from .checkpoint_layout import (
    BASE_OPTIMIZER_STATE,
    FP32_FLAT_GROUPS,
    MOMENTS,
    CheckpointLayoutError,
    Recut,
    live_layout,
    saved_layout,
)
from .checkpoint_memory import MAPPED_KEY, release_mapped_pages
from .param_steps import PARAM_STEPS_KEY

# Keys of a base optimizer's per-sub-group state this path restores (AdamW's, or compact).
STATE_KEYS = {"step", PARAM_STEPS_KEY, *MOMENTS, *COMPACT_STATE_KEYS}  # param_steps: param_steps.py


def restore_group_hyperparameters(live_groups: list[dict], saved_groups: list[dict]) -> None:
    """Each param group takes its own saved hyperparameters (lr, weight_decay, betas, ...)."""
    if len(saved_groups) != len(live_groups):
        raise CheckpointLayoutError(
            f"the checkpoint has {len(saved_groups)} param groups, this optimizer "
            f"{len(live_groups)}: resume with the param groups that saved it."
        )
    for live, saved in zip(live_groups, saved_groups, strict=True):
        live.update({k: v for k, v in saved.items() if k != "params"})


def saved_sub_group_states(saved: dict) -> list[dict]:
    """The base optimizer's state of each saved sub group, in sub group order ({} where the
    saved optimizer had not stepped yet)."""
    base = saved[BASE_OPTIMIZER_STATE]
    indices = sorted(i for group in base["param_groups"] for i in group["params"])
    states = [base["state"].get(i, {}) for i in indices]
    for state in states:
        unknown = set(state) - STATE_KEYS
        if unknown:
            raise CheckpointLayoutError(
                f"the checkpoint's optimizer state has {sorted(unknown)} besides AdamW's "
                f"{sorted(STATE_KEYS)}: it was saved with another optimizer."
            )
    if any(states) and not all(states):
        raise CheckpointLayoutError("the checkpoint has Adam state for some sub groups only.")
    return states


def agreed_step(states: list[dict], sources: set[int]) -> int:
    """The step count of the saved sub groups that fill one of ours: they must agree."""
    steps = {int(states[s]["step"]) for s in sources} if states[0] else {0}
    if len(steps) != 1:
        raise CheckpointLayoutError(
            f"the checkpoint's sub groups that hold one sub group's params here were stepped "
            f"{sorted(steps)} times: they cannot share one step count."
        )
    return steps.pop()


def refuse_uneven_steps(states: list[dict], reader: str) -> None:
    """``reader`` keeps one step count a sub group: refuse saved sub groups whose params were
    at different counts (their bias corrections would change)."""
    uneven = [i for i, state in enumerate(states) if state.get(PARAM_STEPS_KEY) is not None]
    if uneven:
        raise CheckpointLayoutError(
            f"the checkpoint's sub group {uneven[0]} holds params at different step counts "
            f"(some got no gradient in some steps, e.g. MoE experts without tokens), and "
            f"{reader} keeps one count a sub group: their bias corrections would change. "
            "Resume the checkpoint as saved, with SuperOffload on ZeRO-3 and the "
            'sub_group_size, param groups and number of ranks that saved it ("load_universal": '
            "false)."
        )


def saved_step_states(states: list[dict], recut, steps: list[int]) -> list[dict]:
    """Per live sub group, the step state to load: ``step`` and, where the saved sub group's
    params were at different step counts (some got no gradient in some steps), their
    ``param_steps``, which only a checkpoint cut as this optimizer is can carry over."""
    loaded = []
    for t, step in enumerate(steps):
        state = {"step": step}
        carried = [
            s for s in recut.source_sub_groups(t) if states[s].get(PARAM_STEPS_KEY) is not None
        ]
        if carried and not recut.identity:
            raise CheckpointLayoutError(
                f"the checkpoint's sub group {carried[0]} holds params at different step counts "
                "(some got no gradient in some steps), which only an optimizer cut into the "
                "same sub groups can resume: use the sub_group_size, param groups and number "
                "of ranks that saved it."
            )
        if carried:
            state[PARAM_STEPS_KEY] = states[carried[0]][PARAM_STEPS_KEY]
        loaded.append(state)
    return loaded


def live_part(zero, t: int):
    """The partition object (host or device) that holds sub group ``t``'s moments and step."""
    return zero._host_part_at[t] if t in zero._host_part_at else zero._device_part_at[t]


def check_moment_formats(zero, states: list[dict], recut: Recut) -> bool:
    """Whether the saved moments are compact codes; refuse what cannot be restored exactly:
    compact codes into fp32 moments, or into sub groups cut another way (their block scales
    follow the params' partitions of the ranks that saved them)."""
    saved_compact = bool(states[0]) and states[0]["exp_avg"].dtype == torch.uint8
    if saved_compact and not zero._compact:
        raise CheckpointLayoutError(
            "the checkpoint holds compact moments (saved with HF_SUPEROFFLOAD_MOMENTS=compact); "
            "resume with HF_SUPEROFFLOAD_MOMENTS=compact (superoffload_moments='compact')."
        )
    if saved_compact and not recut.identity:
        raise CheckpointLayoutError(
            "the checkpoint's compact moments were cut into other sub groups: resume with the "
            "sub_group_size, offload ratio, param groups and number of ranks that saved it."
        )
    return saved_compact


def _load_moments(part, t: int, recut: Recut, moments: list, saved_compact: bool, state) -> None:
    """Sub group ``t``'s moments: fp32 ones copied (or encoded, into compact moments), compact
    codes and scales copied as they are, none (saved before the first step) zeroed."""
    compact = part.compact
    if compact is None:
        for saved_moment, live in zip(
            moments or [None, None], (part.exp_avg, part.exp_avg_sq), strict=True
        ):
            if saved_moment is None:
                live.zero_()
            else:
                recut.copy_into(t, live, saved_moment)
        return
    if saved_compact:
        for key, live in zip(COMPACT_STATE_KEYS, compact.tensors(), strict=True):
            live.copy_(state[key])
        return
    values = []
    for saved_moment in moments:
        value = torch.empty(part.numel, dtype=torch.float32)
        recut.copy_into(t, value, saved_moment)
        values.append(value)
    for index, segment in enumerate(compact.segments):
        entry = None
        if values:  # fp32 moments: encoded, to nearest
            span = slice(segment.offset, segment.offset + segment.numel)
            entry = {"exp_avg": values[0][span], "exp_avg_sq": values[1][span]}
        compact.load(index, entry)


@torch.no_grad()
def load_rank_state(zero, saved: dict, load_optimizer_states: bool) -> None:
    """Restore this rank's fp32 masters (always, as DeepSpeed does) and, if asked, both moments,
    the step counts and each param group's hyperparameters, then the 16-bit partitions."""
    recut = Recut(saved_layout(zero, saved), live_layout(zero))
    if load_optimizer_states:  # every check before anything changes
        states = saved_sub_group_states(saved)
        saved_compact = check_moment_formats(zero, states, recut)
        steps = [agreed_step(states, recut.source_sub_groups(t)) for t in range(len(recut.sources))]
        step_states = saved_step_states(states, recut, steps) if states[0] else None
        restore_group_hyperparameters(
            zero.optimizer.param_groups, saved[BASE_OPTIMIZER_STATE]["param_groups"]
        )
    zero.loss_scaler = saved["loss_scaler"]
    zero.dynamic_loss_scale = saved["dynamic_loss_scale"]
    zero.overflow = saved["overflow"]
    masters = saved[FP32_FLAT_GROUPS]
    moments = (
        [[state[key] for state in states] for key in MOMENTS]
        if load_optimizer_states and states[0]
        else []
    )
    for t, master in enumerate(zero.fp32_partitioned_groups_flat):
        recut.copy_into(t, master, masters)
        if load_optimizer_states:
            part = live_part(zero, t)
            state = states[t] if saved_compact else None
            _load_moments(part, t, recut, moments, saved_compact, state)
            part.load_steps(step_states[t] if step_states else {"step": steps[t]})
            part.save_steps(zero.optimizer.state[master], zero._step_value)
            if t in zero._device_part_at:
                zero._tail.set_step(part)
        if saved.get(MAPPED_KEY, False):  # what is copied leaves the process (checkpoint_memory.py)
            for s in recut.done_after[t]:
                for tensors in (masters, *moments):
                    release_mapped_pages(tensors[s])
    refresh_partitions(zero)


@torch.no_grad()
def refresh_partitions(zero) -> None:
    """The 16-bit partitions from the restored fp32 masters, and the params pointed at them."""
    for i, master in enumerate(zero.fp32_partitioned_groups_flat):
        if master.numel():
            zero.fp16_partitioned_groups_flat[i].data.copy_(master.data)
        zero._unflatten_partitioned_parameters(i)
