"""Bad input to the CPU Adam gets an error that names the argument and what to change."""

from __future__ import annotations

import pytest
import torch

from hf_superoffload import ops
from hf_superoffload.ops import _build

HYPER = {"step": 1, "lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}


def _tensors(n: int = 8):
    return [torch.zeros(n) for _ in range(4)]


@pytest.mark.parametrize("position", [0, 2, 3])
def test_wrong_dtype_is_a_type_error_naming_the_argument(position):
    tensors = _tensors()
    tensors[position] = tensors[position].double()
    name = ("param", "grad", "exp_avg", "exp_avg_sq")[position]
    with pytest.raises(TypeError, match=rf"{name} must be float32.*tensor\.float\(\)"):
        ops.adam_step(*tensors, **HYPER)


def test_grad_may_be_16_bit_but_not_double():
    tensors = _tensors()
    tensors[1] = tensors[1].double()
    with pytest.raises(TypeError, match="grad must be float32, bfloat16 or float16"):
        ops.adam_step(*tensors, **HYPER)


def test_non_contiguous_is_a_value_error():
    tensors = _tensors(16)
    tensors[1] = torch.zeros(32)[::2]
    with pytest.raises(ValueError, match=r"grad must be contiguous.*contiguous\(\)"):
        ops.adam_step(*tensors, **HYPER)


def test_mismatched_sizes_is_a_value_error():
    tensors = _tensors()
    tensors[3] = torch.zeros(9)
    with pytest.raises(ValueError, match="exp_avg_sq has 9 elements but param has 8"):
        ops.adam_rollback(*tensors, **HYPER)


def test_non_cpu_tensor_is_a_value_error():
    tensors = _tensors()
    tensors[2] = torch.zeros(8, device="meta")
    with pytest.raises(ValueError, match=r"exp_avg must be a CPU tensor.*meta"):
        ops.adam_step(*tensors, **HYPER)


def test_out_lowp_checks():
    tensors = _tensors()
    with pytest.raises(TypeError, match="out_lowp must be bfloat16 or float16"):
        ops.adam_step(*tensors, **HYPER, out_lowp=torch.zeros(8))
    with pytest.raises(ValueError, match="out_lowp has 7 elements"):
        ops.adam_step(*tensors, **HYPER, out_lowp=torch.zeros(7, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match=r"out_lowp must be a torch\.Tensor"):
        ops.adam_step(*tensors, **HYPER, out_lowp=[0.0] * 8)


@pytest.mark.parametrize(
    ("change", "error", "pattern"),
    [
        ({"step": 0}, ValueError, "step is the 1-based number"),
        ({"step": 1.0}, TypeError, "step must be an int"),
        ({"lr": -1.0}, ValueError, "lr must be >= 0"),
        ({"lr": float("nan")}, ValueError, "lr must be finite"),
        ({"lr": "1e-3"}, TypeError, "lr must be a real number"),
        ({"beta1": 1.0}, ValueError, r"beta1 must be in \[0, 1\)"),
        ({"beta2": -0.1}, ValueError, r"beta2 must be in \[0, 1\)"),
        ({"eps": 0.0}, ValueError, "eps must be > 0"),
        ({"weight_decay": -0.1}, ValueError, "weight_decay must be >= 0"),
        ({"grad_scale": float("inf")}, ValueError, "grad_scale must be finite"),
        ({"grad_scale": -1.0}, ValueError, "grad_scale must be >= 0"),
    ],
)
def test_bad_hyperparameters(change, error, pattern):
    with pytest.raises(error, match=pattern):
        ops.adam_step(*_tensors(), **{**HYPER, **change})


def test_rollback_refuses_what_cannot_be_undone():
    with pytest.raises(ValueError, match="beta1=0 discards the previous moment"):
        ops.adam_rollback(*_tensors(), **{**HYPER, "beta1": 0.0})
    with pytest.raises(ValueError, match="lower lr or weight_decay"):
        ops.adam_replay(
            *_tensors(),
            **{**HYPER, "lr": 1.0, "weight_decay": 1.0},
            old_grad_scale=1.0,
            new_grad_scale=0.5,
        )
    # The same hyperparameters are fine for a plain step.
    ops.adam_step(*_tensors(), **{**HYPER, "beta1": 0.0})


def test_unknown_isa_is_refused():
    with pytest.raises(ValueError, match="not available on this CPU"):
        ops.set_isa("sve2-ultra")


def test_bad_thread_count_is_refused():
    with pytest.raises(ValueError, match="threads must be a positive int"):
        ops.set_num_threads(0)


def test_missing_compiler_says_what_to_install(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    with pytest.raises(_build.BuildToolMissingError, match=r"apt-get install g\+\+.*CXX"):
        _build.check_build_tools()


def test_missing_ninja_says_what_to_install(monkeypatch):
    monkeypatch.setattr(_build.cpp_extension, "is_ninja_available", lambda: False)
    with pytest.raises(_build.BuildToolMissingError, match="pip install ninja"):
        _build.check_build_tools()


def test_build_cache_is_keyed_by_torch_version_and_honours_env(monkeypatch, tmp_path):
    tag = _build.build_tag()
    monkeypatch.setattr(_build.torch, "__version__", "0.0.0-other")
    assert _build.build_tag() != tag
    monkeypatch.setenv("HF_SUPEROFFLOAD_CACHE", str(tmp_path))
    assert _build.cache_root() == tmp_path
