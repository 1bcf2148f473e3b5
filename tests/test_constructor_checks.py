"""The order of SuperOffloadOptimizer's refusals (engine/checks.py): given several wrong
arguments at once, it names the first of: an unknown keyword, an engine option's type, the
moments, an AdamW switch, torch's own check of the params, an option's value, a group's
hyperparameter; and a run with no param that requires grad is refused before any param is
claimed."""

from __future__ import annotations

import pytest
from torch import nn

from hf_superoffload import SuperOffloadOptimizer

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

# Each wrong argument with the refusal it gets, in the order the constructor checks them.
WRONG_IN_ORDER = [
    ({"gpu_tial": 0}, TypeError, "unexpected keyword argument 'gpu_tial'"),
    ({"bucket_size": 1.5}, ValueError, "bucket_size must be an int"),
    ({"moments": "int8"}, ValueError, "moments must be 'fp32'"),
    ({"amsgrad": True}, ValueError, "does not implement amsgrad=True"),
    ({"params": []}, ValueError, "empty parameter list"),
    ({"max_grad_norm": -1.0}, ValueError, "max_grad_norm must be >= 0"),
    ({"betas": 0.9}, ValueError, "betas must be a pair of numbers"),
]


@pytest.mark.parametrize("first", range(len(WRONG_IN_ORDER)))
def test_the_first_wrong_argument_in_check_order_is_named(first):
    model = nn.Linear(4, 4)
    kwargs = {"params": model.parameters(), "gpu_tail": 0}
    for wrong, _, _ in WRONG_IN_ORDER[first:]:
        kwargs.update(wrong)
    _, error, message = WRONG_IN_ORDER[first]
    with pytest.raises(error, match=message):
        SuperOffloadOptimizer(**kwargs)


def test_no_param_that_requires_grad_is_refused_before_any_is_claimed():
    model = nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(ValueError, match="got no parameters that require grad"):
        SuperOffloadOptimizer(model.parameters(), gpu_tail=0)
    model.requires_grad_(True)
    with SuperOffloadOptimizer(model.parameters(), gpu_tail=0) as optimizer:
        assert all(optimizer.manages(p) for p in model.parameters())
