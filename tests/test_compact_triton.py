"""The GPU tail's compact update (ops.compact_triton: one Triton kernel) against the
plain-PyTorch reference (compact_adamw.compact_adam_pass) on the same GPU: params, codes and
scales of both moments and the rounded params, bit for bit, through commits and speculative
passes, stochastic and nearest rounding, AdamW and L2, fp32/bf16/fp16 gradients and outputs,
non-finite gradients, subnormal codes, short blocks and a partition offset."""

from __future__ import annotations

import pytest
import torch

from hf_superoffload.ops.compact_adamw import compact_adam_pass
from hf_superoffload.ops.compact_format import CompactMoments
from hf_superoffload.ops.compact_triton import compact_adam_pass_cuda

HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _run(n, grad_dtype, out_dtype, *, stochastic=True, adamw=True, spec_last=False,
         gradients="normal", offset=0, steps=4):  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(n)
    master = torch.randn(n, device="cuda", generator=gen)
    moments = CompactMoments.zeros(n, device="cuda")
    state = [moments.exp_avg, moments.exp_avg_scale, moments.exp_avg_sq, moments.exp_avg_sq_scale]
    ref = [master.clone(), *(t.clone() for t in state)]
    ours = [master.clone(), *(t.clone() for t in state)]
    for step in range(1, steps + 1):
        g = torch.randn(n, device="cuda", generator=gen)
        if gradients == "tiny":  # moments far below their block's largest: subnormal codes
            g[1::3] *= 1e-12
        if gradients == "non-finite":
            g[::7], g[3::11] = float("nan"), float("inf")
        g = g.to(grad_dtype)
        commit = not (spec_last and step == steps)
        kwargs = dict(step=step, adamw=adamw, grad_scale=0.7, salt=5, element_offset=offset,
                      stochastic=stochastic, commit=commit, **HYPER)  # fmt: skip
        out_ref = torch.empty(n, dtype=out_dtype, device="cuda")
        out_ours = torch.empty(n, dtype=out_dtype, device="cuda")
        compact_adam_pass(ref[0], g, *ref[1:], out_lowp=out_ref, **kwargs)
        compact_adam_pass_cuda(ours[0], g, *ours[1:], out_lowp=out_ours, **kwargs)
        names = ("master", "exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale", "out")
        for name, a, b in zip(names, [*ref, out_ref], [*ours, out_ours], strict=True):
            assert torch.equal(_bits(a), _bits(b)), (name, step, (a != b).sum().item())


CASES = {
    "fp32 grad, bf16 out": dict(n=5000, grad_dtype=torch.float32, out_dtype=torch.bfloat16),
    "bf16 grad": dict(n=3 * 256, grad_dtype=torch.bfloat16, out_dtype=torch.bfloat16),
    "fp16 grad, fp16 out": dict(n=1000, grad_dtype=torch.float16, out_dtype=torch.float16),
    "fp32 out, L2": dict(n=777, grad_dtype=torch.float32, out_dtype=torch.float32, adamw=False),
    "nearest": dict(n=4097, grad_dtype=torch.bfloat16, out_dtype=torch.bfloat16, stochastic=False),
    "speculative pass": dict(
        n=2500, grad_dtype=torch.bfloat16, out_dtype=torch.bfloat16, spec_last=True
    ),
    "non-finite": dict(
        n=3000, grad_dtype=torch.float32, out_dtype=torch.bfloat16, gradients="non-finite"
    ),
    "subnormal codes": dict(
        n=3000, grad_dtype=torch.float32, out_dtype=torch.bfloat16, gradients="tiny"
    ),
    "subnormal codes, nearest": dict(
        n=3000,
        grad_dtype=torch.float32,
        out_dtype=torch.bfloat16,
        gradients="tiny",
        stochastic=False,
    ),
    "offset": dict(n=700, grad_dtype=torch.float32, out_dtype=torch.bfloat16, offset=256 * 10**7),
    "large": dict(n=(1 << 22) + 300, grad_dtype=torch.bfloat16, out_dtype=torch.bfloat16, steps=2),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_the_triton_kernel_gives_the_references_bits(case):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _run(**CASES[case])


def test_it_refuses_tensors_off_the_gpu_and_a_speculative_pass_without_output():
    t = torch.zeros(256)
    moments = CompactMoments.zeros(256)
    state = [moments.exp_avg, moments.exp_avg_scale, moments.exp_avg_sq, moments.exp_avg_sq_scale]
    with pytest.raises(ValueError, match="contiguous CUDA tensors"):
        compact_adam_pass_cuda(t, t, *state, step=1, **HYPER)
    with pytest.raises(ValueError, match="writes only out_lowp"):
        compact_adam_pass_cuda(t, t, *state, step=1, commit=False, **HYPER)
