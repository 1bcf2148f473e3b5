"""Readers that keep one step count a ZeRO-3 sub group (a universal checkpoint, DeepSpeed's own
optimizer under HF_SUPEROFFLOAD_DEEPSPEED=0) refuse a checkpoint whose sub group holds params
at different step counts (``param_steps``: params that got no gradient in some steps), which
they would resume at the sub group's count, changing those params' bias corrections."""

from __future__ import annotations

import pytest
import torch

from hf_superoffload.zero3.checkpoint_load import CheckpointLayoutError, refuse_uneven_steps
from hf_superoffload.zero3.param_steps import PARAM_STEPS_KEY


def _state(step: int, param_steps=None) -> dict:
    state = {"step": step, "exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4)}
    if param_steps is not None:
        state[PARAM_STEPS_KEY] = torch.tensor(param_steps, dtype=torch.float64)
    return state


def test_a_sub_group_with_params_at_different_counts_is_refused():
    states = [_state(5), _state(5, [5.0, 3.0])]
    with pytest.raises(CheckpointLayoutError, match="sub group 1 holds params at different"):
        refuse_uneven_steps(states, "a universal checkpoint")


def test_sub_groups_at_one_count_each_pass():
    refuse_uneven_steps([_state(5), _state(5)], "a universal checkpoint")
    refuse_uneven_steps([{}, {}], "a universal checkpoint")  # not stepped yet
