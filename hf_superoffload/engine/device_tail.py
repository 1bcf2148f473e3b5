"""The tail buckets' optimizer: torch's AdamW over their fp32 masters on the device.

Its state *is* the buckets' moment tensors, so state_dict, load and migration need no copies.
NOTE: torch's default (foreach) AdamW, not fused=True: the fused CUDA kernel forms 1 - beta2
in fp32 (9.99987e-4 for 0.999), 1.3e-5 off the double-precision value that torch's default
AdamW and the CPU kernel use, and tail and host buckets must do the same arithmetic.
"""

from __future__ import annotations

import torch

from .bucket import Bucket


class DeviceTail:
    def __init__(self):
        self.adamw: torch.optim.AdamW | None = None

    def register(self, bucket: Bucket) -> None:
        group = {"params": [bucket.master]}
        if self.adamw is None:
            self.adamw = torch.optim.AdamW([group], foreach=True)
        else:
            self.adamw.add_param_group(group)
        bucket.device_group = self.adamw.param_groups[-1]
        self.adamw.state[bucket.master] = {
            "step": self._step_tensor(bucket.step),
            "exp_avg": bucket.exp_avg,
            "exp_avg_sq": bucket.exp_avg_sq,
        }

    def set_step(self, bucket: Bucket) -> None:
        self.adamw.state[bucket.master]["step"] = self._step_tensor(bucket.step)

    def step(self, buckets: list[Bucket], hypers: list[dict], coef: float) -> None:
        """One validated step of every tail bucket, with the clip coefficient applied."""
        if not buckets:
            return
        for bucket, hyper in zip(buckets, hypers, strict=True):
            bucket.device_group.update(
                lr=hyper["lr"],
                betas=(hyper["beta1"], hyper["beta2"]),
                eps=hyper["eps"],
                weight_decay=hyper["weight_decay"],
            )
            if coef != 1.0:
                bucket.grad.mul_(coef)
        self.adamw.step()
        for bucket in buckets:
            bucket.step += 1
            bucket.flat_param.copy_(bucket.master)

    @staticmethod
    def _step_tensor(step: int) -> torch.Tensor:
        return torch.tensor(float(step), dtype=torch.float32)  # on the CPU, as torch keeps it
