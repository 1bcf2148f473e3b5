"""One bucket's buffers: the flat model-dtype params on the device, and the fp32 master and
Adam moments on the host (or, for a tail bucket, on the device).

The bucket's params are re-pointed to views of one flat device buffer, so returning updated
params is one copy per bucket and the model keeps working with ordinary parameters.
"""

from __future__ import annotations

import torch

from .buckets import BucketPlan
from .cast_policy import CastPlan
from .compact_moments import CompactMoments, blocks_of, compact_moment_bytes
from .host_memory import STANDALONE_REMEDIES, HostClaim, check_host_memory
from .link import Link
from .partition import HostPartition

GRAD_SUM_DTYPE = torch.float32  # a host bucket's gradient sum while arrivals accumulate


def grad_sum_bytes(numel: int) -> int:
    """Host bytes of the gradient sum ``Bucket.start_summing`` makes for ``numel`` elements:
    what the host check counts for accumulation, at start-up where it is declared
    (``standalone_host_parts``), else before each bucket's sum is made."""
    return numel * GRAD_SUM_DTYPE.itemsize


def device_state_bytes(numel: int, blocks: int, compact: bool) -> int:
    """Device bytes of ``numel`` elements' optimizer state held on the device: the fp32 master
    and fp32 gradients, and both Adam moments, fp32 or compact (a code a moment an element and
    a scale pair a block, ``blocks`` of them: ``compact_moment_bytes``). The standalone
    engine's tail buckets (``tail_state_bytes``) and the ZeRO-3 sub groups ``ratio`` keeps on
    the GPU (zero3/memory_plan.py) count with this."""
    moments = compact_moment_bytes(numel, blocks) if compact else 2 * 4 * numel
    return 4 * numel + 4 * numel + moments


def tail_state_bytes(plan: BucketPlan, compact: bool) -> int:
    """Device bytes a tail bucket of ``plan`` holds (``_hold_state_on_device``): its state
    counted by ``device_state_bytes``, the compact moments' blocks each param's own
    (``CompactMoments``). The GPU tail's cap check, ``auto``'s budgets and their messages count
    with this."""
    blocks = sum(blocks_of(p.numel()) for p in plan.params) if compact else 0
    return device_state_bytes(plan.numel, blocks, compact)


UNDECLARED_ACCUMULATION_REMEDIES = (
    "This step's gradients arrived more than once (several backward() calls per step(), "
    "set_accumulation_boundary(False), or a param's gradient hook firing twice), so each host "
    "bucket adds them up in an fp32 gradient sum (4 B/param) that the start-up host check "
    "did not count: pass gradient_accumulation_steps=<backward calls per step> to "
    "SuperOffloadOptimizer to have it counted (or refused) before training starts, or call "
    "step() after every backward(). Otherwise: " + STANDALONE_REMEDIES
)


def host_grad_dtype(model_dtype: torch.dtype, cast: CastPlan) -> torch.dtype:
    """The dtype host buckets' gradients land in; the kernel reads them as they are: model
    dtype when they cross uncast (the kernel upcasts in its own pass), else fp32."""
    lowp = model_dtype != torch.float32 and not cast.grads_on_device
    return model_dtype if lowp else torch.float32


def host_grad_buffer(
    link: Link, numel: int, model_dtype: torch.dtype, cast: CastPlan
) -> torch.Tensor:
    """The host buffer a host bucket's gradients land in (``host_grad_dtype``). (When params
    cross in the model dtype, the kernel writes them into the optimizer's shared CopyOutRing,
    not into a buffer of the bucket's own.)"""
    return link.host_empty(numel, host_grad_dtype(model_dtype, cast))


