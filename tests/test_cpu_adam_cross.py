"""The aarch64 kernels (NEON, SVE at 128 and 512 bits) give the x86 build's results bit for bit.

No ARM machine is lent here, so the torch-free kernel sources are cross-compiled with
g++-aarch64-linux-gnu into tests/csrc/kernel_check.cpp and run under qemu-aarch64. CI installs
both tools (.ci/run); elsewhere the test is skipped when they are missing.
"""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import pytest
import torch
from cross_tools import build_aarch64, run_aarch64, tool

from hf_superoffload import ops
from hf_superoffload.ops._build import CSRC
from hf_superoffload.ops.adam import _constants

CHECK_SOURCE = Path(__file__).parent / "csrc" / "kernel_check.cpp"
KERNEL_SOURCES = [CSRC / f"isa_{name}.cpp" for name in ("scalar", "avx2", "avx512", "neon", "sve")]
KERNEL_SOURCES.append(CSRC / "dispatch.cpp")
OP_STEP, OP_ROLLBACK, OP_REPLAY = 0, 1, 2
LOWP_NONE, LOWP_BF16, LOWP_FP16 = 0, 1, 2

# (op, lowp, grad kind, step, adamw, scale, new_scale): step with bf16 copy-out, a clip replay
# with fp16 copy-out, its rollback, an L2-Adam step, then steps reading bf16 and fp16 grads.
SCENARIO = [
    (OP_STEP, LOWP_BF16, LOWP_NONE, 3, True, 0.7, 0.0),
    (OP_REPLAY, LOWP_FP16, LOWP_NONE, 3, True, 0.7, 0.2),
    (OP_ROLLBACK, LOWP_NONE, LOWP_NONE, 3, True, 0.2, 0.0),
    (OP_STEP, LOWP_NONE, LOWP_NONE, 4, False, 1.3, 0.0),
    (OP_STEP, LOWP_BF16, LOWP_BF16, 5, True, 0.9, 0.0),
    (OP_REPLAY, LOWP_NONE, LOWP_FP16, 5, False, 0.9, 0.4),
]
GRAD_DTYPE = {LOWP_NONE: torch.float32, LOWP_BF16: torch.bfloat16, LOWP_FP16: torch.float16}
HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}


def _inputs(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    param = torch.randn(n, generator=gen)
    grad = torch.randn(n, generator=gen) * torch.logspace(-8, 3, n)
    grad[::97] = float("nan")
    grad[5::101] = float("inf")
    exp_avg = torch.randn(n, generator=gen) * 1e-2
    exp_avg_sq = torch.rand(n, generator=gen) * 1e-3
    return [param, grad, exp_avg, exp_avg_sq]


def _write_input(path: Path, tensors: list[torch.Tensor]) -> None:
    n = tensors[0].numel()
    records = b""
    for op, lowp, grad_kind, step, adamw, scale, new_scale in SCENARIO:
        constants = _constants(step, **HYPER, adamw=adamw, bias_correction=True, undoing=True)
        step_size, rsqrt_bc2, beta1, beta2, eps, weight_decay, decay = constants
        args = (step_size, rsqrt_bc2, beta1, beta2, 1.0 - beta1, 1.0 - beta2, eps, weight_decay)
        records += struct.pack(
            "<iii11fi", op, lowp, grad_kind, *args, decay, scale, new_scale, int(adamw)
        )
    arrays = b"".join(t.numpy().astype("<f4").tobytes() for t in tensors)
    grad = tensors[1]
    for dtype in (torch.bfloat16, torch.float16):
        arrays += grad.to(dtype).view(torch.int16).numpy().astype("<i2").tobytes()
    path.write_bytes(struct.pack("<qq", n, len(SCENARIO)) + records + arrays)


def _run_x86(tensors: list[torch.Tensor]) -> bytes:
    param, grad, exp_avg, exp_avg_sq = (t.clone() for t in tensors)
    out = b""
    for op, lowp, grad_kind, step, adamw, scale, new_scale in SCENARIO:
        low = {LOWP_BF16: torch.bfloat16, LOWP_FP16: torch.float16}.get(lowp)
        buf = torch.empty(param.numel(), dtype=low) if low is not None else None
        state = (param, grad.to(GRAD_DTYPE[grad_kind]), exp_avg, exp_avg_sq)
        if op == OP_STEP:
            skipped = ops.adam_step(
                *state, step=step, **HYPER, adamw=adamw, grad_scale=scale, out_lowp=buf
            )
        elif op == OP_REPLAY:
            skipped = ops.adam_replay(
                *state,
                step=step,
                **HYPER,
                adamw=adamw,
                old_grad_scale=scale,
                new_grad_scale=new_scale,
                out_lowp=buf,
            )
        else:
            skipped = ops.adam_rollback(*state, step=step, **HYPER, adamw=adamw, grad_scale=scale)
        out += struct.pack("<q", skipped)
        if buf is not None:
            out += buf.view(torch.int16).numpy().tobytes()
    return out + b"".join(t.numpy().astype("<f4").tobytes() for t in (param, exp_avg, exp_avg_sq))


@pytest.fixture(scope="module")
def aarch64_check_binary(tmp_path_factory) -> Path:
    binary = tmp_path_factory.mktemp("aarch64") / "kernel_check"
    return build_aarch64(CHECK_SOURCE, KERNEL_SOURCES, binary)


@pytest.mark.parametrize(
    ("isa", "cpu"),
    [
        ("scalar", "max"),
        ("neon", "max,sve=off"),
        ("sve", "max,sve128=on"),  # NVIDIA Grace's vector length
        ("sve", "max,sve512=on"),
    ],
)
def test_aarch64_kernels_match_x86_bit_for_bit(aarch64_check_binary, tmp_path, isa, cpu):
    n = 4099  # not a multiple of any vector length: the scalar tail runs too
    tensors = _inputs(n)
    _write_input(tmp_path / "in.bin", tensors)
    result = run_aarch64(
        aarch64_check_binary, cpu, isa, str(tmp_path / "in.bin"), str(tmp_path / "out.bin")
    )
    assert result.returncode == 0, result.stderr
    expected = _run_x86(tensors)
    got = (tmp_path / "out.bin").read_bytes()
    assert len(got) == len(expected)
    # The scenario must have exercised the non-finite path (skipped counts are in the output).
    assert struct.unpack_from("<q", expected)[0] > 0
    assert got == expected


def test_sve_is_refused_on_a_cpu_without_it(aarch64_check_binary, tmp_path):
    qemu = tool("qemu-aarch64")
    _write_input(tmp_path / "in.bin", _inputs(16))
    result = subprocess.run(
        [
            qemu,
            "-cpu",
            "max,sve=off",
            str(aarch64_check_binary),
            "sve",
            str(tmp_path / "in.bin"),
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 3
    assert "best: neon" in result.stderr
