"""PinnedBuffers' bookkeeping with the CUDA runtime stubbed (CI has no GPU): page-aligned
spans of whole pages, exact sizes, no shared page, unpinning exactly what was pinned. The real
registration runs in tests/test_engine_gpu.py."""

from __future__ import annotations

import gc

import pytest
import torch

from hf_superoffload.engine import host_memory
from hf_superoffload.engine.host_memory import PAGE, PinnedBuffers


class FakeCudart:
    def __init__(self):
        self.registered: dict[int, int] = {}  # ptr -> bytes
        self.fail_unregister: set[int] = set()  # ptrs whose unregister reports an error

    def cudaHostRegister(self, ptr, size, flags):
        assert flags == 0 and ptr % PAGE == 0 and size % PAGE == 0
        for other, other_size in self.registered.items():
            assert ptr + size <= other or other + other_size <= ptr, "overlapping ranges"
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr):
        if ptr in self.fail_unregister:
            return 1
        del self.registered[ptr]
        return 0


def _check_error(code):
    if code != 0:
        raise RuntimeError(f"CUDA error {code}")


@pytest.fixture
def cudart(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(host_memory.torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(host_memory.torch.cuda, "check_error", _check_error)
    return fake


@pytest.mark.parametrize("numel", [1, 7, PAGE // 4, PAGE // 4 + 1, 3 * PAGE + 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_buffers_have_the_asked_size_on_whole_registered_pages(cudart, numel, dtype):
    buffers = PinnedBuffers()
    tensor = buffers.empty(numel, dtype)
    assert tensor.dtype == dtype and tensor.numel() == numel and tensor.is_contiguous()
    assert tensor.data_ptr() in cudart.registered
    span = cudart.registered[tensor.data_ptr()]
    assert numel * dtype.itemsize <= span < numel * dtype.itemsize + PAGE
    assert buffers.nbytes == span
    tensor.fill_(3)  # the memory is usable
    assert torch.equal(tensor, torch.full((numel,), 3, dtype=dtype))


def test_release_unpins_that_buffer_only_and_release_all_the_rest(cudart):
    buffers = PinnedBuffers()
    a, b, c = (buffers.empty(1000, torch.float32) for _ in range(3))
    assert len(cudart.registered) == 3  # the FakeCudart also checked they never overlap
    buffers.release(b)
    buffers.release(None)
    assert set(cudart.registered) == {a.data_ptr(), c.data_ptr()}
    assert buffers.nbytes == 2 * PAGE
    with pytest.raises(ValueError, match="did not hand out"):
        buffers.release(torch.empty(10))
    buffers.release_all()
    assert cudart.registered == {} and buffers.nbytes == 0


def test_empty_buffers_are_not_registered_and_release_ignores_them(cudart):
    buffers = PinnedBuffers()
    empty = buffers.empty(0, torch.float32)
    assert empty.numel() == 0 and cudart.registered == {}
    buffers.release(empty)
    assert buffers.nbytes == 0


def test_buffers_still_held_are_unpinned_when_their_owner_is_collected(cudart):
    buffers = PinnedBuffers()
    kept = [buffers.empty(100, torch.float32) for _ in range(3)]
    assert len(cudart.registered) == 3
    del buffers  # e.g. an optimizer whose construction failed half-way
    gc.collect()
    assert cudart.registered == {}
    kept[0].fill_(1)  # the memory itself lives on with its last reference


def test_one_failed_unregister_does_not_stop_the_others(cudart):
    buffers = PinnedBuffers()
    held = [buffers.empty(100, torch.float32) for _ in range(3)]
    cudart.fail_unregister.add(held[1].data_ptr())
    with pytest.raises(RuntimeError, match="CUDA error 1"):
        buffers.release_all()
    assert set(cudart.registered) == {held[1].data_ptr()}  # only the failed one
    assert buffers.nbytes == 0  # and nothing is left to retry on a dead context
