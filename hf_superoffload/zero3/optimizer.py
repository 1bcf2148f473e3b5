"""SuperOffload on DeepSpeed ZeRO-3: the stage-3 optimizer whose CPU-offloaded sub groups are
stepped by the STV core (``engine/stv.py``) instead of DeepSpeed's CPU Adam.

DeepSpeed keeps doing what it does: partitioning params, gradients and the fp32 masters over
the data-parallel ranks, reduce-scattering gradients, all-gathering params, the global norm,
checkpoints (``zero_to_fp32`` included). This class changes four things:

1. ``partition_grads``: at the accumulation boundary, as a sub group's reduced gradient
   partitions land in its host buffer, the sub group launches on the STV core, which steps it
   speculatively on the worker thread during the rest of backward (``backward_offload.py``).
2. ``step``: DeepSpeed's global norm (all ranks) validates the step: commit, replay with the
   clip coefficient, or skip on a non-finite norm; every rank takes the same verdict.
   The sub groups ``ratio`` keeps on the GPU step there, ours too (``device_sub_groups.py``).
3. ``step`` returns before the CPU work it queued is done: each param's all-gather (the next
   forward's, DeepSpeed's prefetches, any other) first waits for the sub groups it reads.
   Persistent params (DeepSpeed keeps small ones gathered and re-gathers them at the end of
   ``step``) get sub groups of their own, settled first, so that gather waits only for them.
4. The Adam moments of the host sub groups live in the base optimizer's state (keyed by the
   fp32 partitions, as with DeepSpeed's CPU Adam), so DeepSpeed's checkpoints carry them; a
   resume reads them back memory-mapped, in place, from our sub-group cut or DeepSpeed's
   (``checkpoint_load.py``, ``checkpoint_universal.py``).

Each rank holds only its partition: fp32 master, both moments and a gradient buffer in
DeepSpeed's gradient accumulation dtype (bf16 unless configured otherwise; DeepSpeed's own fp32
gradient buffer is dropped), plus a few shared buffers the kernel writes the rounded params into
(``engine/copy_out.py``): 14 B/param in bf16. With compact moments, a few gradient buffers of
the largest sub group too (``engine/grad_slots.py``).
"""

from __future__ import annotations

import functools
import logging
import time
import weakref

import torch
from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.utils import combine_grad_norm_groups, is_invalid_grad_norm
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from deepspeed.utils import log_dist

from .. import ops
from ..engine.cast_policy import choose_cast_plan
from ..engine.core_split import use_team
from ..engine.device_speculation import DeviceSpeculation
from ..engine.grad_slots import GradSlots
from ..engine.link import Link
from ..engine.replicas import Replicas, closes_replicas_on_failure
from ..engine.stv import Stv, Verdict, validate
from .accessors import HostGradientAccessors
from .activation import OPT_OUT_ENV
from .backward_offload import BackwardOffload
from .checkpoint_layout import LAYOUT_KEY, as_record, live_layout
from .checkpoint_load import load_rank_state
from .checkpoint_universal import load_universal_state
from .device_sub_groups import DeviceSubGroups, device_sub_group_count
from .gather_waits import wrap_gathers
from .host_parts import copy_out_ring, copy_out_ring_dtype, micro_batches_accumulate
from .host_state import HostState, compact_salts
from .norms import sub_group_norms
from .options import (
    check_supported,
    cores_perc_if_set,
    resolve_options,
    resolve_sizes,
)
from .rank_failures import share_failures
from .sub_groups import SubGroupLayout

logger = logging.getLogger("hf_superoffload")

OPTIMIZER_STEP_TIMER = "optimizer_step"


def deepspeed_clip_coef(total_norm: torch.Tensor, clip: float) -> float:
    """The gradient multiplier of DeepSpeed's ``unscale_and_clip_grads`` at loss scale 1,
    computed as it does (a clamped divisor, then its reciprocal), so both agree to the bit."""
    divisor = torch.clamp((total_norm + 1e-6) / clip, min=1.0)
    return float(1.0 / divisor)


