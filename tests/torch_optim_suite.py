"""Run torch's own generic optimizer tests (``TestOptimRenewed`` in pytorch's
``test/test_optim.py``) against SuperOffloadOptimizer, from a local pytorch checkout (torch's
wheel does not ship its tests, and CI cannot fetch them):

    python tests/torch_optim_suite.py /path/to/pytorch/test/test_optim.py [--inputs accepted]

torch describes each optimizer's test inputs in ``optim_db``; this replaces that list's
contents, in place and before the test file is imported, with AdamW's entry whose class is
SuperOffloadOptimizer as a drop-in AdamW (no clipping, as AdamW; named ``AdamW`` so torch's
AdamW-specific branches apply). ``--inputs all`` (default) keeps AdamW's inputs, including the
switches the engine refuses (amsgrad, maximize, differentiable, capturable): every test that
loops over one of those fails at it. ``--inputs accepted`` drops those inputs. Only the CPU
tests run. Extra arguments after ``--`` go to pytest.

Measured (torch 2.13 CPU wheel, test_optim.py's CPU tests, 44 for AdamW, all pass for AdamW):
with ``--inputs accepted`` 33 pass; the 11 others are refusals: complex params (test_complex,
test_complex_2d), float64 params (test_foreach_matches_forloop, test_fused_matches_forloop
float64), meta params (test_fused_error_on_params_on_meta), copy.deepcopy
(test_deepcopy_copies_all_public_attrs), an optimizer without any param that requires grad
(test_step_pre_hook, test_step_post_hook, test_step_all_hooks,
test_step_is_noop_when_params_have_no_grad), and a param listed twice, which torch only warns
about (test_errors).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

REFUSED_SWITCHES = ("amsgrad", "maximize", "differentiable", "capturable")


def _drop_in_adamw():
    from hf_superoffload import SuperOffloadOptimizer

    class AdamW(SuperOffloadOptimizer):
        def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                     **kwargs):  # fmt: skip
            kwargs.setdefault("max_grad_norm", None)  # AdamW does not clip
            super().__init__(params, lr, betas, eps, weight_decay, **kwargs)

    return AdamW


def use_superoffload_in_optim_db(accepted_only: bool) -> None:
    import torch
    from torch.testing._internal import common_optimizers

    adamw = next(i for i in common_optimizers.optim_db if i.optim_cls is torch.optim.AdamW)
    ours = copy.copy(adamw)
    ours.optim_cls = _drop_in_adamw()
    if accepted_only:
        inputs = adamw.optim_inputs_func

        def accepted(device, dtype=None):
            return [
                i
                for i in inputs(device, dtype)
                if not any(i.kwargs.get(k) for k in REFUSED_SWITCHES)
            ]

        ours.optim_inputs_func = accepted
        ours.supported_impls = tuple(i for i in adamw.supported_impls if i != "differentiable")
    common_optimizers.optim_db[:] = [ours]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("test_file", help="pytorch's test/test_optim.py")
    parser.add_argument("--inputs", choices=("all", "accepted"), default="all")
    args, pytest_args = parser.parse_known_args()
    use_superoffload_in_optim_db(args.inputs == "accepted")
    import pytest

    test_file = os.path.abspath(args.test_file)
    sys.path.insert(0, os.path.dirname(test_file))  # its own imports (optim/...)
    extra = [a for a in pytest_args if a != "--"]
    return pytest.main([test_file, "-k", "TestOptimRenewed and cpu", "-p", "no:cacheprovider",
                        "-q", *extra])  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
