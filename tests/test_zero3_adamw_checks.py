"""The ZeRO-3 path refuses the AdamW settings its CPU kernel does not run, with the standalone
engine's messages for torch.optim.AdamW's switches (engine/adamw_switches.py): a client
optimizer (the Trainer's, or one passed to deepspeed.initialize) with maximize=True would
otherwise be minimized."""

from __future__ import annotations

import pytest
import torch

from hf_superoffload.zero3.base_optimizer import HostAdamState
from hf_superoffload.zero3.options import check_adamw


def _adamw(**switches) -> torch.optim.AdamW:
    return torch.optim.AdamW([torch.nn.Parameter(torch.ones(4))], lr=1e-3, **switches)


@pytest.mark.parametrize("switch", ["maximize", "differentiable"])
def test_a_switch_that_changes_the_update_is_refused(switch):
    optimizer = _adamw(**{switch: True})
    with pytest.raises(
        ValueError, match=rf"super_offload does not implement {switch}=True in param group 0"
    ):
        check_adamw(optimizer)
    # DeepSpeed's wrapper of the client optimizer's groups is refused alike.
    with pytest.raises(ValueError, match=rf"{switch}=True"):
        check_adamw(HostAdamState.in_place_of(optimizer))


@pytest.mark.parametrize("switches", [{}, {"foreach": True}, {"fused": False}, {"maximize": False}])
def test_the_switches_that_change_nothing_are_accepted(switches):
    check_adamw(_adamw(**switches))
