"""Compact moments' speculative pass on the GPU (engine/device_speculation.py): the params it
writes into the model are the CPU kernel's speculative pass's (``ops.compact_adam`` with
``commit=False``), bit for bit, over several params cut into staged pieces, and the host state
stays as it was. The GPU tests run on the device machine: ``python -m pytest -m gpu``."""

from __future__ import annotations

import pytest
import torch

from hf_superoffload import ops
from hf_superoffload.engine import device_speculation
from hf_superoffload.engine.compact_moments import CompactMoments
from hf_superoffload.engine.device_speculation import (
    DeviceSpeculation,
    device_speculation_bytes,
    staging_buffers,
)
from hf_superoffload.engine.link import Link
from hf_superoffload.engine.partition import HostPartition

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def test_the_planned_bytes_are_the_staging_buffers_allocated():
    for largest, dtype in ((1000, torch.bfloat16), (3 << 24, torch.float32), (300, torch.float16)):
        made = staging_buffers(largest, dtype, "cpu")
        assert device_speculation_bytes(largest, dtype) == sum(
            t.numel() * t.element_size() for t in made.values()
        )
    assert device_speculation_bytes(0, torch.bfloat16) == 0


def test_a_cpu_link_is_refused():
    with pytest.raises(ValueError, match="CUDA link"):
        DeviceSpeculation(Link(torch.device("cpu")), 1000, torch.bfloat16)


def _partition(link: Link, spans, numel: int, grad_dtype, out_dtype) -> HostPartition:
    gen = torch.Generator().manual_seed(0)
    master = link.host_empty(numel, torch.float32)
    master.copy_(torch.randn(numel, generator=gen))
    grad = link.host_empty(numel, grad_dtype)
    grad.copy_(torch.randn(numel, generator=gen) * 1e-2)
    grad[5] = float("nan")  # a non-finite gradient term keeps its param
    flat_param = torch.zeros(numel, dtype=out_dtype, device=link.device)
    part = HostPartition(0, 0, master, None, None, grad, None, flat_param)
    salts = [7 + i for i in range(len(spans))]
    part.compact = CompactMoments(spans, salts, numel, empty=link.host_empty)
    moments = part.compact
    for codes in (moments.exp_avg, moments.exp_avg_sq):
        codes.copy_(torch.randint(0, 256, (numel,), generator=gen, dtype=torch.uint8))
    for scales in (moments.exp_avg_scale, moments.exp_avg_sq_scale):
        scales.copy_(torch.rand(scales.numel(), generator=gen) * 1e-2)
    return part


@pytest.mark.gpu
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_the_gpu_writes_the_cpu_kernels_speculative_params(grad_dtype, out_dtype, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    # Pieces of 2 blocks: params cut into several staged pieces, and one piece a param.
    monkeypatch.setattr(device_speculation, "DEVICE_SPECULATION_PIECE", 512)
    link = Link(torch.device("cuda", torch.cuda.current_device()))
    spans = [(0, 1300), (1300, 256), (1600, 7)]  # padding between the second and third
    part = _partition(link, spans, 1700, grad_dtype, out_dtype)
    host_state = [part.master.clone(), *(t.clone() for t in part.compact.tensors())]
    speculation = DeviceSpeculation(link, part.numel, grad_dtype)
    assert speculation.serves(part)
    other = torch.float32 if grad_dtype == torch.bfloat16 else torch.bfloat16
    assert not DeviceSpeculation(link, part.numel, other).serves(part)  # staged as it lands
    runs = [(0, 1556, 4), (1600, 7, 2)]  # two runs at their own update numbers
    copied = speculation.speculate(part, HYPER, 0.5, runs, part.host_grad)
    torch.cuda.synchronize()

    expected = torch.zeros(part.numel, dtype=out_dtype)
    for (offset, numel, step), (index, segment) in zip(
        [(0, 1300, 4), (1300, 256, 4), (1600, 7, 2)], enumerate(part.compact.segments), strict=True
    ):
        ops.compact_adam(
            part.master.narrow(0, offset, numel), part.host_grad.narrow(0, offset, numel),
            *part.compact.param_moments(index), step=step, grad_scale=0.5, salt=segment.salt,
            commit=False, out_lowp=expected.narrow(0, offset, numel), **HYPER,
        )  # fmt: skip
    got = part.flat_param.cpu()
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))  # NaN bits too
    after = [part.master, *part.compact.tensors()]
    assert all(torch.equal(a, b) for a, b in zip(after, host_state, strict=True))
    grad_bytes = part.host_grad.element_size()
    assert copied == sum(n * (4 + grad_bytes + 2) for n in (1556, 7)) + 4 * 2 * (7 + 1)
    assert part.last_h2d is part.h2d_event is not None
