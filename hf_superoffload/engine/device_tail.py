"""The tail buckets' optimizer: torch's AdamW over their fp32 masters on the device.

It steps each param's view of its bucket's master, so a param that got no gradient is skipped
as torch's AdamW skips it (its ``grad`` is None for that step) and each keeps its own step
count. A "bucket" here is anything with the tail's few needs (``param_count``, ``views``,
``present``, ``param_step``, ``grad``, ``commit_update``, ``flat_param``): the standalone
engine's buckets, or a ZeRO-3 sub group kept on the device (one flat param). Its state *is*
the buckets' moment tensors, so state_dict, load and migration need no copies.
NOTE: torch's default (foreach) AdamW, not fused=True: the fused CUDA kernel forms 1 - beta2
in fp32 (9.99987e-4 for 0.999), 1.3e-5 off the double-precision value that torch's default
AdamW and the CPU kernel use, and tail and host buckets must do the same arithmetic.
"""

from __future__ import annotations

import torch

from ..ops.compact_state import compact_adam_pass
from ..ops.compact_triton import compact_adam_pass_cuda
from ..ops.compact_triton import require as require_triton
from .bucket import Bucket

# The tail's step makes temporaries on the device beside its state: torch's foreach AdamW one
# fp32 tensor an element of a bucket (sqrt of exp_avg_sq, the group's at once). The compact
# update on a CUDA device is one Triton kernel, in place (ops.compact_triton): none. Elsewhere
# (a CPU device: DeepSpeed's CPU accelerator, tests) it is the plain-PyTorch reference, about
# 100 bytes an element, so it steps a param COMPACT_STEP_PIECE elements at a time
# (block-aligned: the same bits as whole). Peaks measured by tests/test_tail_step_scratch.py.
EXACT_STEP_SCRATCH_BYTES = 4
COMPACT_STEP_SCRATCH_BYTES = 104
COMPACT_STEP_PIECE = 1 << 24


def step_scratch_bytes(largest_bucket: int, compact: bool, device_type: str) -> int:
    """Device bytes of temporaries while the tail steps buckets of at most ``largest_bucket``
    elements on a ``device_type`` device: what the memory plans count beside the tail's state."""
    if compact:
        if device_type == "cuda":
            return 0
        return COMPACT_STEP_SCRATCH_BYTES * min(largest_bucket, COMPACT_STEP_PIECE)
    return EXACT_STEP_SCRATCH_BYTES * largest_bucket


class DeviceTail:
    def __init__(self):
        self.adamw: torch.optim.AdamW | None = None
        self._views: dict[int, list[torch.Tensor]] = {}  # bucket index -> its params' masters

    def register(self, bucket: Bucket) -> None:
        if bucket.compact is not None:  # stepped by the compact update itself (``step``)
            if bucket.master.is_cuda:
                require_triton()  # before the bucket's first step, saying what to change
            return
        views = [bucket.views(bucket.master, i) for i in range(bucket.param_count)]
        group = {"params": views}
        if self.adamw is None:
            self.adamw = torch.optim.AdamW([group], foreach=True)
        else:
            self.adamw.add_param_group(group)
        bucket.device_group = self.adamw.param_groups[-1]
        self._views[bucket.index] = views
        for i, view in enumerate(views):
            self.adamw.state[view] = {
                "step": self._step_tensor(bucket.param_step(i)),
                "exp_avg": bucket.views(bucket.exp_avg, i),
                "exp_avg_sq": bucket.views(bucket.exp_avg_sq, i),
            }

    def unregister(self, bucket: Bucket) -> None:
        """The bucket goes back to the host: drop its group and state (found by identity:
        comparing groups by value would compare tensors)."""
        if bucket.compact is not None:
            return
        groups = self.adamw.param_groups
        del groups[next(i for i, g in enumerate(groups) if g is bucket.device_group)]
        for view in self._views.pop(bucket.index):
            del self.adamw.state[view]

    def set_step(self, bucket: Bucket) -> None:
        if bucket.compact is not None:  # its steps are the bucket's own param_steps
            return
        for i, view in enumerate(self._views[bucket.index]):
            self.adamw.state[view]["step"] = self._step_tensor(bucket.param_step(i))

    def step(self, buckets: list[Bucket], hypers: list[dict], coef: float) -> None:
        """One validated step of every tail bucket, with the clip coefficient applied."""
        if not buckets:
            return
        exact = [(b, h) for b, h in zip(buckets, hypers, strict=True) if b.compact is None]
        for bucket, hyper in zip(buckets, hypers, strict=True):
            if bucket.compact is not None:
                _compact_step(bucket, hyper, coef)
        for bucket, hyper in exact:
            bucket.device_group.update(
                lr=hyper["lr"],
                betas=(hyper["beta1"], hyper["beta2"]),
                eps=hyper["eps"],
                weight_decay=hyper["weight_decay"],
            )
            if coef != 1.0:
                bucket.grad.mul_(coef)
            for i, view in enumerate(self._views[bucket.index]):
                view.grad = bucket.views(bucket.grad, i) if bucket.present[i] else None
        if exact:
            self.adamw.step()
        for bucket in buckets:
            bucket.commit_update()
            bucket.flat_param.copy_(bucket.master)

    @staticmethod
    def _step_tensor(step: int) -> torch.Tensor:
        return torch.tensor(float(step), dtype=torch.float32)  # on the CPU, as torch keeps it


def _compact_step(bucket: Bucket, hyper: dict, coef: float) -> None:
    """The compact update of each param with a gradient: the Triton kernel on a CUDA device
    (a param a call), else the plain-PyTorch reference in pieces of at most
    ``COMPACT_STEP_PIECE`` elements (``step_scratch_bytes``)."""
    kwargs = {k: v for k, v in hyper.items() if k != "step"}
    moments = bucket.compact
    on_cuda = bucket.master.is_cuda
    for i, segment in enumerate(moments.segments):
        if not bucket.present[i] or segment.numel == 0:
            continue
        master = bucket.views(bucket.master, i).view(-1)
        grad = bucket.views(bucket.grad, i).view(-1)
        step = bucket.param_step(i) + 1
        if on_cuda:
            compact_adam_pass_cuda(
                master, grad, *moments.piece_moments(segment, 0, segment.numel), step=step,
                grad_scale=coef, salt=segment.salt, element_offset=0, **kwargs,
            )  # fmt: skip
            continue
        for start in range(0, segment.numel, COMPACT_STEP_PIECE):
            n = min(COMPACT_STEP_PIECE, segment.numel - start)
            compact_adam_pass(
                master[start : start + n], grad[start : start + n],
                *moments.piece_moments(segment, start, n), step=step,
                grad_scale=coef, salt=segment.salt, element_offset=start, **kwargs,
            )  # fmt: skip
