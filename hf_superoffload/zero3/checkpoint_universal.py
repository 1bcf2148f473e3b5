"""Resume SuperOffloadZero3Optimizer from DeepSpeed's universal checkpoint (``ds_to_universal``,
then ``"checkpoint": {"load_universal": true}``): the way to change the number of ranks.

A universal checkpoint holds, per param, its whole fp32 master and both moments
(``zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt``), and ``zero/optimizer_state.pt`` with the base
optimizer's param groups. DeepSpeed's ZeRO-3 loader gives every param group the hyperparameters
of group 0 (so the no-decay group of a Trainer gets weight decay) and builds new moment tensors
beside the live ones. Here each group takes its own, and each rank's partition of each param is
copied from the memory-mapped files into the live tensors.
"""

from __future__ import annotations

import os

import torch

from .checkpoint_hooks import read_optimizer_file
from .checkpoint_layout import LAYOUT_KEY, MOMENTS, CheckpointLayoutError, from_record
from .checkpoint_load import (
    agreed_step,
    live_part,
    refresh_partitions,
    refuse_uneven_steps,
    restore_group_hyperparameters,
    saved_sub_group_states,
)
from .checkpoint_memory import release_mapped_pages

KEYS = ("fp32", *MOMENTS)  # the per-param files, and the state they restore
PARAM_KEY, EXPERT_KEY = "param", "is_expert_param"  # deepspeed.checkpoint.constants


def _param_file(folder: str, name: str, key: str) -> torch.Tensor:
    """One param's whole state ``key``, mapped from disk, flat."""
    path = os.path.join(folder, name, f"{key}.pt")
    if not os.path.isfile(path):
        raise CheckpointLayoutError(f"{path} is missing: the universal checkpoint lacks {name}.")
    loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    if isinstance(loaded, dict):
        if loaded.get(EXPERT_KEY, False) or len(loaded.keys() - {PARAM_KEY}) > 0:
            raise CheckpointLayoutError(
                f"{path} holds an expert- or tensor-parallel param, which hf_superoffload's "
                "ZeRO-3 path does not read from a universal checkpoint."
            )
        loaded = loaded[PARAM_KEY]
    return loaded.reshape(-1)


def _partition_of(zero, param) -> tuple[int, int]:
    """(first element, real elements) of this rank's partition of ``param``."""
    group = zero._get_param_partition_group(param)
    from deepspeed import comm

    start = comm.get_rank(group=group) * param.partition_numel()
    return start, max(0, min(param.partition_numel(), param.ds_numel - start))


@torch.no_grad()
def load_universal_state(
    zero, folder: str, load_optimizer_states: bool, load_from_fp32: bool
) -> None:
    if (
        not load_optimizer_states
    ):  # module weights only: DeepSpeed's own reader changes nothing else
        zero.load_module_checkpoint_state_from_checkpoint_dir_stage3(folder, load_from_fp32)
        return
    if zero._compact:
        raise CheckpointLayoutError(
            "compact moments (HF_SUPEROFFLOAD_MOMENTS=compact) resume from a checkpoint saved "
            "by the same ranks and sub groups, not from a universal one: set "
            '"load_universal": false and resume on the machine shape that saved it, or resume '
            "the universal checkpoint with fp32 moments (HF_SUPEROFFLOAD_MOMENTS=fp32)."
        )
    folder = os.path.join(folder, "zero")
    path = os.path.join(folder, "optimizer_state.pt")
    if not os.path.isfile(path):
        raise CheckpointLayoutError(f"{path} is missing: not a universal checkpoint.")
    optim_sd, _ = read_optimizer_file(path)
    states = saved_sub_group_states(optim_sd)
    refuse_uneven_steps(states, "a universal checkpoint")
    step = agreed_step(states, set(range(len(states))))
    saved_groups = optim_sd["param_groups"]
    _check_groups(zero, optim_sd, saved_groups)
    for group in zero.fp16_groups:  # every file there and of the right size
        for param in group:
            for key in KEYS:
                found = _param_file(folder, zero.param_names[param], key).numel()
                if found != param.ds_numel:
                    raise CheckpointLayoutError(
                        f"{zero.param_names[param]}: {found} elements in the checkpoint, "
                        f"{param.ds_numel} in this model."
                    )
    zero.loss_scaler = optim_sd.get("loss_scaler", zero.loss_scaler)
    zero.dynamic_loss_scale = optim_sd.get("dynamic_loss_scale", zero.dynamic_loss_scale)
    zero.overflow = optim_sd.get("overflow", zero.overflow)
    restore_group_hyperparameters(zero.optimizer.param_groups, saved_groups)
    for t, group in enumerate(zero.fp16_groups):
        master = zero.fp32_partitioned_groups_flat[t]
        part = live_part(zero, t)
        targets = dict(zip(KEYS, (master, part.exp_avg, part.exp_avg_sq), strict=True))
        for key, target in targets.items():
            offset = 0
            for param in group:
                whole = _param_file(folder, zero.param_names[param], key)
                start, real = _partition_of(zero, param)
                target.narrow(0, offset, real).copy_(whole.narrow(0, start, real))
                release_mapped_pages(whole.narrow(0, start, real))  # mapped by _param_file
                target.narrow(0, offset + real, param.partition_numel() - real).zero_()  # padding
                offset += param.partition_numel()
        # A universal checkpoint keeps one step count: every param resumes at it.
        part.load_steps({"step": step})
        part.save_steps(zero.optimizer.state[master], zero._step_value)
        if t in zero._device_part_at:
            zero._tail.set_step(part)
    refresh_partitions(zero)


def _check_groups(zero, optim_sd: dict, saved_groups: list[dict]) -> None:
    """Same number of param groups, and where the checkpoint records its cut (ours), every
    param in the group it was saved in."""
    if len(saved_groups) != len(zero.optimizer.param_groups):
        raise CheckpointLayoutError(
            f"the universal checkpoint has {len(saved_groups)} param groups, this optimizer "
            f"{len(zero.optimizer.param_groups)}: each group's hyperparameters (lr, "
            "weight_decay, ...) cannot be matched; resume with the param groups that saved it."
        )
    if LAYOUT_KEY not in optim_sd:
        return
    saved_group = {name: g for g, params in from_record(optim_sd[LAYOUT_KEY]) for name, _ in params}
    for t, group in enumerate(zero.fp16_groups):
        for param in group:
            name = zero.param_names[param]
            if (
                saved_group.get(name, zero.sub_group_to_group_id[t])
                != zero.sub_group_to_group_id[t]
            ):
                raise CheckpointLayoutError(
                    f"{name} was saved in param group {saved_group[name]} and is in "
                    f"{zero.sub_group_to_group_id[t]} here: resume with the param groups that saved it."
                )