def _shuts_down_on_failure(init):
    """A constructor that fails after the STV core exists stops its worker thread (and
    unpins the link's buffers) before the error propagates: each failed attempt would
    otherwise leave one running."""

    @functools.wraps(init)
    def wrapper(self, *args, **kwargs):
        try:
            init(self, *args, **kwargs)
        except BaseException:
            finalizer = self.__dict__.get("_finalizer")
            if finalizer is not None:
                finalizer()
            raise

    return wrapper


@share_failures  # one rank's failure ends the others promptly, with its error
class SuperOffloadZero3Optimizer(
    SubGroupLayout,
    HostState,
    DeviceSubGroups,
    HostGradientAccessors,
    BackwardOffload,
    DeepSpeedZeroOptimizer_Stage3,
):
    @closes_replicas_on_failure
    @_shuts_down_on_failure
    def __init__(self, module, init_optimizer, param_names, timers, ds_config, **kwargs):
        began = time.perf_counter()  # start-up is long for big models: the log says where
        device = torch.device(get_accelerator().current_device_name())
        # Its failure watch runs from the first collective on (the host check's): NCCL's wait
        # through a peer's death ends by its abort.
        self._replicas = Replicas(kwargs.get("dp_process_group"), device)
        perc = cores_perc_if_set(kwargs.get("offload_optimizer_config"))
        options = resolve_options(perc, device)
        # What DeepSpeed cuts its sub groups at, which the global norm follows (sub_groups.py);
        # ours may differ. The host check counts the sub groups ours cut.
        self.norm_sub_group_size = resolve_sizes(kwargs, ds_config)
        check_supported(init_optimizer, ds_config, kwargs, self._replicas, options, device.type)
        # The sub groups "ratio" keeps on the GPU are ours to step (device_sub_groups.py says
        # why); DeepSpeed offloads all and builds none of its partial-offload machinery.
        ratio, kwargs["offload_ratio"] = kwargs.get("offload_ratio", 1.0), 1.0
        self._holds_elements: dict[int, bool] = {}  # ds_id -> _has_gradient_partition
        self.norm_sub_groups: list[list] = []  # DeepSpeed's cut, for the norm (sub_groups.py)
        # Read by the set-up hooks below, which DeepSpeed's constructor calls.
        self._accumulates = micro_batches_accumulate(kwargs, ds_config)
        self._compact = options.compact
        self._device_speculation = None  # made once the link is (DeviceSpeculation)
        self.moments = "compact" if options.compact else "fp32"
        self._salt_of = compact_salts(init_optimizer, kwargs.get("dp_process_group"))
        super().__init__(module, init_optimizer, param_names, timers, ds_config, **kwargs)
        deepspeed_seconds = time.perf_counter() - began
        use_team(options.team, device.type)  # its thread count, and its CPUs for the worker
        ops.prepare()  # build or load the CPU Adam now, visibly, not inside step 1
        self._zero_padding()

        self._link = Link(device, pinned=self._pin_transfers)
        dtype = self.fp16_partitioned_groups_flat[0].dtype
        n_sub_groups = len(self.fp32_partitioned_groups_flat)
        self._device_parts = self._build_device_sub_groups(
            device_sub_group_count(ratio, n_sub_groups)
        )
        self._device_part_at = {part.index: part for part in self._device_parts}
        # Gradients: DeepSpeed hands each partition over in its accumulation dtype, and the
        # kernel reads that dtype (bf16: 2 B/param over the link, not DeepSpeed's fp32 4).
        # Params: the measured plan says whether the master or the kernel's rounded copy goes.
        params_on_device = choose_cast_plan(options.cast, device, dtype).params_on_device
        host_numels = [
            m.numel() for i, m in enumerate(self.fp32_partitioned_groups_flat)
            if i not in self._device_part_at
        ]  # fmt: skip
        # The rule the memory plan and the host check count it by (host_parts.py).
        ring_dtype = copy_out_ring_dtype(dtype, options.cast, device.type, self._compact)
        self._copy_out = copy_out = copy_out_ring(self._link, host_numels, ring_dtype)
        # Compact moments: where a sub group's next gradients land while its deferred update
        # keeps its gradient buffer (engine/deferred_commits.py); memory_plan counts them.
        self._grad_slots = None
        if self._compact and host_numels:
            self._grad_slots = GradSlots(
                self._link, max(host_numels), self.gradient_accumulation_dtype
            )
        # Compact moments with the params on the GPU speculate there (memory_plan counts it).
        if self._compact and host_numels and self.fp16_partitioned_groups_flat[0].is_cuda:
            self._device_speculation = DeviceSpeculation(
                self._link, max(host_numels), self.gradient_accumulation_dtype
            )
        self._stv = Stv(
            self._link,
            lambda: self.optimizer.param_groups,
            n_sub_groups,
            speculate=options.speculate,
            speculate_after_clip=options.speculate_after_clip,
            copy_out=copy_out,
            grad_slots=self._grad_slots,
            device_speculation=self._device_speculation,
        )
        self._finalizer = weakref.finalize(self, _shutdown, self._stv, self._link, self._replicas)
        self._stv.clip_threshold = self.clip_grad or None
        self._host_parts = self._build_host_partitions(params_on_device)
        self._host_part_at = {part.index: part for part in self._host_parts}
        self._pending_params = self._params_expecting_gradients()
        self._launched: set[int] = set()
        # Params whose final gradient partition of this window reached its sub group at the
        # boundary; the others reduced in the window are taken from DeepSpeed's
        # accumulation buffer in step().
        self._boundary_arrivals: set[int] = set()
        self._part_of_param = {
            p.ds_id: part for part in self._host_parts for p in self.fp16_groups[part.index]
        }
        # Settle order: persistent params' sub groups first (step() gathers them), then
        # forward order (sub group 0 holds the first layers).
        persistent = [p for p in self._host_parts if self._holds_persistent(p.index)]
        self._settle_order = persistent + [p for p in self._host_parts if p not in persistent]
        self._persistent_parts = persistent
        # Every ZeRO-3 param of the module, frozen ones too: DeepSpeed gathers a list through
        # its first param's function (GatheredParameters: the lowest ds_id, a frozen first
        # layer's; the prefetch: the first of a set), which must wait for ours in the list.
        for param in _zero3_params(module, self.fp16_groups):
            wrap_gathers(param, self._wait_for_params)
        self.last_step_skipped = False
        log_dist(
            f"hf_superoffload: SuperOffload on ZeRO-3 runs in place of DeepSpeed's "
            f"({len(self._host_parts)} of {len(self.fp32_partitioned_groups_flat)} sub groups "
            f"on the host, {options.cpu_threads} CPU Adam threads, speculate={options.speculate}, "
            f"moments={self.moments}; {OPT_OUT_ENV}=0 runs DeepSpeed's own); built in "
            f"{time.perf_counter() - began:.1f} s, {deepspeed_seconds:.1f} of them in "
            "DeepSpeed's partitioning",
            ranks=[0],
            level=logging.WARNING,  # once per run, and the user must see which engine runs
        )

    # ------------------------------------------------------------------------- set-up

    def _wait_for_params(self, params) -> None:
        parts = {id(part): part for p in params if (part := self._part_of_param.get(p.ds_id))}
        if parts:
            self._stv.wait_for(parts.values(), consume=False)

    # ------------------------------------------------------------------------- validation

    def _get_norm_groups(self):
        """The gradient norms of the sub groups DeepSpeed's own cut makes, not of ours: the
        global norm is a vector norm of these, which rounds by the cut, so over DeepSpeed's
        it is DeepSpeed's to the bit, and so is the clip coefficient."""
        groups = self.norm_sub_groups
        norms = sub_group_norms(self, groups)  # None: model or expert parallelism
        if norms is None:  # DeepSpeed's own path, over the same sub groups
            norms = [self.complete_grad_norm_calculation_for_cpu_offload(g) for g in groups]
        return norms

    @torch.no_grad()
    def step(self, closure=None):
        self._launch_the_rest()  # before _pre_step forgets which params got gradients
        self._pre_step()
        self._partition_all_parameters()
        norm = combine_grad_norm_groups(self._get_norm_groups())  # all-reduced by DeepSpeed
        invalid = is_invalid_grad_norm(norm)
        unscaled = torch.tensor(float("nan")) if invalid else (norm / self.loss_scale).float()
        result = validate(unscaled.cpu(), self.clip_grad or None, deepspeed_clip_coef)
        self._stv.conclude(result, self._settle_order)
        self.last_step_skipped = result.verdict is Verdict.SKIP
        self._step_device_sub_groups(None if self.last_step_skipped else result.clip_coef)
        self._launched.clear()
        self._boundary_arrivals.clear()
        self._pending_params = self._params_expecting_gradients()
        for part in self._host_parts + self._device_parts:
            part.save_steps(self.optimizer.state[part.master], self._step_value)
        if self.last_step_skipped:
            self._stv.synchronize(self._host_parts)  # rollbacks read the gradient buffers
            self.overflow = True
            self._loss_scale_update_and_overflow_cleanup()
            return

        self.overflow = False
        self._global_grad_norm = norm / self.loss_scale
        timer_names = {OPTIMIZER_STEP_TIMER}
        self.timers(OPTIMIZER_STEP_TIMER).start()
        for i in range(len(self.fp16_groups)):  # points the params' partitions at the flats
            self._unflatten_partitioned_parameters(i)
        self.timers(OPTIMIZER_STEP_TIMER).stop()
        self._post_step(timer_names)  # gathers the persistent params: waits for theirs only

    def synchronize(self) -> None:
        """Wait for all CPU work in flight; afterwards the partitions and the host state hold
        the new values (compact moments' deferred writes are done too)."""
        self._gradients_landed()  # what a flush moves out of gradient slots is there
        self._stv.flush()
        self._stv.synchronize(self._host_parts)
        for part in self._host_parts:
            self._link.host_waits_for(part.last_h2d)

    # ------------------------------------------------------------------------- state

    @property
    def stats(self) -> dict[str, float]:
        return {
            **self._stv.stats.as_dict(),
            "buckets": len(self.fp32_partitioned_groups_flat),
            "gpu_tail_buckets": len(self._device_parts),  # the standalone engine's names
            "gpu_tail_params": sum(part.numel for part in self._device_parts),
        }

    # Checkpoints: DeepSpeed's format, with our sub-group cut recorded beside it so that
    # DeepSpeed's own optimizers read it back (checkpoint_hooks.py); read memory-mapped, in place.
    reads_mapped_checkpoints = True  # checkpoint_hooks.map_optimizer_files

    def state_dict(self):
        self.synchronize()
        state = super().state_dict()
        state[LAYOUT_KEY] = as_record(live_layout(self))
        return state

    def load_state_dict(
        self,
        state_dict_list,
        load_optimizer_states=True,
        load_from_fp32_weights=False,
        checkpoint_folder=None,
        load_serial=None,
        param_shapes=None,
    ):
        self.synchronize()
        if checkpoint_folder:
            load_universal_state(
                self, checkpoint_folder, load_optimizer_states, load_from_fp32_weights
            )
            return
        rank = dist.get_rank(group=self.dp_process_group)
        load_rank_state(self, state_dict_list[rank], load_optimizer_states)
        if load_serial is not None:  # DeepSpeed's serial loading: let the next rank load
            load_serial += 1
            del state_dict_list[rank]
            if dist.get_local_rank() != dist.get_world_size() - 1:
                dist.send(tensor=load_serial, dst=dist.get_rank() + 1)
        if self.persistent_parameters:  # DeepSpeed's checkpoint epilogue gathers them again
            self.persistent_parameters[0].partition(self.persistent_parameters)

    def destroy(self):
        try:
            self._finalizer()  # raises a worker failure nobody was told of
        finally:
            super().destroy()


def _zero3_params(module: torch.nn.Module, groups) -> list[torch.nn.Parameter]:
    """The module's ZeRO-3 params and the optimizer's, each once."""
    params = {id(p): p for p in module.parameters() if hasattr(p, "all_gather_coalesced")}
    params.update((id(p), p) for group in groups for p in group)
    return list(params.values())


def _shutdown(stv: Stv, link: Link, replicas: Replicas) -> None:
    replicas.close()
    try:
        stv.close()  # raises a worker failure nobody was told of
    finally:
        link.close()  # after the worker: its last tasks may still use the host buffers
