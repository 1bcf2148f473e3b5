"""Where torch's generic optimizer tests (test/test_optim.py, TestOptimRenewed) read the layout
of ``state_dict()``, SuperOffloadOptimizer's matches torch.optim.AdamW's:

- params are numbered by identity: a param group listed again (``param_groups.extend``) shows
  the same numbers (torch's "repeated parameters have identical representation");
- entries of ``optimizer.state`` not keyed by a param (a state-dict pre-hook's, say) travel in
  ``state_dict()["state"]`` and come back into ``optimizer.state`` on load, replacing those
  that were there.
"""

from __future__ import annotations

import pytest
from test_engine_dropin import adamw, ours, twins


def _both():
    mine, ref = twins()
    return ours(mine), adamw(ref)


def test_a_group_listed_again_keeps_its_param_numbers_as_adamws():
    opt, ref = _both()
    opt.param_groups.extend(opt.param_groups)
    ref.param_groups.extend(ref.param_groups)
    got = [g["params"] for g in opt.state_dict()["param_groups"]]
    want = [g["params"] for g in ref.state_dict()["param_groups"]]
    assert got == want == [want[0], want[0]]
    opt.close()


def test_state_entries_not_keyed_by_a_param_travel_as_adamws():
    opt, ref = _both()
    for optimizer in (opt, ref):
        optimizer.register_state_dict_pre_hook(lambda o: o.state.__setitem__("note", 1))
    assert opt.state_dict()["state"]["note"] == ref.state_dict()["state"]["note"] == 1
    for optimizer in (opt, ref):
        saved = optimizer.state_dict()
        optimizer.state["stale"] = 2
        saved["state"]["loaded"] = 3
        optimizer.load_state_dict(saved)
    assert {k: v for k, v in opt.state.items() if isinstance(k, str)} == {"note": 1, "loaded": 3}
    assert {k: v for k, v in ref.state.items() if isinstance(k, str)} == {"note": 1, "loaded": 3}
    opt.close()


def test_a_param_number_that_is_in_no_group_is_still_refused():
    opt, _ = _both()
    saved = opt.state_dict()
    saved["state"][99] = saved["state"][0]
    with pytest.raises(ValueError, match="param id 99"):
        opt.load_state_dict(saved)
    assert not any(isinstance(k, int) for k in opt.state)
    opt.close()
