"""The aarch64 compact-state kernels (NEON, SVE at 128, 384 and 512 bits) give the x86 build's
results bit for bit (and the x86 build gives compact_adam_pass's: tests/test_compact_kernel.py),
the plain passes and the fused commit-and-speculate pass (tests/test_compact_fused.py).

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
from cross_tools import build_aarch64, run_aarch64, tool
from test_compact_kernel import COMPACT_FUNCTION, fused_multiply_adds

from hf_superoffload import ops
from hf_superoffload.ops._build import CFLAGS, CSRC
from hf_superoffload.ops.compact import constants
from hf_superoffload.ops.compact_format import BLOCK, CompactMoments

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
# Fused passes after those (commit step; the speculative step is the next; each half's lr
# and grad_scale): (step, grad dtype, out dtype, adamw, stochastic, keep_new_grad, commit
# (lr, grad_scale), speculate (lr, grad_scale), salt, element_offset)
FUSED = [
    (5, torch.bfloat16, torch.bfloat16, True, True, True, (1e-3, 1.0), (2e-3, 0.5), 5, 0),
    (6, torch.bfloat16, torch.float32, True, True, False, (2e-3, 0.5), (1e-3, 2.0), 5, 0),
    (6, torch.float16, torch.float16, False, False, True, (1e-3, 3.0), (1e-3, 1.0), 0, 2 * BLOCK),
    (7, torch.float32, torch.bfloat16, True, True, True, (1e-3, 0.7), (5e-4, 0.7), 2**40 + 3,
     2**32 - 2 * BLOCK),
]  # fmt: skip


def _fused_halves(step, commit, speculate) -> tuple[dict, dict]:
    def half(step, lr_scale):
        lr, grad_scale = lr_scale
        return {**HYPER, "lr": lr, "step": step, "grad_scale": grad_scale}

    return half(step, commit), half(step + 1, speculate)


def _gradient(seed: int) -> torch.Tensor:
    """Magnitudes from 1e-12 to 1e2 in every block but two of tiny ones (moments whose scale's
    reciprocal overflows: their codes divide), NaN, +-Inf, an overflowing square and an
    all-zero block."""
    gen = torch.Generator().manual_seed(seed)
    grad = torch.randn(N, generator=gen) * 10.0 ** (torch.rand(N, generator=gen) * 14 - 12)
    for block, largest in ((2, 1e-19), (4, 1e-38)):  # the second moments', the first's
        tiny = grad[block * BLOCK : (block + 1) * BLOCK]
        tiny *= largest / tiny.abs().amax()
    grad[::97] = float("nan")
    grad[5::101] = float("inf")
    grad[7::103] = float("-inf")
    grad[11::107] = 1e30
    grad[BLOCK : 2 * BLOCK] = 0.0
    return grad


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, CompactMoments]:
    """Master, a gradient, the fused passes' new gradient (other values, NaNs elsewhere) and
    zero moments."""
    master = torch.randn(N, generator=torch.Generator().manual_seed(7))
    return master, _gradient(8), _gradient(9).roll(3), CompactMoments.zeros(N)


def _state_bytes(master: torch.Tensor, m: CompactMoments) -> bytes:
    tensors = (master, m.exp_avg, m.exp_avg_scale, m.exp_avg_sq, m.exp_avg_sq_scale)
    return b"".join(t.numpy().tobytes() for t in tensors)  # x86 and aarch64: little-endian


def _pack_args(step, hyper: dict, adamw, stochastic, commit, salt, offset) -> bytes:
    args = constants(step, **hyper, salt=salt)
    return struct.pack("<10f3I3i", *args, offset & 0xFFFFFFFF, int(adamw), int(stochastic),
                       int(commit))  # fmt: skip


def _write_input(path: Path) -> None:
    master, grad, grad_new, moments = _inputs()
    records = b""
    for step, commit, grad_dtype, out, adamw, stochastic, scale, salt, offset in SCENARIO:
        records += struct.pack("<ii", KIND[grad_dtype], KIND[out])
        records += _pack_args(step, {**HYPER, "grad_scale": scale}, adamw, stochastic, commit,
                              salt, offset)  # fmt: skip
    for step, grad_dtype, out, adamw, stochastic, keep, c, sp, salt, offset in FUSED:
        records += struct.pack("<iii", KIND[grad_dtype], KIND[out], int(keep))
        for half, is_commit in zip(_fused_halves(step, c, sp), (True, False), strict=True):
            hyper = {k: v for k, v in half.items() if k != "step"}
            records += _pack_args(half["step"], hyper, adamw, stochastic, is_commit, salt, offset)
    arrays = master.numpy().tobytes()
    for g in (grad, grad_new):
        arrays += g.numpy().tobytes()
        for dtype in (torch.bfloat16, torch.float16):
            arrays += g.to(dtype).view(torch.int16).numpy().tobytes()
    moments = (moments.exp_avg, moments.exp_avg_scale, moments.exp_avg_sq,
               moments.exp_avg_sq_scale)  # fmt: skip
    arrays += b"".join(t.numpy().tobytes() for t in moments)
    header = struct.pack("<qqq", N, len(SCENARIO), len(FUSED))
    path.write_bytes(header + records + arrays)


def _raw(t: torch.Tensor) -> bytes:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16).numpy().tobytes()


def _run_x86() -> bytes:
    master, grad, grad_new, m = _inputs()
    state = (m.exp_avg, m.exp_avg_scale, m.exp_avg_sq, m.exp_avg_sq_scale)
    result = b""
    for step, commit, grad_dtype, out, adamw, stochastic, scale, salt, offset in SCENARIO:
        buffer = None if out is None else torch.empty(N, dtype=out)
        count = ops.compact_adam(
            master, grad.to(grad_dtype), *state, step=step, **HYPER, adamw=adamw,
            grad_scale=scale, salt=salt, element_offset=offset, stochastic=stochastic,
            commit=commit, out_lowp=buffer,
        )  # fmt: skip
        result += struct.pack("<q", count)
        if buffer is not None:
            result += _raw(buffer)
    pending = {dtype: grad.to(dtype) for dtype in (torch.float32, torch.bfloat16, torch.float16)}
    for step, grad_dtype, out, adamw, stochastic, keep, c, sp, salt, offset in FUSED:
        buffer = torch.empty(N, dtype=out)
        commit_half, speculate_half = _fused_halves(step, c, sp)
        counts = ops.compact_adam_commit_speculate(
            master, pending[grad_dtype], grad_new.to(grad_dtype), *state, commit=commit_half,
            speculate=speculate_half, adamw=adamw, salt=salt, element_offset=offset,
            stochastic=stochastic, out_lowp=buffer, keep_new_grad=keep,
        )  # fmt: skip
        result += struct.pack("<qq", *counts) + _raw(buffer) + _raw(pending[grad_dtype])
    return result + _state_bytes(master, m)


@pytest.fixture(scope="module")
def aarch64_compact_check(tmp_path_factory) -> Path:
    binary = tmp_path_factory.mktemp("aarch64") / "compact_check"
    return build_aarch64(CHECK_SOURCE, KERNEL_SOURCES, binary)


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
    _write_input(tmp_path / "in.bin")
    result = run_aarch64(
        aarch64_compact_check, cpu, isa, str(tmp_path / "in.bin"), str(tmp_path / "out.bin")
    )
    assert result.returncode == 0, result.stderr
    expected = _run_x86()
    assert struct.unpack_from("<q", expected)[0] > 0  # the non-finite path ran
    got = (tmp_path / "out.bin").read_bytes()
    assert len(got) == len(expected)
    assert got == expected
