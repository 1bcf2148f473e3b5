"""The CPU passes over a host partition whose moments are compact (compact_moments.py).

Compact moments cannot be rolled back algebraically, so a speculative pass changes no host
state: it writes only the updated params, rounded, for the device. The state takes the update
after validation, in a second pass over the same inputs that writes master and moments (and
the params again only when validation changed the update: a clip, new hyperparameters). A
skipped step sends the unchanged master back. With the params on a GPU the speculative pass
runs there (device_speculation.py) and the CPU makes only the writes. Every verdict is
therefore exact with respect to the plain-PyTorch compact update
(``compact_state.compact_adam_pass``), which the compiled kernel (``ops.compact_adam``) gives
bit for bit.

A write that sends nothing covers all of its params in one call (``ops.compact_adam_pieces``,
the same bits), which takes the GIL back once rather than several times a param (38.7 us of
Python a param against 9.0 in one call, 1000 params of 256 elements, one thread). It did not
change the step on H200 hosts, where the writes slow the forward they run beside through
memory traffic, not the GIL (docs/runs/2026-11-27-compact-forward-h200.md).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .. import ops
from ..ops.compact_format import BLOCK

if TYPE_CHECKING:
    import torch

    from .deferred_commits import Pending
    from .host_steps import HostSteps
    from .partition import HostPartition

_HYPER = ("lr", "beta1", "beta2", "eps", "weight_decay")


def _half(hyper: dict, step: int, scale: float) -> dict:
    """One half's hyperparameters for ``ops.compact_adam_commit_speculate``."""
    return {"step": step, **{k: hyper[k] for k in _HYPER}, "grad_scale": scale}


class CompactPasses:
    def __init__(self, host: HostSteps):
        self.host = host  # the link, the copy-out buffers, the stats

    def run(
        self,
        part: HostPartition,
        hyper: dict,
        scale: float,
        runs,
        grad,
        *,
        commit: bool,
        send: bool,
        seconds: str,
    ) -> None:
        """Update number ``hyper["step"]`` (each run's own) of ``runs`` with gradient scale
        ``scale``: into master and moments with ``commit``, to the model with ``send``."""
        host, moments = self.host, part.compact
        kwargs = {k: v for k, v in hyper.items() if k != "step"}
        stats = host.stats
        device = host.device_speculation
        if send and not commit and device is not None and device.serves(part):
            began = time.perf_counter()  # queueing the copies and kernels
            stats.bytes_h2d += device.speculate(part, kwargs, scale, runs, grad)
            stats.device_speculation_seconds += time.perf_counter() - began
            stats.speculations_on_device += 1
            return
        host.link.host_waits_for(part.last_h2d)  # no transfer still reads the master
        if commit and not send:  # every param of the runs in one call
            n, pieces = moments.numel, _commit_pieces(moments, runs)
            began = time.perf_counter()
            ops.compact_adam_pieces(
                part.master.narrow(0, 0, n), grad.narrow(0, 0, n), *moments.tensors(), pieces,
                grad_scale=scale, **kwargs,
            )  # fmt: skip
            setattr(stats, seconds, getattr(stats, seconds) + time.perf_counter() - began)
        else:  # a piece a copy-out buffer when it goes to the model, else a param a call
            most = self._most() if send else moments.numel
            for piece in moments.run_pieces(runs, most):
                at, n, segment = piece.at, piece.numel, piece.segment
                low = host.take_copy_out(part, at, n) if send else None
                began = time.perf_counter()
                ops.compact_adam(
                    part.master.narrow(0, at, n), grad.narrow(0, at, n),
                    *moments.piece_moments(segment, piece.start, n), step=piece.step,
                    grad_scale=scale, salt=segment.salt, element_offset=piece.start,
                    commit=commit, out_lowp=low, **kwargs,
                )  # fmt: skip
                setattr(stats, seconds, getattr(stats, seconds) + time.perf_counter() - began)
                if send:
                    host.send_params(part, low, at, n)
        if seconds == "cpu_step_seconds":  # as the exact path counts its steps, for the tuner
            host.elements_stepped += sum(numel for _, numel, _ in runs)

    def fused(
        self,
        part: HostPartition,
        pending: Pending,
        hyper: dict,
        scale: float,
        runs,
        incoming: torch.Tensor,
        grad: torch.Tensor,
    ) -> None:
        """Write ``pending`` (its gradients in ``grad``) into master and moments and send the
        speculative update of ``runs`` (the same elements, one update later) from the
        gradients in ``incoming``, which are copied into ``grad`` as each piece is done."""
        host, moments = self.host, part.compact
        host.link.host_waits_for(part.last_h2d)
        stats = host.stats
        if len(runs) != len(pending.runs):
            raise ValueError(f"{len(runs)} runs to speculate but {len(pending.runs)} pending")
        for piece in moments.run_pieces(runs, self._most()):
            at, n, segment = piece.at, piece.numel, piece.segment
            committed = pending.runs[piece.run][2]
            low = host.take_copy_out(part, at, n)
            began = time.perf_counter()
            ops.compact_adam_commit_speculate(
                part.master.narrow(0, at, n), grad.narrow(0, at, n), incoming.narrow(0, at, n),
                *moments.piece_moments(segment, piece.start, n),
                commit=_half(pending.hyper, committed, pending.scale),
                speculate=_half(hyper, piece.step, scale), salt=segment.salt,
                element_offset=piece.start, out_lowp=low,
            )  # fmt: skip
            stats.cpu_step_seconds += time.perf_counter() - began
            host.send_params(part, low, at, n)
        host.elements_stepped += sum(numel for _, numel, _ in runs)
        stats.commits_fused += 1

    def carry(
        self, part: HostPartition, incoming: torch.Tensor, grad: torch.Tensor, outside=None
    ) -> None:
        """Copy the gradients of every param of the partition from the slot ``incoming``
        into ``grad`` (with ``outside``, of those no run of it covers): what a later pass,
        a rollback's sum or DeepSpeed's gradient readers take from ``grad``."""
        spans: list[list[int]] = []  # neighbouring params in one copy
        for segment in part.compact.segments:
            lo, hi = segment.offset, segment.offset + segment.numel
            if outside is not None and any(o <= lo and hi <= o + n for o, n, _ in outside):
                continue
            if spans and spans[-1][1] == lo:
                spans[-1][1] = hi
            else:
                spans.append([lo, hi])
        for lo, hi in spans:
            grad[lo:hi].copy_(incoming[lo:hi])

    def restore(self, part: HostPartition, runs) -> None:
        """Send the (unchanged) master of ``runs`` back: the device's params speculated on
        become the committed ones again."""
        host = self.host
        host.link.host_waits_for(part.last_h2d)
        for start, n, _ in host.pieces(part, runs):
            low = host.take_copy_out(part, start, n)
            low.copy_(part.master.narrow(0, start, n))
            host.send_params(part, low, start, n)

    def _most(self) -> int:
        return self.host.copy_out.piece_numel


def _commit_pieces(moments, runs) -> list[ops.CommitPiece]:
    """Each param of ``runs`` as a piece of ``ops.compact_adam_pieces``."""
    pieces = []
    for piece in moments.run_pieces(runs, moments.numel):
        first_block = piece.segment.first_block + piece.start // BLOCK
        pieces.append(
            ops.CommitPiece(
                piece.at, piece.numel, first_block, piece.step, piece.segment.salt, piece.start
            )
        )
    return pieces
