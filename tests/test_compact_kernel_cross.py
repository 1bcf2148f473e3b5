"""The aarch64 compact-state kernels (NEON, SVE at 128, 384 and 512 bits) give the x86 build's
results bit for bit (and the x86 build gives compact_adam_pass's: tests/test_compact_kernel.py).

As tests/test_cpu_adam_cross.py does for the exact kernel: the torch-free kernel sources are
cross-compiled with g++-aarch64-linux-gnu into tests/csrc/compact_check.cpp and run under
qemu-aarch64; skipped where those tools are missing (CI installs them).
"""

from __future__ import annotations

import struct
import subprocess
from pathlib import Path

import pytest
import torch
from cross_tools import tool
from test_compact_kernel import COMPACT_FUNCTION, fused_multiply_adds

from hf_superoffload import ops
from hf_superoffload.ops._build import CFLAGS, CSRC
from hf_superoffload.ops.compact import constants
from hf_superoffload.ops.compact_state import BLOCK, CompactMoments

CHECK_SOURCE = Path(__file__).parent / "csrc" / "compact_check.cpp"
KERNEL_SOURCES = [CSRC / f"isa_{name}.cpp" for name in ("scalar", "neon", "sve")]
KERNEL_SOURCES += [CSRC / "dispatch.cpp", CSRC / "compact_dispatch.cpp"]
KIND = {None: 0, torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}  # compact_types.h
HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
N = 4 * BLOCK + 37  # a short last block, and tails of every vector length

# (step, commit, grad dtype, out dtype, adamw, stochastic, grad_scale, salt, element_offset)
SCENARIO = [
    (1, False, torch.bfloat16, torch.bfloat16, True, True, 1.0, 5, 0),
    (1, True, torch.bfloat16, None, True, True, 1.0, 5, 0),
    (2, True, torch.float16, torch.float16, False, False, 3.0, 0, 2 * BLOCK),
    (3, False, torch.float32, torch.float32, True, True, 0.7, 2**40 + 3, 0),
    (3, True, torch.float32, torch.bfloat16, True, True, 0.7, 2**40 + 3, 0),
    (4, True, torch.bfloat16, torch.float16, True, True, 1.0, 7, 2**32 - 2 * BLOCK),
]


def _inputs() -> tuple[torch.Tensor, torch.Tensor, CompactMoments]:
    """Master, a gradient with magnitudes from 1e-12 to 1e2 in every block but two of tiny
    ones (moments whose scale's reciprocal overflows: their codes divide), NaN, +-Inf, an
    overflowing square and an all-zero block; zero moments."""
    gen = torch.Generator().manual_seed(7)
    master = torch.randn(N, generator=gen)
    grad = torch.randn(N, generator=gen) * 10.0 ** (torch.rand(N, generator=gen) * 14 - 12)
    for block, largest in ((2, 1e-19), (4, 1e-38)):  # the second moments', the first's
        tiny = grad[block * BLOCK : (block + 1) * BLOCK]
        tiny *= largest / tiny.abs().amax()
    grad[::97] = float("nan")
    grad[5::101] = float("inf")
    grad[7::103] = float("-inf")
    grad[11::107] = 1e30
    grad[BLOCK : 2 * BLOCK] = 0.0
    return master, grad, CompactMoments.zeros(N)


def _state_bytes(master: torch.Tensor, m: CompactMoments) -> bytes:
    tensors = (master, m.exp_avg, m.exp_avg_scale, m.exp_avg_sq, m.exp_avg_sq_scale)
    return b"".join(t.numpy().tobytes() for t in tensors)  # x86 and aarch64: little-endian


