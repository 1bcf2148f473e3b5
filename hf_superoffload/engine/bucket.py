"""One bucket's buffers: the flat model-dtype params on the device, and the fp32 master and
Adam moments on the host (or, for a tail bucket, on the device).

The bucket's params are re-pointed to views of one flat device buffer, so returning updated
params is one copy per bucket and the model keeps working with ordinary parameters.
"""

from __future__ import annotations

import torch

from .buckets import BucketPlan
from .cast_policy import CastPlan
from .link import Link


class Bucket:
    def __init__(self, plan: BucketPlan, link: Link, on_device: bool, cast: CastPlan):
        self.plan = plan
        self.index = plan.index
        numel = plan.numel
        dtype = plan.params[0].dtype
        self.lowp = dtype if dtype != torch.float32 else None

        self.flat_param = torch.empty(numel, dtype=dtype, device=link.device)
        for param, offset in zip(plan.params, plan.offsets, strict=True):
            view = self.flat_param[offset : offset + param.numel()]
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
            master.copy_(self.flat_param)
            self._hold_state_on_device(master, torch.zeros_like(master), torch.zeros_like(master))
        else:
            # Page-locked master: with cast.params_on_device the H2D reads it directly.
            self.master = link.host_empty(numel, torch.float32)
            self.master.copy_(self.flat_param)
            self.exp_avg = torch.zeros(numel)
            self.exp_avg_sq = torch.zeros(numel)
            # Gradients land here and the kernel reads them as they are: model dtype when
            # they cross uncast (the kernel upcasts in its own pass), else fp32.
            grad_dtype = (
                self.lowp if self.lowp is not None and not cast.grads_on_device else torch.float32
            )
            self.host_grad = link.host_empty(numel, grad_dtype)
            copy_out = self.lowp is not None and not cast.params_on_device
            self.param_low = link.host_empty(numel, self.lowp) if copy_out else None

        self.step = 0  # committed updates
        self.reset_for_next_step()
        self.h2d_event: torch.cuda.Event | None = None  # consumed by the next forward
        self.last_h2d: torch.cuda.Event | None = None  # the worker's: param_low free again
        self.speculation_applied = False  # written and read on the worker thread only

    def move_to_device(self, link: Link) -> None:
        """Make this a tail bucket: master, moments and fp32 gradients on the device (16 B per
        element there), stepped by torch's AdamW; the host buffers are released."""
        host_buffers = (self.master, self.host_grad, self.param_low)
        self._hold_state_on_device(
            self.master.to(link.device),
            self.exp_avg.to(link.device),
            self.exp_avg_sq.to(link.device),
        )
        link.release(*host_buffers)

    def _hold_state_on_device(self, master, exp_avg, exp_avg_sq) -> None:
        self.master, self.exp_avg, self.exp_avg_sq = master, exp_avg, exp_avg_sq
        self.grad = torch.zeros_like(master)
        master.grad = self.grad
        self.host_grad = self.param_low = None
        self.on_device = True

    def reset_for_next_step(self) -> None:
        self.arrived = 0  # params whose final gradient of this step has been staged
        self.staged = [False] * len(self.plan.params)
        self.launched = False  # grads staged, norm computed, sent to the host
        self.staging: torch.Tensor | None = None
        self.d2h_event: torch.cuda.Event | None = None
        self.speculated_with: dict | None = None  # hyperparameters of the speculative step
        self.speculated_scale = 1.0  # the gradient scale it used (the predicted clip coef)

    def views(self, tensor: torch.Tensor, param_index: int) -> torch.Tensor:
        offset = self.plan.offsets[param_index]
        param = self.plan.params[param_index]
        return tensor[offset : offset + param.numel()].view_as(param)
