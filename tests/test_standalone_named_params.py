"""What ``params`` may be, as torch 2.x's optimizers take it: a bare tensor is refused with
torch's own TypeError; named params (``model.named_parameters()``, ``(name, param)`` pairs in a
group, or a group's ``param_names``) work, and ``state_dict()`` carries the names in each
param group as torch.optim.AdamW's does (loaded names replace the current ones, as in torch).
"""

from __future__ import annotations

import pytest
import torch
from test_engine_dropin import adamw, assert_matches_adamw, batch, loss_of, ours, twins

from hf_superoffload import SuperOffloadOptimizer

ENGINE = {"max_grad_norm": None, "gpu_tail": 0, "bucket_size": 300}


def _error_of(build) -> BaseException:
    with pytest.raises(Exception) as info:
        build()
    return info.value


def test_a_bare_tensor_gets_torchs_type_error():
    param = torch.randn(4, 3, requires_grad=True)
    want = _error_of(lambda: torch.optim.AdamW(param))
    got = _error_of(lambda: SuperOffloadOptimizer(param, **ENGINE))
    assert type(got) is type(want) is TypeError
    assert str(got) == str(want)


def test_named_parameters_train_like_adamw_and_the_state_dict_carries_the_names():
    mine, ref = twins()
    opt = SuperOffloadOptimizer(mine.named_parameters(), lr=1e-2, betas=(0.9, 0.99),
                                eps=1e-4, weight_decay=0.1, **ENGINE)  # fmt: skip
    ref_opt = torch.optim.AdamW(ref.named_parameters(), lr=1e-2, betas=(0.9, 0.99), eps=1e-4,
                                weight_decay=0.1, foreach=False)  # fmt: skip
    for step in range(3):
        for model, optimizer in ((mine, opt), (ref, ref_opt)):
            loss_of(model, batch(step)).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert_matches_adamw(opt, mine, ref_opt, ref)
    names = [name for name, _ in mine.named_parameters()]
    assert opt.param_groups[0]["param_names"] == names
    (group,) = opt.state_dict()["param_groups"]
    (want,) = ref_opt.state_dict()["param_groups"]
    assert group["param_names"] == want["param_names"] == names
    assert group["params"] == want["params"]
    # AdamW's named state dict loads, and so does our own.
    fresh = SuperOffloadOptimizer(ref.named_parameters(), **ENGINE)
    fresh.load_state_dict(ref_opt.state_dict())
    assert fresh.param_groups[0]["param_names"] == names
    opt.close()
    fresh.close()


def test_param_names_in_groups_and_named_pairs_in_groups():
    model, _ = twins()
    decay = [(n, p) for n, p in model.named_parameters() if p.ndim == 2]
    rest = [(n, p) for n, p in model.named_parameters() if p.ndim != 2]
    opt = SuperOffloadOptimizer(
        [
            {"params": decay, "weight_decay": 0.1},
            {"params": [p for _, p in rest], "param_names": [n for n, _ in rest],
             "weight_decay": 0.0},
        ],
        **ENGINE,
    )  # fmt: skip
    groups = opt.state_dict()["param_groups"]
    assert groups[0]["param_names"] == [n for n, _ in decay]
    assert groups[1]["param_names"] == [n for n, _ in rest]
    # Loaded names replace the current ones; a state dict without names keeps them (torch's).
    saved = opt.state_dict()
    saved["param_groups"] = [dict(g) for g in saved["param_groups"]]
    saved["param_groups"][1]["param_names"] = [f"renamed.{n}" for n, _ in rest]
    del saved["param_groups"][0]["param_names"]
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["param_names"] == [n for n, _ in decay]
    assert opt.param_groups[1]["param_names"] == [f"renamed.{n}" for n, _ in rest]
    opt.close()


def test_some_params_named_and_some_not_is_torchs_value_error():
    model, _ = twins()
    named = list(model.named_parameters())
    mixed = [named[0], *(p for _, p in named[1:])]
    want = _error_of(lambda: torch.optim.AdamW(mixed))
    got = _error_of(lambda: SuperOffloadOptimizer(mixed, **ENGINE))
    assert type(got) is type(want) is ValueError and str(got) == str(want)


def test_unnamed_params_stay_unnamed():
    model, ref = twins()
    opt, ref_opt = ours(model), adamw(ref)
    assert "param_names" not in opt.state_dict()["param_groups"][0]
    assert "param_names" not in ref_opt.state_dict()["param_groups"][0]
    opt.close()
