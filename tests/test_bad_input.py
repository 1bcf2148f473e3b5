"""Bad input: each mistake is a clear error that says what to change, or a supported case that
trains as torch AdamW does (misspelled environment variables: test_env.py)."""

from __future__ import annotations

import pytest
import torch

from hf_superoffload import SuperOffloadOptimizer

# --- constructor arguments --------------------------------------------------------------------


def _linear():
    torch.manual_seed(0)
    return torch.nn.Linear(8, 4)


def _build(params, **kwargs):
    return SuperOffloadOptimizer(params, **{"gpu_tail": 0, **kwargs})


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"lrr": 1e-3}, TypeError, "unexpected keyword argument 'lrr'"),
        ({"lr": "1e-3"}, ValueError, r"lr must be a number, got '1e-3' \(str\); pass e.g. lr=1e-3"),
        ({"max_grad_norm": "1"}, ValueError, "max_grad_norm must be a number.*max_grad_norm=1.0"),
        ({"weight_decay": "0.1"}, ValueError, "weight_decay must be a number"),
        ({"eps": None}, ValueError, "eps must be a number"),
        ({"betas": "09"}, ValueError, r"betas must be a pair of numbers.*betas=\(0.9, 0.999\)"),
        ({"betas": 0.9}, ValueError, r"betas must be a pair of numbers.*betas=\(0.9, 0.999\)"),
        ({"gradient_accumulation_steps": "2"}, ValueError, "must be an int.*=4"),
        ({"bucket_size": 0}, ValueError, "bucket_size must be a positive number of elements"),
        ({"bucket_size": 1.5}, ValueError, "bucket_size must be an int"),
        ({"speculate": "no"}, ValueError, "speculate must be True or False"),
        ({"cpu_threads": "2"}, ValueError, r"cpu_threads \(threads of the CPU Adam\).*=8"),
        ({"cpu_threads": 0}, ValueError, "cpu_threads .* must be a positive int"),
        ({"gpu_tail": "2"}, ValueError, "gpu_tail must be a non-negative int or 'auto'"),
    ],
)
def test_wrong_option_is_a_clear_error(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        _build(_linear().parameters(), **kwargs)


def _train_both(make_params, steps=3, **kwargs):
    """Train a Linear with SuperOffload and with AdamW + clip_grad_norm_; return both."""
    from engine_reference import RunConfig

    cfg = RunConfig(lr=1e-2, weight_decay=0.1, eps=1e-4, max_grad_norm=1.0)
    models = [_linear(), _linear()]
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    opt = _build(
        make_params(models[0]),
        lr=cfg.lr,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        max_grad_norm=1.0,
        bucket_size=8,
        **kwargs,
    )
    ref = torch.optim.AdamW(make_params(models[1]), lr=cfg.lr, eps=cfg.eps, weight_decay=0.1)
    with opt:
        for _ in range(steps):
            for model, o in zip(models, (opt, ref), strict=True):
                model(x).square().mean().backward()
                if o is ref:
                    torch.nn.utils.clip_grad_norm_(
                        [p for p in model.parameters() if p.grad is not None], 1.0
                    )
                o.step()
                o.zero_grad()
        opt.synchronize()
    return models


def test_gpu_tail_larger_than_the_buckets_means_all():
    a, b = _train_both(lambda m: m.parameters(), gpu_tail=100)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


def test_frozen_params_are_left_alone_as_adamw_does():
    def params(model):
        model.bias.requires_grad_(False)
        return model.parameters()

    a, b = _train_both(params)
    assert torch.equal(a.bias, _linear().bias)
    torch.testing.assert_close(a.weight, b.weight, rtol=1e-5, atol=1e-7)


def test_a_param_listed_twice_is_refused():
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"lists a param .* twice; list each param once"):
        _build([p, p])
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        _build([{"params": [p]}, {"params": [p]}])  # AdamW's own error


def test_params_on_mixed_devices():
    a = torch.nn.Parameter(torch.zeros(3))
    b = torch.nn.Parameter(torch.zeros(3, device="meta"))
    with pytest.raises(ValueError, match=r"one device.*model.to\(device\)"):
        _build([a, b])
    with pytest.raises(ValueError, match=r"CUDA device or the CPU, got meta. Move the model"):
        _build([b])


def test_complex_params_are_refused_with_what_to_do():
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"float32, bfloat16 or float16.*torch.optim.AdamW"):
        _build([p])


def test_sparse_gradients_are_refused_with_what_to_do():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    with _build(emb.parameters(), bucket_size=64) as opt:
        with pytest.raises(RuntimeError, match=r"sparse gradient.*sparse=False.*SparseAdam"):
            emb(torch.tensor([1, 2])).sum().backward()
        del opt