class Bucket(HostPartition):
    def __init__(
        self,
        plan: BucketPlan,
        link: Link,
        on_device: bool,
        cast: CastPlan,
        salts: list[int] | None = None,
        sum_counted: bool = False,
    ):
        """``salts`` (one a param): its moments are compact (compact_moments.py).
        ``sum_counted``: the start-up host check counted its gradient sum (declared
        accumulation), so none is checked when it is made."""
        self.plan = plan
        numel = plan.numel
        dtype = plan.params[0].dtype

        flat_param = torch.empty(numel, dtype=dtype, device=link.device)
        for param, offset in zip(plan.params, plan.offsets, strict=True):
            view = flat_param[offset : offset + param.numel()]
            view.copy_(param.detach().reshape(-1))
            param.data = view.view_as(param)
        # Where the first param must stay: model.to(...) or a wrapper that copies the params
        # after this would detach the model from the optimizer (optimizer.step checks).
        self.first_param_ptr = plan.params[0].data_ptr()

        self.on_device = False
        self.grad: torch.Tensor | None = None  # fp32 device gradients of a tail bucket
        self.device_group: dict | None = None  # its param group in the device AdamW
        if on_device:  # a tail bucket from the start: no host buffers at all
            master = torch.empty(numel, dtype=torch.float32, device=link.device)
            master.copy_(flat_param)
            exp_avg, exp_avg_sq = _fp32_moments(master, salts)
            host_grad = None
        else:
            # Page-locked master: with cast.params_on_device the H2D reads it directly.
            master = link.host_empty(numel, torch.float32)
            master.copy_(flat_param)
            exp_avg, exp_avg_sq = _fp32_moments(master, salts)
            host_grad = host_grad_buffer(link, numel, dtype, cast)
        # No copy-out buffer of its own (param_low): rounded params go through the
        # optimizer's shared CopyOutRing.
        super().__init__(
            plan.index, plan.group_index, master, exp_avg, exp_avg_sq, host_grad, None, flat_param
        )  # fmt: skip
        if salts is not None:
            spans = list(zip(plan.offsets, (p.numel() for p in plan.params), strict=True))
            self.compact = CompactMoments(spans, salts, numel, master.device)
        self.param_steps = [0] * len(plan.params)  # committed updates of each param
        # The step's fp32 gradient sum, on the host, while gradients accumulate over several
        # arrivals (made on first need, kept: accumulation usually goes on).
        self.grad_sum: torch.Tensor | None = None
        self._sum_counted = sum_counted
        # What the host check granted for grad_sum where start-up did not count it; held
        # (HostClaim) while the sum is.
        self._sum_claim: HostClaim | None = None
        self._link = link
        self._cast = cast
        if on_device:
            self._hold_state_on_device(master, exp_avg, exp_avg_sq)
        self.reset_for_next_step()

    def move_to_device(self, link: Link) -> None:
        """Make this a tail bucket: master, moments and fp32 gradients on the device
        (``tail_state_bytes``), stepped by torch's AdamW; the host buffers are released."""
        host_buffers = (self.master, self.host_grad, self.grad_sum)
        self.grad_sum = self._sum_claim = None
        if self.compact is not None:
            self.compact.to(link.device)
        self._hold_state_on_device(
            self.master.to(link.device), *_moved(link.device, self.exp_avg, self.exp_avg_sq)
        )
        link.release(*host_buffers)

    def move_to_host(self) -> None:
        """Make a tail bucket a host bucket again: master and moments come back to host memory
        (page-locked master, as at construction), its host transfer buffers are made, and the
        device state is dropped (the caller empties the allocator's cache if it must)."""
        master = self._link.host_empty(self.plan.numel, torch.float32)
        master.copy_(self.master)  # a blocking copy: the tail's last step has finished
        exp_avg, exp_avg_sq = _moved("cpu", self.exp_avg, self.exp_avg_sq)
        if self.compact is not None:
            self.compact.to("cpu")
        dtype = self.plan.params[0].dtype
        host_grad = host_grad_buffer(self._link, self.plan.numel, dtype, self._cast)
        self.master, self.exp_avg, self.exp_avg_sq = master, exp_avg, exp_avg_sq
        self.host_grad = host_grad
        self.grad = self.device_group = None
        self.on_device = False

    def _hold_state_on_device(self, master, exp_avg, exp_avg_sq) -> None:
        self.master, self.exp_avg, self.exp_avg_sq = master, exp_avg, exp_avg_sq
        self.grad = torch.zeros_like(master)
        master.grad = self.grad
        self.host_grad = None
        self.on_device = True

    def reset_for_next_step(self) -> None:
        self.reset_speculation()
        self.present = [False] * len(self.plan.params)  # got a gradient this step
        self.last_seen = [False] * len(self.plan.params)  # its step's last arrival came
        self.summing = False  # this step's gradients add up in grad_sum on the host
        self.contributed = False  # grad_sum holds this step's first contribution already
        self.new_round()

    def new_round(self) -> None:
        """Gradients staged from here on go to the device staging buffer afresh: at a step's
        start, and after a launch when more gradients arrive (accumulation)."""
        self.arrived = 0  # params staged in this round
        self.staged = [False] * len(self.plan.params)
        self.launched = False  # this round's gradients left for the host (or, tail: normed)
        self.staging: torch.Tensor | None = None

    @property
    def complete(self) -> bool:
        """Every param's last gradient of the step is staged: the bucket may launch."""
        return self.arrived == len(self.plan.params) and all(self.last_seen)

    def reserve_sum(self) -> None:
        """Before the gradient sum is made: where the start-up check did not count it
        (accumulation nobody declared), check that the host holds it too, else raise
        HostMemoryError with nothing allocated (the caller refuses the step)."""
        if self.grad_sum is None and not self._sum_counted and self._sum_claim is None:
            self._sum_claim = check_host_memory(
                {"accumulation": grad_sum_bytes(self.plan.numel)},
                UNDECLARED_ACCUMULATION_REMEDIES,
            )

    def start_summing(self) -> torch.Tensor:
        """From now on this step's gradients add up on the host, in fp32."""
        if self.grad_sum is None:
            self.reserve_sum()
            self.grad_sum = self._link.host_empty(self.plan.numel, GRAD_SUM_DTYPE)
        self.summing = True
        return self.grad_sum

    def grad_for_kernel(self) -> torch.Tensor:
        return self.grad_sum if self.summing else self.host_grad

    def update_runs(self) -> list[tuple[int, int, int]]:
        """Params without a gradient this step are not updated at all (as torch's AdamW
        skips them: no decay, no moment decay, no step count); the others each at their own
        next step count, in runs of neighbours that share one."""
        steps = self.param_steps
        if all(self.present) and min(steps) == max(steps):
            return [(0, self.plan.numel, steps[0] + 1)]
        runs: list[tuple[int, int, int]] = []
        for i, (param, offset) in enumerate(zip(self.plan.params, self.plan.offsets, strict=True)):
            if not self.present[i] or param.numel() == 0:
                continue
            step = steps[i] + 1
            if runs and runs[-1][0] + runs[-1][1] == offset and runs[-1][2] == step:
                runs[-1] = (runs[-1][0], runs[-1][1] + param.numel(), step)
            else:
                runs.append((offset, param.numel(), step))
        return runs

    def commit_update(self) -> None:
        for i, present in enumerate(self.present):
            self.param_steps[i] += present
        self.step = max(self.param_steps)

    @property
    def param_count(self) -> int:
        return len(self.plan.params)

    def param_step(self, param_index: int) -> int:
        """Committed updates of one param."""
        return self.param_steps[param_index]

    def set_param_step(self, param_index: int, step: int) -> None:
        self.param_steps[param_index] = step
        self.step = max(self.param_steps)

    def views(self, tensor: torch.Tensor, param_index: int) -> torch.Tensor:
        offset = self.plan.offsets[param_index]
        param = self.plan.params[param_index]
        return tensor[offset : offset + param.numel()].view_as(param)


def _fp32_moments(master: torch.Tensor, salts: list[int] | None):
    """AdamW's two fp32 moments, or None, None when they are compact (``salts`` given)."""
    if salts is not None:
        return None, None
    return torch.zeros_like(master), torch.zeros_like(master)


def _moved(device, *tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [None if t is None else t.to(device) for t in tensors]
