"""Host memory of the streamed ZeRO-3 model save (``streaming_save.py``): its shard size and
the most it holds, one figure for the save, the memory plan and the tests."""

from __future__ import annotations

# The shard size of the streamed save, and so what rank 0 holds of the model at most (with one
# more param); the Hub's usual shard size. transformers' own default (50 GB) would be most of a
# big model.
STREAMED_SHARD_BYTES = 5 * 10**9


def streamed_save_host_bytes(largest_param_bytes: int, max_shard_bytes: int) -> int:
    """The most host bytes rank 0 holds beyond training's while the model is saved: the shard
    being filled, which a param that would not fit beside it closes first (so at most
    ``max_shard_bytes``, or one param larger than that alone), and one more copy of the largest
    param: the gathered param itself where the accelerator is the host (on a GPU it is in device
    memory), or a weight conversion's packed output beside its source."""
    return max(max_shard_bytes, largest_param_bytes) + largest_param_bytes