def _write_input(path: Path) -> None:
    master, grad, moments = _inputs()
    records = b""
    for step, commit, grad_dtype, out, adamw, stochastic, scale, salt, offset in SCENARIO:
        args = constants(step, **HYPER, grad_scale=scale, salt=salt)
        records += struct.pack(
            "<ii10f3I3i", KIND[grad_dtype], KIND[out], *args, offset & 0xFFFFFFFF,
            int(adamw), int(stochastic), int(commit),
        )  # fmt: skip
    arrays = master.numpy().tobytes() + grad.numpy().tobytes()
    for dtype in (torch.bfloat16, torch.float16):
        arrays += grad.to(dtype).view(torch.int16).numpy().tobytes()
    moments = (moments.exp_avg, moments.exp_avg_scale, moments.exp_avg_sq,
               moments.exp_avg_sq_scale)  # fmt: skip
    arrays += b"".join(t.numpy().tobytes() for t in moments)
    path.write_bytes(struct.pack("<qq", N, len(SCENARIO)) + records + arrays)


def _run_x86() -> bytes:
    master, grad, m = _inputs()
    result = b""
    for step, commit, grad_dtype, out, adamw, stochastic, scale, salt, offset in SCENARIO:
        buffer = None if out is None else torch.empty(N, dtype=out)
        count = ops.compact_adam(
            master, grad.to(grad_dtype), m.exp_avg, m.exp_avg_scale, m.exp_avg_sq,
            m.exp_avg_sq_scale, step=step, **HYPER, adamw=adamw, grad_scale=scale, salt=salt,
            element_offset=offset, stochastic=stochastic, commit=commit, out_lowp=buffer,
        )  # fmt: skip
        result += struct.pack("<q", count)
        if buffer is not None:
            result += (
                buffer.view(torch.int32 if out == torch.float32 else torch.int16).numpy().tobytes()
            )
    return result + _state_bytes(master, m)


@pytest.fixture(scope="module")
def aarch64_compact_check(tmp_path_factory) -> Path:
    compiler = tool("aarch64-linux-gnu-g++")
    binary = tmp_path_factory.mktemp("aarch64") / "compact_check"
    flags = [f for f in CFLAGS if f != "-std=c++17"]
    cmd = [compiler, "-std=c++17", *flags, "-static", f"-I{CSRC}", str(CHECK_SOURCE)]
    subprocess.run([*cmd, *map(str, KERNEL_SOURCES), "-o", str(binary)], check=True)
    return binary


def test_the_aarch64_compact_kernels_have_no_fused_multiply_add(aarch64_compact_check):
    disassembly = subprocess.run(
        [tool("aarch64-linux-gnu-objdump"), "-d", "-C", "--no-show-raw-insn",
         str(aarch64_compact_check)], capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    functions = {line for line in disassembly.splitlines() if COMPACT_FUNCTION.search(line)}
    assert any("SveIsa" in f for f in functions) and any("NeonIsa" in f for f in functions)
    assert fused_multiply_adds(disassembly) == []
    assert "fmla" in disassembly or "fmadd" in disassembly  # the exact kernel's and libc's


@pytest.mark.parametrize(
    ("isa", "cpu"),
    [
        ("scalar", "max"),
        ("neon", "max,sve=off"),
        ("sve", "max,sve128=on"),  # NVIDIA Grace's vector length
        ("sve", "max,sve384=on"),  # 12 lanes: a vector tail inside every block
        ("sve", "max,sve512=on"),
    ],
)
def test_aarch64_compact_kernels_match_x86_bit_for_bit(aarch64_compact_check, tmp_path, isa, cpu):
    assert "-ffp-contract=off" in CFLAGS  # the reference rounds every product and sum
    qemu = tool("qemu-aarch64")
    _write_input(tmp_path / "in.bin")
    run = [qemu, "-cpu", cpu, str(aarch64_compact_check), isa]
    result = subprocess.run(
        [*run, str(tmp_path / "in.bin"), str(tmp_path / "out.bin")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    expected = _run_x86()
    assert struct.unpack_from("<q", expected)[0] > 0  # the non-finite path ran
    got = (tmp_path / "out.bin").read_bytes()
    assert len(got) == len(expected)
    assert got == expected
