"""What a checkpointed decoder keeps between forward and backward: each layer's input, the
hidden states of this rank's tokens (under Ulysses, 1/N of each sequence), and where it keeps it.

Without activation checkpoint offload every layer's input stays on the GPU until its backward.
With it (``integrations/activation_offload.py``) each input moves to pinned host memory in the
forward and comes back for its layer's recompute, so the GPU holds one at a time. Pinned memory
comes from torch's caching host allocator, which rounds every block up to a power of two and
keeps the blocks for the next step: the host holds one such block per layer.

The plan (``memory_plan.py``) and the offload's own tally of what it moved take their sizes
from here.
"""

from __future__ import annotations


def layer_input_bytes(tokens: int, hidden: int, dtype_bytes: int) -> int:
    """One layer's input: ``tokens`` (batch x this rank's share of the sequence) x ``hidden``
    in the activations' dtype."""
    return tokens * hidden * dtype_bytes


def pinned_block_bytes(nbytes: int) -> int:
    """Host bytes torch's pinned allocator holds for a tensor of ``nbytes``: the next power of
    two (``CachingHostAllocator`` rounds each request so that blocks are reused by size)."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def layer_inputs_gpu_bytes(
    layers: int, tokens: int, hidden: int, dtype_bytes: int, offload: bool
) -> int:
    """GPU bytes of the layers' inputs at the start of backward: all of them, or with offload
    the one brought back for the layer being recomputed."""
    each = layer_input_bytes(tokens, hidden, dtype_bytes)
    return each if offload else layers * each


def layer_inputs_host_bytes(
    layers: int, tokens: int, hidden: int, dtype_bytes: int, offload: bool
) -> int:
    """Pinned host bytes of the offloaded layer inputs (0 without offload): a power-of-two
    block per layer, held from the first step on."""
    if not offload:
        return 0
    return layers * pinned_block_bytes(layer_input_bytes(tokens, hidden, dtype_bytes))
