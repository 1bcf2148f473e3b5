"""A host partition: the unit the STV core speculates on, validates, commits, replays or skips.

It is a flat run of parameters whose fp32 master weights and Adam moments live in host memory,
with the host buffer its gradients land in and the flat device (or host) tensor of model-dtype
params the updated values go back to. How the gradients arrive and who owns the buffers is the
business of the engine that builds it: the standalone optimizer's buckets, or one ZeRO-3 sub
group of this rank's parameter partition.
"""

from __future__ import annotations

import torch


class HostPartition:
    def __init__(
        self,
        index: int,
        group_index: int,
        master: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        host_grad: torch.Tensor | None,
        param_low: torch.Tensor | None,
        flat_param: torch.Tensor,
    ):
        self.index = index  # also the key of its tasks on the worker
        self.group_index = group_index  # the param group giving its hyperparameters
        self.master = master  # fp32 master weights (page-locked when a GPU is on the other side)
        self.exp_avg = exp_avg
        self.exp_avg_sq = exp_avg_sq
        self.host_grad = host_grad  # fp32, or model dtype when grads cross uncast
        # The kernel's rounded copy-out when params cross uncast, unless the engine gives the
        # STV core a shared CopyOutRing instead.
        self.param_low = param_low
        self.flat_param = flat_param  # model-dtype params the update is sent to
        self.step = 0  # committed updates
        self.h2d_event: torch.cuda.Event | None = None  # consumed by the next forward
        # The worker's: the master (and param_low) may be overwritten once it completes.
        self.last_h2d: torch.cuda.Event | None = None
        self.speculation_applied = False  # written and read on the worker thread only
        # Compact moments (compact_moments.py) in place of fp32 exp_avg / exp_avg_sq (None).
        self.compact = None
        # A validated update whose write into master and moments is deferred to the next
        # step's pass (deferred_commits.Pending), and the gradient slot this step's gradients
        # land in meanwhile (grad_slots.py); both the training thread's.
        self.pending = None
        self.incoming: torch.Tensor | None = None
        # The worker's: the host state lacks the pending update (its speculation ran).
        self.state_behind = False
        # (offset, numel) ranges no gradient is ever written to (ZeRO-3's padding of a param's
        # last partition): zeroed in a gradient slot when it is taken.
        self.padding: list[tuple[int, int]] = []
        self.reset_speculation()

    @property
    def numel(self) -> int:
        return self.master.numel()

    def update_runs(self) -> list[tuple[int, int, int]]:
        """The (offset, numel, update number) runs the coming step updates, taken when its
        tasks are submitted: the whole partition, at one step count, unless an engine knows
        better (the standalone buckets skip params that got no gradient)."""
        return [(0, self.numel, self.step + 1)]

    def commit_update(self) -> None:
        """The coming step is decided (committed, clipped or stepped after validation)."""
        self.step += 1

    def grad_for_kernel(self) -> torch.Tensor:
        """The gradients the kernel reads, taken when a task is submitted."""
        return self.host_grad

    def reset_speculation(self) -> None:
        self.d2h_event: torch.cuda.Event | None = None  # the gradients are on the host
        self.speculated_with: dict | None = None  # hyperparameters of the speculative step
        self.speculated_scale = 1.0  # the gradient scale it used (the predicted clip coef)
        # What the speculative step updated and from which gradients: a rollback or replay
        # must go over exactly that.
        self.speculated_runs: list[tuple[int, int, int]] = []
        self.speculated_grad: torch.Tensor | None = None
