"""The compiled compact-state Adam (ops.compact_adam) gives compact_adamw.compact_adam_pass's
bits: params, codes, scales, out_lowp and the non-finite count, for every instruction set of
this CPU and 1 or 2 threads, over sequences of speculative and committed steps.

The reference rounds its square root once (``compact_format.ieee_sqrt``), as the kernel, every
other instruction set and the GPU do; torch's own CPU ``sqrt`` does not.
"""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess
import threading
import time

import numpy
import pytest
import torch

from hf_superoffload import ops
from hf_superoffload.ops import _build, compact_adamw
from hf_superoffload.ops.compact import constants
from hf_superoffload.ops.compact_format import BLOCK, CompactMoments, ieee_sqrt

HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
# Two chunks of 64K elements that two threads share, three blocks, and a short last block.
N_THREADED = 2 * 65536 + 3 * BLOCK + 37


def reference(*args, **kwargs) -> int:
    return compact_adamw.compact_adam_pass(*args, **kwargs)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(
        {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()]
    )


def same_bits_up_to_nan_payload(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits, except that a NaN may have other bits (a cast's own: torch's CPU cast to
    bf16 gives 0xFFFF, the kernel 0x7FC0)."""
    if a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(bits(a)[~nan], bits(b)[~nan])


def assert_same_bits(got: list, expected: list, label: object = "") -> None:
    assert len(got) == len(expected)
    for index, (a, b) in enumerate(zip(got, expected, strict=True)):
        if isinstance(b, torch.Tensor):
            assert same_bits_up_to_nan_payload(a, b), f"{label}: output {index} differs"
        else:
            assert a == b, f"{label}: output {index}: {a} != {b}"


def gradient(n: int, step: int) -> torch.Tensor:
    """Magnitudes from 1e-12 to 1e2 inside every block (so both moments take subnormal and
    zero codes), an all-zero block, two blocks of tiny gradients (second moments, then first
    moments, of a scale below 2**-128, whose reciprocal overflows: their codes divide), NaN,
    +-Inf, 1e30 (its square overflows: skipped) and 3e19 (a finite square near the top of
    fp32)."""
    gen = torch.Generator().manual_seed(100 + step)
    g = torch.randn(n, generator=gen) * 10.0 ** (torch.rand(n, generator=gen) * 14 - 12)
    for block, largest in ((2, 1e-19), (4, 1e-38)):
        tiny = g[block * BLOCK : (block + 1) * BLOCK]
        tiny *= largest / tiny.abs().amax() if tiny.numel() else 1.0
    g[::97] = float("nan")
    g[5::101] = float("inf")
    g[7::103] = float("-inf")
    g[11::107] = 1e30
    g[3 * BLOCK + 13 : 3 * BLOCK + 15] = -3e19  # one block's scales near the top of fp32
    g[BLOCK : 2 * BLOCK] = 0.0
    return g


def initial_state(n: int) -> list[torch.Tensor]:
    master = torch.randn(n, generator=torch.Generator().manual_seed(1))
    moments = CompactMoments.zeros(n)
    return [master, moments.exp_avg, moments.exp_avg_scale, moments.exp_avg_sq,
            moments.exp_avg_sq_scale]  # fmt: skip


# A step: a speculative pass (out_lowp of spec_out) then the commit (out_lowp of commit_out).
SCENARIOS = {
    "adamw-bf16-grad-stochastic": dict(
        grad=torch.bfloat16, spec_out=torch.bfloat16, commit_out=None, stochastic=True,
        adamw=True, grad_scale=0.7, salt=5, element_offset=0,
    ),
    "l2-adam-fp16-grad-nearest": dict(
        grad=torch.float16, spec_out=torch.float16, commit_out=torch.float16, stochastic=False,
        adamw=False, grad_scale=3.0, salt=0, element_offset=2 * BLOCK,
    ),
    "fp32-grad-fp32-out-wrapping-index": dict(
        grad=torch.float32, spec_out=torch.float32, commit_out=torch.bfloat16, stochastic=True,
        adamw=True, grad_scale=1.0, salt=2**40 + 3, element_offset=2**32 - 2 * BLOCK,
    ),
}  # fmt: skip


def run_steps(passes, scenario: dict, n: int, steps: int = 4, hyper: dict = HYPER) -> list:
    """Outputs of ``steps`` speculative + committed steps with ``passes`` (the reference or
    the kernel): each pass's count and out_lowp, then the state after each commit."""
    state = initial_state(n)
    hyper = {**hyper, "adamw": scenario["adamw"], "grad_scale": scenario["grad_scale"],
             "salt": scenario["salt"], "element_offset": scenario["element_offset"],
             "stochastic": scenario["stochastic"]}  # fmt: skip
    outputs = []
    for step in range(1, steps + 1):
        grad = gradient(n, step).to(scenario["grad"])
        spec = torch.empty(n, dtype=scenario["spec_out"])
        outputs.append(passes(*state[:1], grad, *state[1:], step=step, **hyper, commit=False,
                              out_lowp=spec))  # fmt: skip
        outputs.append(spec)
        out = (
            None if scenario["commit_out"] is None else torch.empty(n, dtype=scenario["commit_out"])
        )
        outputs.append(passes(*state[:1], grad, *state[1:], step=step, **hyper, out_lowp=out))
        outputs.extend([out] if out is not None else [])
        outputs.extend(t.clone() for t in state)
    return outputs


def each_isa_and_thread_count():
    """(isa, threads) for every instruction set of this CPU, set while the caller runs."""
    threads_before = ops.get_num_threads()
    try:
        for isa, threads in itertools.product(ops.available_isas(), (1, 2)):
            ops.set_isa(isa)
            ops.set_num_threads(threads)
            yield isa, threads
    finally:
        ops.set_isa(None)
        ops.set_num_threads(threads_before)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_steps_equal_the_reference_bit_for_bit_on_every_isa_and_thread_count(name):
    scenario = SCENARIOS[name]
    expected = run_steps(reference, scenario, N_THREADED)
    counts = [x for x in expected if isinstance(x, int)]
    assert all(c > 0 for c in counts)  # the non-finite path ran in every pass
    codes = expected[-4]  # the last commit's exp_avg codes, then exp_avg_sq's
    assert ((codes & 0x7F) > 0).logical_and((codes & 0x7F) < 8).any()  # subnormal codes
    assert ((expected[-2] > 0) & (expected[-2] < 8)).any()
    if scenario["adamw"]:
        assert (expected[-1] == 0).any() and (expected[-3] == 0).any()  # the all-zero block
        for scales in (expected[-1], expected[-3]):  # blocks whose codes divide
            assert ((scales > 0) & (scales < 2.0**-128)).any()
    for isa, threads in each_isa_and_thread_count():
        got = run_steps(ops.compact_adam, scenario, N_THREADED)
        assert_same_bits(got, expected, (isa, threads))


def test_random_configurations_equal_the_reference_on_every_isa():
    """Sizes, offsets, hyperparameters, dtypes and rounding drawn at random, three steps each."""
    rng = torch.Generator().manual_seed(2026)

    def draw(*choices):
        return choices[int(torch.randint(len(choices), (), generator=rng))]

    def uniform(low, high):
        return low + (high - low) * torch.rand((), generator=rng).item()

    for _ in range(16):
        n = int(torch.randint(1, 4 * BLOCK, (), generator=rng))
        scenario = dict(
            grad=draw(torch.float32, torch.bfloat16, torch.float16),
            spec_out=draw(torch.float32, torch.bfloat16, torch.float16),
            commit_out=draw(None, torch.float32, torch.bfloat16, torch.float16),
            stochastic=draw(True, False), adamw=draw(True, False),
            grad_scale=uniform(0.0, 4.0), salt=int(torch.randint(2**31, (), generator=rng)),
            element_offset=BLOCK * int(torch.randint(2**24, (), generator=rng)),
        )  # fmt: skip
        hyper = dict(lr=10 ** uniform(-5, -1), beta1=uniform(0.0, 0.99),
                     beta2=uniform(0.9, 0.9999), eps=10 ** uniform(-12, -6),
                     weight_decay=draw(0.0, uniform(0.0, 0.2)))  # fmt: skip
        expected = run_steps(reference, scenario, n, steps=3, hyper=hyper)
        for isa_threads in each_isa_and_thread_count():
            got = run_steps(ops.compact_adam, scenario, n, steps=3, hyper=hyper)
            assert_same_bits(got, expected, (scenario, hyper, isa_threads))


def test_short_ranges_equal_the_reference_on_every_isa():
    """No elements, fewer than one vector, one short block, a block and a bit."""
    scenario = SCENARIOS["adamw-bf16-grad-stochastic"]
    for n in (0, 1, 5, 17, BLOCK - 1, BLOCK + 3):
        expected = run_steps(reference, scenario, n, steps=2)
        for isa_threads in each_isa_and_thread_count():
            got = run_steps(ops.compact_adam, scenario, n, steps=2)
            assert_same_bits(got, expected, (n, *isa_threads))


def test_block_aligned_pieces_equal_the_whole_pass():
    n = 5 * BLOCK + 37
    grad = gradient(n, 1).bfloat16()
    hyper = {**HYPER, "step": 1, "salt": 9}
    whole = initial_state(n)
    expected = [reference(whole[0], grad, *whole[1:], **hyper), *whole]
    for isa_threads in each_isa_and_thread_count():
        pieces = initial_state(n)
        counts = 0
        for lo, hi in itertools.pairwise([0, 2 * BLOCK, 3 * BLOCK, n]):
            blocks = slice(lo // BLOCK, -(-hi // BLOCK))
            counts += ops.compact_adam(
                pieces[0][lo:hi], grad[lo:hi], pieces[1][lo:hi], pieces[2][blocks],
                pieces[3][lo:hi], pieces[4][blocks], **hyper, element_offset=lo,
            )  # fmt: skip
        assert_same_bits([counts, *pieces], expected, isa_threads)


def test_an_overflowing_second_moment_gives_the_references_nans():
    """Gradients near 5e20 overflow exp_avg_sq to Inf (its block's scale, then NaN codes and
    params): master, codes and scales keep the reference's bits, NaNs included. out_lowp holds
    NaN where the reference's does; a NaN's bf16 bits are the cast's own (0x7FC0 here, torch's
    CPU cast gives 0xFFFF)."""
    n = 3 * BLOCK

    def run(passes):
        state, outputs = initial_state(n), []
        for step in range(1, 5):
            g = torch.randn(n, generator=torch.Generator().manual_seed(step))
            g[:300], g[600:610] = 5.5e20, -5e20
            out = torch.empty(n, dtype=torch.bfloat16)
            count = passes(state[0], g, *state[1:], step=step, **HYPER, out_lowp=out)
            outputs.append((count, out, [t.clone() for t in state]))
        return outputs

    expected = run(reference)
    assert expected[-1][2][4].isinf().any() and expected[-1][2][0].isnan().any()
    for isa_threads in each_isa_and_thread_count():
        for (count, out, state), (count_ref, out_ref, state_ref) in zip(
            run(ops.compact_adam), expected, strict=True
        ):
            assert count == count_ref
            for a, b in zip(state, state_ref, strict=True):  # NaNs included
                assert torch.equal(bits(a), bits(b)), isa_threads
            assert same_bits_up_to_nan_payload(out, out_ref)


# The compact kernel's functions (templates of compact_math.h, the span entry points) and the
# fused multiply-add instructions of x86 (vfmadd..., vfnmsub...) and aarch64 (fmadd, fmla, SVE
# fmad/fmsb...).
COMPACT_FUNCTION = re.compile(r"compact|encode|decode|rounding_bits|index_product|update_lanes")
FUSED_MULTIPLY_ADD = re.compile(r"\s(v?fn?m(?:add|sub|la|ls|ad|sb)\w*)\s")


def fused_multiply_adds(disassembly: str) -> list[str]:
    """(function, instruction) of every fused multiply-add inside a compact kernel function of
    `objdump -d -C` output."""
    found, function = [], ""
    for line in disassembly.splitlines():
        header = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if header:
            function = header.group(1)
        elif COMPACT_FUNCTION.search(function) and (match := FUSED_MULTIPLY_ADD.search(line)):
            found.append(f"{function[:80]}: {match.group(1)}")
    return found


def test_the_compact_kernel_has_no_fused_multiply_add():
    """The reference rounds every product and every sum: the build contracts nothing
    (-ffp-contract=off) and compact_math.h writes no fma, so the library holds none in the
    compact functions (the exact kernel's fused multiply-adds are its own)."""
    assert "-ffp-contract=off" in _build.CFLAGS
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump not found (binutils)")
    library = ops.load_extension().__file__
    disassembly = subprocess.run(
        [objdump, "-d", "-C", "--no-show-raw-insn", library], capture_output=True, text=True
    ).stdout
    assert sum(bool(COMPACT_FUNCTION.search(line)) for line in disassembly.splitlines()) > 0
    assert fused_multiply_adds(disassembly) == []
    assert len(re.findall(r"vfmadd", disassembly)) > 0  # the exact kernel's: the pattern works


def test_the_reference_square_root_is_ieee():
    """compact_format.ieee_sqrt (the reference's) against numpy's, which is IEEE; torch's own
    CPU sqrt is not, which is why the reference needs it."""
    gen = torch.Generator().manual_seed(3)
    x = torch.rand(1_000_000, generator=gen) * torch.exp(torch.randn(1_000_000, generator=gen) * 20)
    x[:6] = torch.tensor([0.0, 1e-45, 1e-38, 4.0, float("inf"), 3.4e38])
    numpy_sqrt = torch.from_numpy(numpy.sqrt(x.numpy()))
    assert torch.equal(ieee_sqrt(x), numpy_sqrt)
    assert ieee_sqrt(torch.tensor([float("nan")])).isnan().all()


@pytest.mark.parametrize(
    ("change", "error", "pattern"),
    [
        ({"master": torch.zeros(600, dtype=torch.float64)}, TypeError, "master must be float32"),
        ({"grad": torch.zeros(600, dtype=torch.int32)}, TypeError, "grad must be float32, bf"),
        ({"exp_avg": torch.zeros(600)}, TypeError, r"exp_avg must be uint8 \(8-bit codes"),
        ({"exp_avg_sq_scale": torch.zeros(3, dtype=torch.float64)}, TypeError,
         "exp_avg_sq_scale must be float32"),
        ({"out_lowp": torch.zeros(600, dtype=torch.float64)}, TypeError,
         "out_lowp must be bfloat16, float16 or float32"),
        ({"grad": torch.zeros(1200)[::2]}, ValueError, r"grad must be contiguous.*contiguous\(\)"),
        ({"exp_avg_sq": torch.zeros(600, dtype=torch.uint8, device="meta")}, ValueError,
         "exp_avg_sq must be a CPU tensor"),
        ({"exp_avg": torch.zeros(599, dtype=torch.uint8)}, ValueError,
         "exp_avg has 599 elements but master has 600"),
        ({"exp_avg_scale": torch.zeros(2)}, ValueError,
         "exp_avg_scale has 2 elements but master's blocks of 256 number 3"),
        ({"out_lowp": torch.zeros(599, dtype=torch.bfloat16)}, ValueError, "out_lowp has 599"),
        ({"element_offset": 100}, ValueError, "non-negative multiple of 256"),
        ({"element_offset": -256}, ValueError, "non-negative multiple of 256"),
        ({"element_offset": 256.0}, TypeError, "element_offset must be an int"),
        ({"commit": False, "out_lowp": None}, ValueError, r"commit=False\) writes only out_lowp"),
        ({"step": 0}, ValueError, "step is the 1-based number"),
        ({"step": 1.0}, TypeError, "step must be an int"),
        ({"salt": "a"}, TypeError, "salt must be an int"),
        ({"lr": float("nan")}, ValueError, "lr must be finite"),
        ({"beta2": 1.0}, ValueError, r"beta2 must be in \[0, 1\)"),
        ({"eps": 0.0}, ValueError, "eps must be > 0"),
        ({"weight_decay": -1.0}, ValueError, "weight_decay must be >= 0"),
        ({"grad_scale": -1.0}, ValueError, "grad_scale must be >= 0"),
        ({"master": [0.0] * 600}, TypeError, r"master must be a torch\.Tensor"),
    ],
)  # fmt: skip
def test_bad_arguments_are_refused_before_anything_changes(change, error, pattern):
    n = 600
    master, codes_m, scale_m, codes_v, scale_v = initial_state(n)
    args = {"master": master, "grad": torch.ones(n), "exp_avg": codes_m, "exp_avg_scale": scale_m,
            "exp_avg_sq": codes_v, "exp_avg_sq_scale": scale_v,
            "out_lowp": torch.zeros(n, dtype=torch.bfloat16), "step": 1, **HYPER}  # fmt: skip
    args.update(change)
    tensors = {
        k: v for k, v in args.items() if isinstance(v, torch.Tensor) and v.device.type == "cpu"
    }
    before = {k: v.clone() for k, v in tensors.items()}
    positional = [args.pop(k) for k in ("master", "grad", "exp_avg", "exp_avg_scale",
                                        "exp_avg_sq", "exp_avg_sq_scale")]  # fmt: skip
    with pytest.raises(error, match=pattern):
        ops.compact_adam(*positional, **args)
    for name, tensor in tensors.items():
        assert torch.equal(bits(tensor), bits(before[name])), f"{name} changed"


# The binding's own check of the four state tensors, which its plain and fused entries share.
# Dtypes only: ops.compact_adam and ops.compact_adam_commit_speculate refuse sizes in Python
# first, since a size refusal in the binding crashed the process (torch 2.11 headers, GCC 13).
@pytest.mark.parametrize("entry", ["compact_apply", "compact_fused_apply"])
@pytest.mark.parametrize(
    ("name", "wrong", "pattern"),
    [
        ("exp_avg", torch.float32, r"exp_avg must be uint8 \(8-bit codes, as CompactMoments"),
        ("exp_avg_sq", torch.int8, r"exp_avg_sq must be uint8 \(8-bit codes, as CompactMoments"),
        ("exp_avg_scale", torch.float64,
         r"exp_avg_scale must be float32 \(one scale per block of 256 elements\)"),
        ("exp_avg_sq_scale", torch.float16,
         r"exp_avg_sq_scale must be float32 \(one scale per block of 256 elements\)"),
    ],
)  # fmt: skip
def test_both_binding_entries_refuse_a_compact_state_tensor_of_the_wrong_dtype(
    entry, name, wrong, pattern
):
    n = 600
    master, codes_m, scale_m, codes_v, scale_v = initial_state(n)
    state = {"exp_avg": codes_m, "exp_avg_scale": scale_m, "exp_avg_sq": codes_v,
             "exp_avg_sq_scale": scale_v}  # fmt: skip
    state[name] = state[name].to(wrong)
    before = [t.clone() for t in (master, *state.values())]
    c = list(constants(step=1, **HYPER, grad_scale=1.0, salt=0))
    out = torch.zeros(n, dtype=torch.bfloat16)
    grad = torch.ones(n)
    args = {"compact_apply": ("", master, grad, *state.values(), out, *c, 0, True, True, True, 1),
            "compact_fused_apply": ("", master, grad, torch.ones(n), *state.values(), out, c, c,
                                    0, True, True, True, 1)}[entry]  # fmt: skip
    with pytest.raises(TypeError, match=pattern):
        getattr(_build.load_extension(), entry)(*args)
    for now, then in zip((master, *state.values()), before, strict=True):
        assert torch.equal(bits(now), bits(then))


def test_kernel_releases_the_gil():
    n = 4_000_000
    state = initial_state(n)
    grad = torch.randn(n).bfloat16()
    out = torch.empty(n, dtype=torch.bfloat16)
    windows: list[tuple[float, float]] = []

    def work():
        for step in range(1, 4):
            start = time.perf_counter()
            ops.compact_adam(state[0], grad, *state[1:], step=step, **HYPER, out_lowp=out)
            windows.append((start, time.perf_counter()))

    ops.compact_adam(state[0], grad, *state[1:], step=1, **HYPER)  # load outside the timing
    worker = threading.Thread(target=work)
    ticks = []
    worker.start()
    while worker.is_alive():
        ticks.append(time.perf_counter())
    worker.join()
    # Python ran on this thread while the kernel was inside a call: only possible without the GIL.
    assert sum(1 for t in ticks for start, end in windows if start < t < end) > 0
