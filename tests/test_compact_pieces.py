"""ops.compact_adam_pieces: the commit of several params of a partition in one call gives,
on every instruction set and thread count, the bits of one compact_adam call per param."""

from __future__ import annotations

import pytest
import torch
from test_compact_kernel import HYPER, assert_same_bits, bits, each_isa_and_thread_count, gradient

from hf_superoffload import ops
from hf_superoffload.engine.compact_moments import blocks_of
from hf_superoffload.ops.compact_format import BLOCK

# (offset in the partition, elements, step, salt, element offset of the piece within its
# param): params of odd lengths, padding between two, a second piece of one param, a piece of
# a second run at another update number, one over two threads' chunks.
SPANS = [
    (0, 300, 3, 11, 0),
    (300, 5 * BLOCK, 3, 12, 0),
    (300 + 5 * BLOCK + 40, 4 * BLOCK, 3, 13, 0),
    (300 + 9 * BLOCK + 40, 2 * BLOCK + 1, 3, 13, 4 * BLOCK),
    (300 + 11 * BLOCK + 41, 2 * 65536 + 7, 5, 2**40 + 1, 0),
]
N = 300 + 11 * BLOCK + 41 + 2 * 65536 + 7 + 100  # padding at the end


def _state(grad_dtype):
    gen = torch.Generator().manual_seed(3)
    master = torch.randn(N, generator=gen)
    grad = gradient(N, 1).to(grad_dtype)
    blocks = sum(blocks_of(n) for _, n, *_ in SPANS)
    codes = [torch.randint(0, 256, (N,), generator=gen, dtype=torch.uint8) for _ in range(2)]
    scales = [torch.rand(blocks, generator=gen) for _ in range(2)]
    return [master, grad, codes[0], scales[0], codes[1], scales[1]]


def _pieces():
    pieces, first = [], 0
    for at, n, step, salt, offset in SPANS:
        pieces.append(ops.CommitPiece(at, n, first, step, salt, offset))
        first += blocks_of(n)
    return pieces


def _one_call_a_piece(state, hyper):
    master, grad, m, ms, v, vs = state
    skipped = 0
    for piece in _pieces():
        lo, n, b = piece.at, piece.numel, piece.first_block
        blocks = slice(b, b + blocks_of(n))
        skipped += ops.compact_adam(
            master[lo : lo + n], grad[lo : lo + n], m[lo : lo + n], ms[blocks],
            v[lo : lo + n], vs[blocks], step=piece.step, salt=piece.salt,
            element_offset=piece.element_offset, **hyper,
        )  # fmt: skip
    return skipped


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("adamw, stochastic", [(True, True), (False, False)])
def test_one_call_equals_a_call_a_piece_on_every_isa_and_thread_count(
    grad_dtype, adamw, stochastic
):
    hyper = {**HYPER, "adamw": adamw, "stochastic": stochastic, "grad_scale": 0.5}
    expected_state = _state(grad_dtype)
    expected_skipped = _one_call_a_piece(expected_state, hyper)
    assert expected_skipped > 0  # NaN and Inf terms were met
    for isa, threads in each_isa_and_thread_count():
        state = _state(grad_dtype)
        skipped = ops.compact_adam_pieces(*state, _pieces(), **hyper)
        assert skipped == expected_skipped
        assert_same_bits(state, expected_state, (isa, threads))
    # the padding between and after the params is untouched
    untouched = _state(grad_dtype)
    for lo, hi in ((300 + 5 * BLOCK, 300 + 5 * BLOCK + 40), (N - 100, N)):
        assert torch.equal(bits(state[0][lo:hi]), bits(untouched[0][lo:hi]))


def test_a_call_of_its_own_thread_count_gives_the_same_bits():
    expected = _state(torch.bfloat16)
    ops.compact_adam_pieces(*expected, _pieces(), **HYPER)
    got = _state(torch.bfloat16)
    ops.compact_adam_pieces(*got, _pieces(), **HYPER, threads=3)
    assert_same_bits(got, expected, "threads=3")


def test_no_pieces_writes_nothing():
    state = _state(torch.bfloat16)
    before = [t.clone() for t in state]
    assert ops.compact_adam_pieces(*state, [], **HYPER) == 0
    assert_same_bits(state, before)


@pytest.mark.parametrize(
    ("piece", "error", "pattern"),
    [
        (ops.CommitPiece(N - 10, 11, 0, 1, 0, 0), ValueError, "lies outside master's"),
        (ops.CommitPiece(-BLOCK, 10, 0, 1, 0, 0), ValueError, "lies outside master's"),
        (ops.CommitPiece(0, BLOCK + 1, 10**6, 1, 0, 0), ValueError, "lies outside the"),
        (ops.CommitPiece(0, 10, 0, 0, 0, 0), ValueError, "step is the 1-based number"),
        (ops.CommitPiece(0, 10, 0, 1, 0, 100), ValueError, "non-negative multiple of 256"),
        (ops.CommitPiece(0, 10, 0, 1, "a", 0), TypeError, "salt must be an int"),
        (ops.CommitPiece(0, 10.0, 0, 1, 0, 0), TypeError, "numel must be an int"),
        ((0, 10, 0, 1, 0, 0), TypeError, "pieces must be CommitPiece"),
    ],
)  # fmt: skip
def test_a_bad_piece_is_refused_before_anything_changes(piece, error, pattern):
    state = _state(torch.bfloat16)
    before = [t.clone() for t in state]
    with pytest.raises(error, match=pattern):
        ops.compact_adam_pieces(*state, [*_pieces(), piece], **HYPER)
    assert_same_bits(state, before)


@pytest.mark.parametrize(
    ("index", "replacement", "pattern"),
    [
        (1, torch.zeros(N - 1, dtype=torch.bfloat16), "grad has"),
        (4, torch.zeros(N + 1, dtype=torch.uint8), "exp_avg_sq has"),
        (5, torch.zeros(3), "exp_avg_sq_scale has 3 elements"),
    ],
)
def test_tensors_of_mismatched_lengths_are_refused(index, replacement, pattern):
    state = _state(torch.bfloat16)
    state[index] = replacement
    with pytest.raises(ValueError, match=pattern):
        ops.compact_adam_pieces(*state, _pieces(), **HYPER)


def test_the_binding_refuses_a_state_tensor_of_the_wrong_dtype():
    state = _state(torch.bfloat16)
    state[2] = state[2].float()
    with pytest.raises(TypeError, match=r"exp_avg must be uint8"):
        ops.compact_adam_pieces(*state, _pieces(), **HYPER)
