"""Matching a ZeRO-3 checkpoint's sub groups to an optimizer cut another way
(hf_superoffload/zero3/checkpoint_layout.py), without DeepSpeed: which cut saved a file, moving
every param's values to where the live optimizer holds them, and refusing, before anything
changes, what cannot be matched.

The stand-in rank has five params in one param group, two of them persistent (DeepSpeed keeps
them gathered), sub_group_size 6: DeepSpeed's cut (in param order, each sub group at least 6)
is [a n1] [b c] [n2]; ours (at most 6, persistent params last) is [a] [b] [c] [n1 n2].
"""

from __future__ import annotations

import types

import pytest
import torch

from hf_superoffload.zero3.checkpoint_layout import (
    BASE_OPTIMIZER_STATE,
    FP32_FLAT_GROUPS,
    LAYOUT_KEY,
    CheckpointLayoutError,
    Recut,
    as_record,
    live_layout,
    saved_layout,
)
from hf_superoffload.zero3.checkpoint_load import load_rank_state

SIZES = {"a": 5, "n1": 2, "b": 4, "c": 6, "n2": 2}
PERSISTENT = {"n1", "n2"}
DEEPSPEED_CUT = [["a", "n1"], ["b", "c"], ["n2"]]
OUR_CUT = [["a"], ["b"], ["c"], ["n1", "n2"]]


class _Param:
    def __init__(self, name: str, numel: int):
        self.name, self.numel, self.ds_persist = name, numel, name in PERSISTENT

    def partition_numel(self) -> int:
        return self.numel


def _rank(cut, sizes=SIZES):
    """A stand-in for a live ZeRO-3 optimizer cut as ``cut``."""
    params = {name: _Param(name, n) for name, n in sizes.items()}
    return types.SimpleNamespace(
        fp16_groups=[[params[n] for n in sub] for sub in cut],
        param_names={p: p.name for p in params.values()},
        sub_group_to_group_id={i: 0 for i in range(len(cut))},
        trainable_param_groups=[{"params": list(params.values())}],
        fp32_partitioned_groups_flat=[
            torch.full((sum(sizes[n] for n in sub),), -1.0) for sub in cut
        ],
        optimizer=types.SimpleNamespace(
            param_groups=[{"params": [], "lr": 1.0, "weight_decay": 0.5}]
        ),
    )


def _values(name: str, key: str) -> torch.Tensor:
    """Distinct values for each param and state, so a misplaced element shows."""
    base = {"fp32": 0, "exp_avg": 1000, "exp_avg_sq": 2000}[key]
    start = base + 100 * list(SIZES).index(name)
    return torch.arange(start, start + SIZES[name], dtype=torch.float32)


def _saved(cut, record: bool, groups=None) -> dict:
    """A rank's state dict as DeepSpeed writes it, cut as ``cut`` (with our record or not)."""

    def flats(key):
        return [torch.cat([_values(n, key) for n in sub]) for sub in cut]

    state = {
        i: {"step": torch.tensor(3.0), "exp_avg": m, "exp_avg_sq": v}
        for i, (m, v) in enumerate(zip(flats("exp_avg"), flats("exp_avg_sq"), strict=True))
    }
    saved = {
        FP32_FLAT_GROUPS: flats("fp32"),
        BASE_OPTIMIZER_STATE: {
            "state": state,
            "param_groups": groups
            or [{"params": list(range(len(cut))), "lr": 0.1, "weight_decay": 0.0}],
        },
        "loss_scaler": None,
        "dynamic_loss_scale": False,
        "overflow": False,
    }
    if record:
        saved[LAYOUT_KEY] = as_record(live_layout(_rank(cut)))
    return saved


def _moved(saved_cut, live_cut, record: bool) -> None:
    """Every param's master and moments land where the live cut holds them."""
    live = _rank(live_cut)
    saved = _saved(saved_cut, record)
    recut = Recut(saved_layout(live, saved), live_layout(live))
    states = [saved[BASE_OPTIMIZER_STATE]["state"][i] for i in range(len(saved_cut))]
    sources = {"fp32": saved[FP32_FLAT_GROUPS]}
    sources.update({key: [s[key] for s in states] for key in ("exp_avg", "exp_avg_sq")})
    for key, flats in sources.items():
        for t, sub in enumerate(live_cut):
            into = torch.full((sum(SIZES[n] for n in sub),), -1.0)
            recut.copy_into(t, into, flats)
            assert torch.equal(into, torch.cat([_values(n, key) for n in sub])), (key, t)


@pytest.mark.parametrize("record", [False, True])
def test_deepspeeds_cut_moves_into_ours_param_by_param(record):
    _moved(DEEPSPEED_CUT, OUR_CUT, record)


def test_ours_moves_into_deepspeeds_and_a_file_of_ours_without_the_record_is_recognised():
    _moved(OUR_CUT, DEEPSPEED_CUT, record=True)
    _moved(OUR_CUT, DEEPSPEED_CUT, record=False)  # saved before the record existed


def test_the_same_cut_is_read_as_it_is():
    live = _rank(OUR_CUT)
    assert Recut(saved_layout(live, _saved(OUR_CUT, True)), live_layout(live)).identity


def test_a_different_number_of_ranks_is_refused_naming_the_universal_checkpoint():
    live = _rank(OUR_CUT, sizes={**SIZES, "c": 3})  # c's partition halves on twice the ranks
    with pytest.raises(CheckpointLayoutError, match="universal checkpoint"):
        Recut(saved_layout(live, _saved(OUR_CUT, True)), live_layout(live))


def test_other_params_or_sizes_that_fit_no_cut_are_refused():
    live = _rank([["a"], ["b"], ["c"], ["n1"]], sizes={k: v for k, v in SIZES.items() if k != "n2"})
    with pytest.raises(CheckpointLayoutError, match="different params"):
        Recut(saved_layout(live, _saved(OUR_CUT, True)), live_layout(live))
    saved = _saved(OUR_CUT, False)
    saved[FP32_FLAT_GROUPS] = [torch.zeros(3), torch.zeros(16)]  # no param boundary at 3
    saved[BASE_OPTIMIZER_STATE]["param_groups"][0]["params"] = [0, 1]
    with pytest.raises(CheckpointLayoutError, match="fit no cut"):
        saved_layout(_rank(OUR_CUT), saved)


def test_a_refused_resume_changes_nothing():
    """Two saved param groups against one here: refused before any master, moment or
    hyperparameter is written."""
    live = _rank(OUR_CUT)
    groups = [
        {"params": [0, 1, 2, 3], "lr": 0.1, "weight_decay": 0.0},
        {"params": [], "lr": 0.2, "weight_decay": 0.0},
    ]
    saved = _saved(OUR_CUT, True, groups=groups)
    with pytest.raises(CheckpointLayoutError, match="2 param groups, this optimizer 1"):
        load_rank_state(live, saved, load_optimizer_states=True)
    assert all(torch.equal(m, torch.full_like(m, -1.0)) for m in live.fp32_partitioned_groups_flat)
    assert live.optimizer.param_groups == [{"params": [], "lr": 1.0, "weight_decay": 0.5}]
