"""Two changes to how DeepSpeed reads ZeRO-3 checkpoints, installed by ``activation.py``.

1. ``map_optimizer_files`` (DeepSpeed's engine): for our optimizer, a rank's optimizer file is
   memory-mapped (``torch.load(mmap=True)``) instead of read whole into memory, so a resume
   needs no room for a second copy of the optimizer state (``checkpoint_load.py`` copies it
   into the live state sub group by sub group; ``checkpoint_memory.py`` counts what it costs).
2. ``read_our_cut`` (DeepSpeed's ZeRO-3 optimizer): DeepSpeed's own optimizers (plain
   ZeRO-Offload, its SuperOffload) read a checkpoint that ours saved by moving each param's
   state to where their sub groups hold it. It is installed with ``HF_SUPEROFFLOAD_DEEPSPEED=0``
   too: that is the way back to DeepSpeed's optimizer, and it must resume the run.
"""

from __future__ import annotations

import logging
import os
import zipfile

import torch

from .checkpoint_layout import (
    BASE_OPTIMIZER_STATE,
    FP32_FLAT_GROUPS,
    LAYOUT_KEY,
    Recut,
    from_record,
    live_layout,
)
from .checkpoint_load import agreed_step, refuse_uneven_steps, saved_sub_group_states
from .checkpoint_memory import MAPPED_KEY

logger = logging.getLogger("hf_superoffload")

# DeepSpeed's checkpoint engines that write and read files with torch.save / torch.load.
TORCH_FILE_ENGINES = {"TorchCheckpointEngine", "DecoupledCheckpointEngine", "FastCheckpointEngine"}
OPTIMIZER_STATE_DICT = (
    "optimizer_state_dict"  # the rank file's key (deepspeed.checkpoint.constants)
)


def read_optimizer_file(path: str) -> tuple[dict, bool]:
    """A ZeRO optimizer file with its tensors mapped from disk, and whether they are: their
    pages are read as the state is copied, and released once copied (checkpoint_memory.py).
    A file in torch's legacy (non-zip) format cannot be mapped and is read whole."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no ZeRO optimizer file at {path}")
    if zipfile.is_zipfile(path):
        return torch.load(path, map_location="cpu", mmap=True, weights_only=False), True
    logger.warning(
        "hf_superoffload: %s was saved in torch's legacy format, which cannot be memory-mapped: "
        "it is read whole (12 bytes per param of this rank's partition beside the live state). "
        'Checkpoints saved with DeepSpeed\'s default "checkpoint_serialization": true are mapped.',
        path,
    )
    return torch.load(path, map_location="cpu", weights_only=False), False


def _read_rank_file(path: str) -> dict:
    """A rank's ZeRO-3 optimizer state dict, marked with whether its tensors are mapped."""
    state, mapped = read_optimizer_file(path)
    return {**state[OPTIMIZER_STATE_DICT], MAPPED_KEY: mapped}


def map_optimizer_files(engine_module) -> None:
    engine_class = engine_module.DeepSpeedEngine
    original = engine_class._get_all_zero_checkpoint_state_dicts
    if getattr(original, "_hf_superoffload_mapped", False):
        return

    def get_all_zero_checkpoint_state_dicts(self, zero_ckpt_names):
        if not (
            getattr(self.optimizer, "reads_mapped_checkpoints", False)
            and type(self.checkpoint_engine).__name__ in TORCH_FILE_ENGINES
            and getattr(self, "_autoep_folding_spec", None) is None
        ):
            return original(self, zero_ckpt_names)
        from deepspeed import comm

        rank = comm.get_rank(group=self.optimizer.dp_process_group)
        return [
            _read_rank_file(name) if i == rank and name else None
            for i, name in enumerate(zero_ckpt_names)
        ]

    get_all_zero_checkpoint_state_dicts._hf_superoffload_mapped = True
    engine_class._get_all_zero_checkpoint_state_dicts = get_all_zero_checkpoint_state_dicts


def in_live_cut(zero, saved: dict) -> dict:
    """``saved`` (a rank's state dict in our cut) in ``zero``'s cut, for DeepSpeed's loader."""
    states = saved_sub_group_states(saved)
    refuse_uneven_steps(states, "DeepSpeed's own optimizer (HF_SUPEROFFLOAD_DEEPSPEED=0)")
    recut = Recut(from_record(saved[LAYOUT_KEY]), live_layout(zero))
    if recut.identity:
        return saved
    base = saved[BASE_OPTIMIZER_STATE]
    moved = {
        key: list(recut.tensors([s[key] for s in states], zero.fp32_partitioned_groups_flat))
        for key in ("exp_avg", "exp_avg_sq")
        if states[0]
    }
    new_state = {}
    for t in range(len(recut.sources)):
        if states[0]:
            step = agreed_step(states, recut.source_sub_groups(t))
            step_value = next(iter(recut.source_sub_groups(t)))
            like = states[step_value]["step"]  # the saved optimizer's own step format
            new_state[t] = {
                "step": torch.tensor(float(step)) if torch.is_tensor(like) else step,
                **{key: tensors[t] for key, tensors in moved.items()},
            }
    param_groups = [dict(group, params=[]) for group in base["param_groups"]]
    for t in range(len(recut.sources)):
        param_groups[zero.sub_group_to_group_id[t]]["params"].append(t)
    masters = recut.tensors(saved[FP32_FLAT_GROUPS], zero.fp32_partitioned_groups_flat)
    return {
        **{k: v for k, v in saved.items() if k not in (LAYOUT_KEY, MAPPED_KEY)},
        FP32_FLAT_GROUPS: list(masters),
        BASE_OPTIMIZER_STATE: {"state": new_state, "param_groups": param_groups},
    }


def read_our_cut(stage3_module) -> None:
    stage3_class = stage3_module.DeepSpeedZeroOptimizer_Stage3
    original = stage3_class._rigid_load_state_dict
    if getattr(original, "_hf_superoffload_recut", False):
        return

    def rigid_load_state_dict(self, state_dict, load_optimizer_states=True):
        if LAYOUT_KEY in state_dict:
            state_dict = in_live_cut(self, state_dict)
        return original(self, state_dict, load_optimizer_states=load_optimizer_states)

    rigid_load_state_dict._hf_superoffload_recut = True
    stage3_class._rigid_load_state_dict = rigid_load_state_dict
