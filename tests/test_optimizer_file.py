"""integrations/optimizer_file.py: each param's fp32 master in a saved optimizer state, found as
``load_state_dict`` finds it (by the param's key in its saved group), for resuming and for
restoring the best checkpoint's masters: ours' masters exactly, none in torch's layout, frozen
params left out, and groups of other sizes refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_superoffload import SuperOffloadOptimizer
from hf_superoffload.integrations.optimizer_file import masters_in_state, read_optimizer_state

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

HYPER = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[0].bias.requires_grad_(False)  # in the group, not stepped: no master
    return model


def _step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(3, 4, generator=torch.Generator().manual_seed(1))).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def _ours(model: nn.Module) -> SuperOffloadOptimizer:
    return SuperOffloadOptimizer(
        model.parameters(), **HYPER, max_grad_norm=None, gpu_tail=0, model=model
    )


def _stepped(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def test_our_saved_state_gives_each_stepped_params_master(tmp_path):
    model = _model()
    optimizer = _ours(model)
    _step(model, optimizer)
    path = tmp_path / "optimizer.pt"
    torch.save(optimizer.state_dict(), path)
    found = masters_in_state(optimizer, read_optimizer_state(optimizer, str(path)))
    assert [p for p, _ in found] == _stepped(model)
    for param, master in found:
        assert torch.equal(master, optimizer.master_view(param))
    optimizer.close()


def test_torch_layout_gives_no_masters(tmp_path):
    model = _model()
    reference = torch.optim.AdamW(model.parameters(), **HYPER, foreach=False)
    _step(model, reference)
    optimizer = _ours(model)
    found = masters_in_state(optimizer, reference.state_dict())
    assert [p for p, _ in found] == _stepped(model)
    assert all(master is None for _, master in found)
    optimizer.close()


def test_masters_follow_the_saved_keys_as_load_state_dict_does(tmp_path):
    """Saved groups that number the two weights the other way round: the master of each param
    is the one ``load_state_dict`` gives it."""
    model = _model()
    optimizer = _ours(model)
    _step(model, optimizer)
    path = tmp_path / "optimizer.pt"
    torch.save(optimizer.state_dict(), path)  # a copy: state_dict() views our buffers
    state = read_optimizer_state(optimizer, str(path))
    keys = state["param_groups"][0]["params"]
    first, second = 0, 2  # model[0].weight and model[1].weight: same shape
    keys[first], keys[second] = keys[second], keys[first]
    found = {id(p): m.clone() for p, m in masters_in_state(optimizer, state)}
    weights = (model[0].weight, model[1].weight)
    assert not torch.equal(found[id(weights[0])], optimizer.master_view(weights[0]))
    optimizer.load_state_dict(state)
    for param in _stepped(model):
        assert torch.equal(found[id(param)], optimizer.master_view(param))
    optimizer.close()


def test_groups_of_other_sizes_are_refused():
    model = _model()
    optimizer = _ours(model)
    state = optimizer.state_dict()
    state["param_groups"][0]["params"].pop()
    with pytest.raises(ValueError, match="param groups of other sizes"):
        masters_in_state(optimizer, state)
    optimizer.close()
