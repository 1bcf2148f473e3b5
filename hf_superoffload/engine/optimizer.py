"""SuperOffloadOptimizer: AdamW with fp32 master weights and moments in CPU memory, stepped
speculatively during backward and validated afterwards (see stv.py).

Life of a step (one GPU; with no GPU the same runs on CPU tensors, copies in place of streams):
1. Backward (``_arrival``, grad_arrival.py): a post-accumulate-grad hook stages each param's
   final gradient into its bucket. When a bucket is complete its partial squared norm is
   computed on the device and its gradients leave for pinned host memory on a side stream;
   the worker thread then runs the CPU Adam on it *speculatively* and sends the updated
   params back on another stream.
2. step(): the global norm decides (``_stv``, stv.py): commit, or replay every speculated
   bucket with the clip coefficient (one fused pass), or roll everything back (non-finite
   gradients). The tail buckets (first layers, last to get gradients) step on the device with
   torch's AdamW (``_tail``, tail_moves.py, which also moves buckets there and back).
3. The next forward waits, per module, only for the buckets it is about to use (``_waits``,
   forward_waits.py).
Each part owns its state and is built with exactly what it may touch (``_compose``); the
optimizer owns the param groups, the buckets, the link, the replicas and the STV core.

Exactness: commits and replays equal AdamW + clip_grad_norm_ to fp32 rounding (the replay's
error is a few ulp of the terms of the undone step, see ops/adam.py; speculating with the
last step's clip coefficient keeps that ratio near 1 when clipping persists). A skipped step
is bit-exact when its non-finite gradients reach the first bucket to arrive (any NaN/Inf
loss does) - the worker stops speculating as soon as a bucket's norm is non-finite - and
within the rollback's rounding for buckets speculated before the bad one arrived.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Iterable

import torch

from .. import ops
from . import clip_routing, lifecycle, ownership, state_io
from .adamw_switches import without_switches
from .bucket import Bucket
from .cast_policy import choose_cast_plan, rank0_plan
from .checks import (
    DEFAULT_BUCKET_SIZE,  # noqa: F401  (the ZeRO-3 path's sub group size when left out)
    check_arguments,
    check_params_attached,
    checked_trainable,
    common_device_and_dtype,
    group_defaults,
    resolve_options,
)
from .core_split import choose_team, use_team
from .forward_waits import ForwardWaits
from .grad_arrival import GradArrival
from .layout import lay_out
from .link import Link
from .placement import make_tail_tuner
from .replicas import Replicas, closes_replicas_on_failure, shares_failures
from .stv import Stv, Verdict, validate
from .tail_moves import TailMoves, cap_bytes


class SuperOffloadOptimizer(torch.optim.Optimizer):
    @shares_failures  # with replicas, an error here ends the other ranks at once
    @closes_replicas_on_failure
    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        max_grad_norm: float | None = 1.0,
        # The engine options; None: left out (its HF_SUPEROFFLOAD_* variable, else the default).
        gpu_tail: int | str | None = None,
        gpu_tail_cap: float | None = None,
        bucket_size: int | None = None,
        cpu_threads: int | None = None,
        speculate: bool | None = None,
        speculate_after_clip: bool | None = None,
        cast: str | None = None,
        moments: str | None = None,
        model: torch.nn.Module | None = None,
        gradient_accumulation_steps: int = 1,
        process_group: torch.distributed.ProcessGroup | None = None,
        amsgrad: bool = False,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        **unknown,
    ):
        # torch.optim.AdamW's switches: no-op values accepted, others refused.
        switches = dict(amsgrad=amsgrad, maximize=maximize, foreach=foreach, fused=fused)
        switches.update(capturable=capturable, differentiable=differentiable)
        given = dict(gpu_tail=gpu_tail, gpu_tail_cap=gpu_tail_cap, bucket_size=bucket_size)
        given.update(cpu_threads=cpu_threads, speculate=speculate, cast=cast, moments=moments)
        given.update(speculate_after_clip=speculate_after_clip)
        check_arguments(
            unknown, _KEYWORDS, max_grad_norm, gradient_accumulation_steps, given, switches
        )
        # Explicit > HF_SUPEROFFLOAD_* > default, as the trainers resolve them.
        options = resolve_options(given)
        self.moments = options.moments  # "fp32" or "compact": how both Adam moments are held
        defaults = group_defaults(lr, betas, eps, weight_decay)
        super().__init__(without_switches(params), defaults)
        trainable = checked_trainable(self.param_groups, max_grad_norm, gradient_accumulation_steps)
        self.max_grad_norm = max_grad_norm or None
        self.global_grad_norm: float | None = None
        self.last_step_skipped = False
        self._taken_over = False  # another optimizer took the params over (ownership.py)

        # Build or load the CPU Adam now, visibly, not inside step 1; a refused
        # HF_SUPEROFFLOAD_CPU_ADAM_ISA stops here, before the params are claimed.
        ops.prepare()
        ownership.claim(trainable, self)
        try:
            self._build(trainable, options, model, gradient_accumulation_steps, process_group)
        except BaseException:  # the params go back unowned, with none of our hooks on them
            lifecycle.undo_construction(self, [id(p) for p in trainable])
            raise

    def _build(self, trainable, options, model, accumulation_steps: int, process_group) -> None:
        """The constructor after the params are claimed: every part (``options`` resolved)."""
        device, dtype = common_device_and_dtype(trainable)
        # This rank's share of the host's cores.
        use_team(choose_team(device, options.cpu_threads), device.type)
        # Data parallelism (process_group, or the initialised default group): each rank
        # averages every bucket's gradients with the others, so the model must not also be
        # wrapped in DistributedDataParallel.
        self._replicas = Replicas(process_group, device)
        self._replicas.broadcast_([p.data for p in trainable])

        self._link = Link(device)
        self._cast = rank0_plan(choose_cast_plan(options.cast, device, dtype), self._replicas)
        cap = cap_bytes(options.gpu_tail_cap)
        layout = lay_out(
            self.param_groups,
            model,
            bucket_size=options.bucket_size,
            gpu_tail=options.gpu_tail,
            cap_bytes=cap,
            accumulating=accumulation_steps > 1,
            link=self._link,
            replicas=self._replicas,
            cast=self._cast,
            dtype=dtype,
            compact=options.moments == "compact",
        )
        self._buckets, self._slot = layout.buckets, layout.slot  # slot: id(param) -> (bucket, i)
        this = weakref.ref(self)  # hooks and the STV core must not keep the optimizer alive
        self._stv = Stv(
            self._link,
            lambda: this().param_groups,
            len(self._buckets),
            speculate=options.speculate,
            speculate_after_clip=options.speculate_after_clip,
            copy_out=layout.copy_out,
            grad_slots=layout.grad_slots,
        )
        self._stv.clip_threshold = self.max_grad_norm
        self._stv.worker.publish = self._replicas.publish_failure  # this optimizer's failure
        self.stats_counters = self._stv.stats
        tuner = make_tail_tuner(options.gpu_tail, device)
        self._compose(trainable, model, accumulation_steps, tuner, cap)
        hooks, ids = [self._arrival.handles, self._waits.handles], list(self._slot)
        self._finalizer = weakref.finalize(
            self, lifecycle.shutdown, self._stv, hooks, self._link, ids, self._replicas
        )
        clip_routing.install()  # torch's clip_grad_norm_ over our params clips through us

    def _compose(self, params, model, accumulation_steps: int, tuner, cap: int | None) -> None:
        """Build the parts over ``self._buckets``: the forward waits, the gradient arrival
        (which starts and stops the waits' watch) and the GPU tail."""
        self._waits = ForwardWaits(
            slot=self._slot, before_forward=lifecycle.before_forward(weakref.ref(self)), model=model
        )
        shared = dict(
            buckets=self._buckets, link=self._link, replicas=self._replicas, stv=self._stv
        )
        self._arrival = GradArrival(
            **shared,
            params=params,
            slot=self._slot,
            cast=self._cast,
            accumulation_steps=accumulation_steps,
            watch=self._waits,
        )
        self._tail = TailMoves(**shared, tuner=tuner, cap_bytes=cap)

    # ----------------------------------------------------------------------------- public API

    @property
    def stats(self) -> dict[str, float]:
        """The STV counters, plus where the buckets are now (``gpu_tail="auto"`` moves
        them): ``gpu_tail_buckets`` of ``buckets``, ``gpu_tail_params`` elements, and
        ``tail_tuning`` (1 while ``auto`` is growing the tail or probing a smaller one; 0 once
        settled, when it only watches)."""
        return {
            **self.stats_counters.as_dict(),
            "buckets": len(self._buckets),
            "gpu_tail_buckets": sum(b.on_device for b in self._buckets),
            "gpu_tail_params": self._tail.device_elements(),
            "tail_tuning": int(self._tail.tuning),
        }

    def host_bytes(self) -> dict[str, int]:
        """Host memory the optimizer holds now, by what holds it (the names of the memory
        check's parts, engine/host_memory.py)."""
        return state_io.held_bytes(self, on_device=False)

    def device_bytes(self) -> dict[str, int]:
        """Device memory the GPU tail's state holds now, by what holds it."""
        return state_io.held_bytes(self, on_device=True)

    @property
    def gradient_accumulation_steps(self) -> int:
        """Backward passes per step() unless ``set_accumulation_boundary`` says otherwise."""
        return self._arrival.counts.accumulation_steps

    @property
    def replica_count(self) -> int:
        """Ranks holding this optimizer's whole state as data-parallel replicas (1 alone)."""
        return self._replicas.size

    @property
    def gpu_tail_cap(self) -> float | None:
        """Most GPU memory (GiB) the GPU tail's optimizer state may hold, or None. Lowering
        it between steps gives buckets back at the next step()."""
        cap = self._tail.cap_bytes
        return None if cap is None else cap / 2**30

    @gpu_tail_cap.setter
    def gpu_tail_cap(self, gib: float | None) -> None:
        self._tail.cap_bytes = cap_bytes(gib)

    def releasable_device_tail(self) -> int:
        """The elements ``release_device_tail`` would move now (0: it would give nothing back)."""
        return self._tail.releasable()

    def release_device_tail(self, reason: str) -> int:
        """Move every tail bucket that ``auto`` may move back to the host and return the
        allocator's cached blocks to the driver (the CUDA out-of-memory recovery); later
        growth stays below what the tail held before. Returns the elements moved."""
        return self._tail.release(reason)

    @ownership.in_use
    def set_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Say whether the coming backward ends an accumulation window (integrations know this
        from accelerate's ``sync_gradients``); None returns to counting backward passes."""
        self._arrival.set_boundary(is_boundary)

    @ownership.in_use
    def clip_grad_norm_(self, max_norm: float | None = None) -> torch.Tensor:
        """The pre-clip global norm of the current gradients, computed during backward.

        Clipping itself happens in step() (validation); ``max_norm``, when given, becomes the
        threshold, so a Trainer's clip call and the STV engine agree on one value.
        """
        if max_norm is not None:
            self.max_grad_norm = max_norm or None
        return self._arrival.total_norm()

    @ownership.in_use
    def trainable_params(self) -> list[torch.nn.Parameter]:
        """The params this optimizer steps (those that required grad when it was built)."""
        return [p for bucket in self._buckets for p in bucket.plan.params]

    @ownership.in_use
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard the gradients of this step so far, as AdamW's zero_grad does: buckets that
        already speculated on them are rolled back, and the next backward starts afresh."""
        super().zero_grad(set_to_none)  # params whose gradients we do not take (frozen ones)
        self._stv.raise_if_failed()  # a task failed since step() (an early write): say so now
        if self._arrival.any_arrived:  # else nothing arrived since the last step (the usual)
            self._arrival.discard()

    @shares_failures  # with replicas, a failure here is published, withdrawn when handled
    @ownership.in_use
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_params_attached()
        result = validate(self._arrival.total_norm(), self.max_grad_norm)
        self.global_grad_norm = result.total_norm
        self.last_step_skipped = result.verdict is Verdict.SKIP
        # Forward order (first layers first): the next forward needs those first.
        self._stv.conclude(result, [b for b in reversed(self._buckets) if not b.on_device])
        if result.verdict is not Verdict.SKIP:
            self._tail.step(result.clip_coef)
        self._arrival.end_step()
        if not self._waits.per_module:
            self._stv.synchronize(self._buckets)
        self._tail.after_step()
        return loss

    @ownership.in_use
    def synchronize(self) -> None:
        """Wait for all CPU work in flight; afterwards the model params and the optimizer's
        state hold the new values (compact moments' deferred writes are done too)."""
        self._stv.flush()
        self._stv.synchronize(self._buckets)

    @ownership.in_use
    def master_state(self, param: torch.nn.Parameter) -> dict:
        """Copies of the fp32 master, both moments and the step count of ``param``."""
        self.synchronize()
        return state_io.param_state(self, param)

    def manages(self, param: torch.Tensor) -> bool:
        """Whether this optimizer steps ``param`` (and so holds its fp32 master)."""
        return id(param) in self._slot

    @ownership.in_use
    def master_view(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The fp32 master weight of ``param`` itself: a view of the optimizer's buffer shaped
        like ``param`` (host memory; device memory for a tail bucket), no copy.

        Updates still in flight for it are waited for first, so it holds the value of the last
        step() and may be written to. A write changes the master only, not the model's param:
        copy the value there too (as ``load_state_dict`` does), and write between steps only,
        never between backward() and step(), while a speculative update may be in it."""
        bucket, i = self._slot_of(param)
        self._stv.settle_state([bucket])
        self._link.host_waits_for(bucket.last_h2d)  # no transfer still reads it
        return bucket.views(bucket.master, i)

    def _slot_of(self, param: torch.Tensor) -> tuple[Bucket, int]:
        slot = self._slot.get(id(param))
        if slot is None:
            raise ValueError(
                f"this param (shape {tuple(param.shape)}, {param.dtype}) has no fp32 master in "
                f"SuperOffloadOptimizer: it is in none of the optimizer's param groups, or it "
                f"did not require grad when the optimizer was built (optimizer.manages(param) "
                f"tells)."
            )
        return slot

    @ownership.in_use
    def state_dict(self) -> dict:
        return state_io.state_dict(self)

    @ownership.in_use
    def load_state_dict(self, state_dict: dict) -> None:
        state_io.load_state_dict(self, state_dict)

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_buckets", None) is not None:
            raise NotImplementedError(
                "SuperOffloadOptimizer lays out its host buffers, hooks and buckets when it is "
                "built and cannot add a param group afterwards; build it with every group "
                "(requires_grad=False params may join a group and stay frozen)."
            )
        super().add_param_group(param_group)

    def __reduce_ex__(self, protocol):  # copy.deepcopy and copy.copy come here too
        raise TypeError(_NOT_COPYABLE)

    def close(self) -> None:
        """Stop the worker and remove the hooks; idempotent."""
        self._finalizer()

    def _give_up_params(self) -> None:
        """A newer optimizer takes these params over (``ownership.claim``): a step begun is
        rolled back (the params get their values from before it), the worker stops, the hooks
        go, and the buffers are dropped before the newer one allocates its own. A failed
        worker rolls nothing back (worker.WorkerError says what the params hold then), and
        its failure, if nobody was told of it, raises here once all that is done."""
        if self._arrival.any_arrived and self._stv.worker.healthy:
            self._arrival.discard()
        try:
            self.close()
        finally:
            self._taken_over = True
            self._buckets, self._slot = [], {}  # parts over no buckets: every buffer goes
            self._compose([], None, self.gradient_accumulation_steps, None, self._tail.cap_bytes)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check_params_attached(self) -> None:
        check_params_attached(self._buckets)


# The constructor's keyword names (a misspelled one gets the closest of these).
_SIGNATURE = inspect.signature(SuperOffloadOptimizer.__init__).parameters
_KEYWORDS = [name for name in _SIGNATURE if name not in ("self", "params", "unknown")]

_NOT_COPYABLE = (
    "SuperOffloadOptimizer cannot be copied or pickled: it owns a worker thread, page-locked "
    "host buffers and hooks on the model's params. Save state_dict() and load it into a new "
    "optimizer built over the (copied) model."
)
