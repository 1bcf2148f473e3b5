"""What building the ZeRO-3 optimizer holds on the host beyond training: the start-up figure of
the memory plan and the host check (host_parts.start_up_host_bytes). DeepSpeed's host
accumulation buffer (one element per param of the partition, in its accumulation dtype) is
made only when micro-batches accumulate: without accumulation every gradient partition takes
our boundary path, and the buffer would only have raised the start-up peak.

Counted on a one-rank CPU run by a dispatch mode on the constructing thread: every tensor
created while the optimizer is built, by dtype and size. The start-up line rank 0 logs says
how long that took.
"""

from __future__ import annotations

import collections
import logging
import os
import re

import pytest
import torch
from ranks import spawn_ranks
from torch.utils._python_dispatch import TorchDispatchMode
from zero3_reference import Zero3Case, free_port, init_rank, make_engine


class _Created(TorchDispatchMode):
    """(dtype, numel) of every tensor the ops of this thread return on a new storage."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors: list[tuple[torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in torch.utils._pytree.tree_leaves((args, kwargs or {}))
            if isinstance(t, torch.Tensor)
        }
        for tensor in out if isinstance(out, (list, tuple)) else (out,):
            if (
                isinstance(tensor, torch.Tensor)
                and tensor.untyped_storage().data_ptr() not in inputs
            ):
                self.tensors.append((tensor.dtype, tensor.numel()))
        return out


def _on_rank(rank, world, port, out_dir) -> None:
    init_rank(rank, world, port)
    torch.set_num_threads(1)
    import hf_superoffload  # noqa: F401  (activates the ZeRO-3 path)
    from hf_superoffload.zero3.optimizer import SuperOffloadZero3Optimizer

    built = {}
    init = SuperOffloadZero3Optimizer.__init__

    def counted(self, *args, **kwargs):
        with _Created() as created:
            init(self, *args, **kwargs)
        built["tensors"] = created.tensors

    SuperOffloadZero3Optimizer.__init__ = counted
    from deepspeed.utils import logger

    class Lines(logging.Handler):
        def __init__(self):
            super().__init__()
            self.lines: list[str] = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    lines = Lines()
    logger.addHandler(lines)
    results = {}
    for accumulation in (1, 2):
        case = Zero3Case(bf16=True, sub_group_size=2000, accumulation=accumulation)
        seen = len(lines.lines)
        engine, optimizer = make_engine(case, True, world)
        partition = sum(m.numel() for m in optimizer.fp32_partitioned_groups_flat)
        results[accumulation] = {
            "tensors": built["tensors"],
            "partition": partition,
            "largest_sub_group": max(m.numel() for m in optimizer.fp32_partitioned_groups_flat),
            "dtype": optimizer.gradient_accumulation_dtype,
            "buffer": optimizer.grad_partitions_flat_buffer.numel(),
            "host_bytes": optimizer.host_bytes(),
            "log": [line for line in lines.lines[seen:] if "runs in place of DeepSpeed's" in line],
        }
        engine.destroy()
    torch.save(results, os.path.join(out_dir, "rank0.pt"))


@pytest.mark.filterwarnings("ignore")
def test_deepspeeds_accumulation_buffer_is_made_only_when_micro_batches_accumulate(tmp_path):
    from hf_superoffload.zero3.host_parts import start_up_host_bytes

    spawn_ranks(_on_rank, (1, free_port(), str(tmp_path)), 1)
    results = torch.load(tmp_path / "rank0.pt", weights_only=False)
    single, accumulating = results[1], results[2]
    partition, dtype = single["partition"], single["dtype"]
    assert accumulating["partition"] == partition and dtype == torch.bfloat16
    assert single["largest_sub_group"] < partition  # no sub group is partition-sized

    def whole(got) -> collections.Counter:
        """Tensors of the whole partition made while the optimizer was built (here, on the
        CPU, DeepSpeed's flat 16-bit params too, which live on the GPU on a GPU run)."""
        return collections.Counter((d, n) for d, n in got["tensors"] if n >= partition)

    # Accumulating builds exactly one more: the buffer, in the accumulation dtype.
    assert whole(accumulating) - whole(single) == collections.Counter({(dtype, partition): 1})
    assert not whole(single) - whole(accumulating)
    assert single["buffer"] == 0 and accumulating["buffer"] == partition
    assert single["host_bytes"]["accumulation"] == 0
    assert accumulating["host_bytes"]["accumulation"] == 2 * partition
    # The start-up line says how long building the optimizer took, and DeepSpeed's share.
    for got in (single, accumulating):
        (line,) = got["log"]
        built = re.search(
            r"built in ([0-9.]+) s, ([0-9.]+) of them in DeepSpeed's partitioning", line
        )
        assert built and 0 < float(built[2]) <= float(built[1]), line
    # The start-up figure counts the buffer where it is made, and only there.
    assert start_up_host_bytes(partition, 2, True) - start_up_host_bytes(partition, 2, False) == (
        2 * partition
    )
