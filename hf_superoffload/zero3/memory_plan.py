"""How much GPU and host memory a run on the ZeRO-3 path needs, per rank, from the model's
config alone (built on the meta device: nothing is allocated).

Host, per rank (``SuperOffloadZero3Optimizer.host_bytes`` names the same parts): the rank's
partition of the fp32 master (4 B/param) and both moments (8), its gradients in DeepSpeed's
accumulation dtype (2 in bf16), DeepSpeed's host accumulation buffer when micro-batches
accumulate (2), the 16-bit params when ``offload_param`` puts them there (2), the copy-out ring
where params are cast on the host (``host_parts.copy_out_ring_dtype``: none with the default
cast on a GPU; with ``cast`` not given, counted at its most, ``MemoryPlan.upper_bounds``),
with compact moments a few gradient slots of the largest host sub group, and the process
itself (CUDA context, libraries: measured, ``HOST_PROCESS_BYTES``). While the optimizer is
built, DeepSpeed holds the whole partition's fp32 masters (4 B/param), and its accumulation
buffer (2 in bf16) when micro-batches accumulate, before the GPU tail's masters move: when
nearly all the state is on the GPU that start-up is the host's peak.

GPU, per rank, as torch's allocator counts it (``max_memory_allocated``; the CUDA context comes
on top): the 16-bit param partition, the params ZeRO-3 gathers around the layer being computed
(with more than one rank), the optimizer state of the sub groups ``ratio`` keeps on the GPU
(fp32 master, moments and gradients: 16 B/param), the reduce bucket, the activations, and the
logits with the loss's fp32 copies (12 B per logit: bf16 logits, the fp32 upcast, its fp32
gradient and the bf16 gradient). With activation checkpointing the activations are each layer's
input (with activation checkpoint offload only the one being recomputed; the rest wait in pinned
host memory, a host part) and one layer recomputed in backward. Without it they are every tensor
autograd saves (``activation_memory.decoder_saved_bytes``, for the decoders it counts; others
are refused) and the gradients of one layer's MLP in flight in backward.

``ratio`` is a share of the optimizer's sub groups, as in DeepSpeed: the plan cuts the params
into sub groups as the optimizer does (``sub_group_cut.py``: the Trainer's decay and no-decay
param groups, DeepSpeed's persistent params apart, ``sub_group_size``), so it counts the same
sub groups on the GPU. A resume holds a little more host memory than training (about two
sub groups' saved state, ``resume_extra_host_bytes``): the plan's host peak, which ``plan``
checks and ``--ratio auto`` sizes by, is the largest of training, start-up and resume.

Checked against every measured peak (tests/test_zero3_memory_plan.py's MEASURED: Llama-3.1-8B
and 3.37B on one H100 at ``ratio`` 1.0 down to 0.3, Qwen3-14B on 2 x H200 at 0.85, 3.37B and
Qwen3-30B-A3B on 4 x H200), with the cast those runs had ("auto"): GPU 0.6-2.4% above the
measured allocation, host within 0.6% of the measured resident memory (the process's own
bytes, ``HOST_PROCESS_BYTES``, are a measured constant).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..engine.bucket import device_state_bytes
from ..engine.copy_out import copy_out_bytes
from ..engine.device_speculation import device_speculation_bytes
from ..engine.device_tail import step_scratch_bytes
from .activation_memory import (
    DecoderWidths,
    decoder_saved_bytes,
    layer_inputs_gpu_bytes,
    layer_inputs_host_bytes,
)
from .host_parts import (
    copy_out_ring_dtype,
    optimizer_host_parts,
    resume_extra_host_bytes,
    start_up_host_bytes,
)
from .loss_memory import loss_bytes
from .model_shape import ModelShape
from .plan_allowances import CUDA_CONTEXT_BYTES, GPU_HEADROOM, HOST_HEADROOM, HOST_PROCESS_BYTES
from .plan_text import plan_table, shortfall_reasons, upper_bound_reasons
from .save_memory import STREAMED_SHARD_BYTES, streamed_save_host_bytes
from .sub_group_cut import (
    Param,
    SubGroupSplit,
    persistent_params,
    split_sub_groups,
    sub_group_blocks,
    sub_group_numels,
)

# What the GPU holds while the device sub groups step (after backward); the logits are
# counted whole as the Trainer's outputs may still hold them.
STEP_PHASE_GPU = (
    "param_partition",
    "gathered_params",
    "optimizer_on_gpu",
    "reduce_bucket",
    "logits_and_loss",
    "optimizer_step_scratch",
)


# DeepSpeed's names of its data_types.grad_accum_dtype (DtypeEnum's), in the plan's run.
GRAD_ACCUM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclasses.dataclass(frozen=True)
class Zero3Run:
    seq: int
    batch: int  # per GPU
    ranks: int = 1  # data-parallel GPUs in all
    ranks_per_host: int | None = None  # None: all on one host
    ratio: float = 1.0  # share of sub groups whose optimizer state is on the host
    offload_param: bool = False
    gradient_accumulation: int = 1
    sub_group_size: int = 1 << 25  # the shipped DeepSpeed configs'
    reduce_bucket_size: int = 1 << 25
    # stage3_max_live_parameters: how many params DeepSpeed keeps gathered at once (the shipped
    # configs leave DeepSpeed's default).
    max_live_parameters: int = 1_000_000_000
    dtype_bytes: int = 2  # bf16 params, gradients and activations
    # stage3_param_persistence_threshold; None: the Trainer's "auto", 10 x hidden_size.
    persistence_threshold: int | None = None
    # The base optimizer's param groups: the Trainer's decay and no-decay groups, or one
    # group of model.parameters() (a plain DeepSpeed script, benchmarks/suite.py).
    decay_groups: bool = True
    # False: a run that never saves the model (no checkpoints, no final save), so rank 0 never
    # holds a shard of the 16-bit model (save_extra_host_bytes).
    saves_model: bool = True
    # The loss: None, the model's own (a batch's full logits); "liger" or "trl", a fused loss
    # that holds a chunk of them (FUSED_CROSS_ENTROPY says which runs use each).
    fused_cross_entropy: str | None = None
    # With fused_cross_entropy None: transformers' LabelSmoother computes the loss from the full
    # logits (TRL's SFTTrainer with label_smoothing_factor), not the model's own loss.
    label_smoothing: bool = False
    # Both Adam moments compact (8 bits a value, engine/compact_moments.py), not fp32.
    compact_moments: bool = False
    # The checkpointed layers' inputs in pinned host memory between forward and backward
    # (the recipes' --activation_checkpoint_offload; activation_memory.py).
    activation_checkpoint_offload: bool = False
    # False: no activation checkpointing, every layer keeps what autograd saves (the Trainer's
    # activation_checkpointing / gradient_checkpointing off).
    activation_checkpointing: bool = True
    # The run's cast (HF_SUPEROFFLOAD_CAST: "auto", "gpu" or "cpu"), which says whether the
    # copy-out ring is made; None: not known, the ring counted at its most (upper_bounds).
    cast: str | None = None
    device_type: str = "cuda"  # the ranks' device ("cpu": DeepSpeed's CPU accelerator)
    # DeepSpeed's gradient accumulation dtype, its config's data_types.grad_accum_dtype ("bf16",
    # "fp16" or "fp32"); None: not set there, the model's dtype (gradient_dtype).
    grad_accum_dtype: str | None = None


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    shape: ModelShape
    run: Zero3Run
    gpu: dict[str, int]  # per rank, bytes by what holds them
    host: dict[str, int]  # per rank, while training
    # Per rank, while the optimizer is built: DeepSpeed's fp32 masters of the whole partition
    # and its accumulation buffer, before the GPU tail's masters move and that buffer goes.
    host_start_up: int = 0
    # Per rank, while a checkpoint is loaded into the built optimizer (resume_host_bytes).
    host_resume: int = 0
    split: SubGroupSplit | None = None  # the optimizer's sub groups and ratio's cut of them
    # Rank 0, while the model is saved (a checkpoint or the final save): training's state and
    # the streamed save's shard of the 16-bit model (save_extra_host_bytes).
    host_save: int = 0

    @property
    def gpu_phases(self) -> dict[str, dict[str, int]]:
        """The GPU's parts in each phase: forward and backward (everything but the step's
        scratch), and the optimizer step after backward, when the layers' activations are
        freed and the device sub groups' step makes its scratch."""
        return {
            "forward/backward": {
                k: v for k, v in self.gpu.items() if k != "optimizer_step_scratch"
            },
            "step": {k: self.gpu[k] for k in STEP_PHASE_GPU if k in self.gpu},
        }

    @property
    def gpu_peak_phase(self) -> str:
        return max(self.gpu_phases.items(), key=lambda item: sum(item[1].values()))[0]

    @property
    def gpu_bytes(self) -> int:
        """The larger phase's bytes (``gpu_phases``)."""
        return sum(self.gpu_phases[self.gpu_peak_phase].values())

    @property
    def host_training(self) -> int:
        return sum(self.host.values())

    @property
    def copy_out_at_most(self) -> bool:
        """Whether the copy-out ring is counted at its most: the run's cast is not given, and
        the optimizer makes none where params are cast on the GPU (compact moments make it
        under every cast: then it is no bound)."""
        run = self.run
        if run.cast is not None or not self.host["param_copy_out"]:
            return False
        dtype = _model_dtype(run.dtype_bytes)
        return not copy_out_ring_dtype(dtype, "gpu", run.device_type, run.compact_moments)

    @property
    def upper_bounds(self) -> dict[str, str]:
        """Host parts counted at their most, each with why (plan_text.upper_bound_reasons)."""
        return upper_bound_reasons(self)

    @property
    def host_bytes(self) -> int:
        """The host peak per rank (rank 0's): training's, the start-up's (when a low ``ratio``
        keeps so much on the GPU that building the optimizer needs more), a resume's, or a
        save's."""
        return max(self.host_training, self.host_start_up, self.host_resume, self.host_save)

    @property
    def host_bytes_without_resume(self) -> int:
        """The host peak per rank of a run that loads no checkpoint (what a benchmark's
        resident memory measures)."""
        return max(self.host_training, self.host_start_up)

    @property
    def host_peak_phase(self) -> str:
        """Which of training, start-up, resume and save holds the most (the first on a tie)."""
        peak = self.host_bytes
        phases = {
            "training": self.host_training,
            "start-up": self.host_start_up,
            "resume": self.host_resume,
            "save": self.host_save,
        }
        return next(name for name, nbytes in phases.items() if nbytes == peak)

    @property
    def host_bytes_per_param(self) -> float:
        """Host bytes per param of this rank's partition while training, the process
        included: 14 plus the process at ``ratio`` 1.0 in bf16, less where ``ratio`` keeps
        state on the GPU."""
        return self.host_training / math.ceil(self.shape.params / self.run.ranks)

    @property
    def host_bytes_per_host(self) -> int:
        """Every rank of the host at its peak, or rank 0 saving while the others hold their
        training state (the larger)."""
        ranks = self.run.ranks_per_host or self.run.ranks
        each = max(self.host_training, self.host_start_up, self.host_resume)
        return max(ranks * each, (ranks - 1) * self.host_training + self.host_save)

    @property
    def gpu_need(self) -> float:
        """GPU bytes per rank with the allocator's headroom and the CUDA context."""
        return self.gpu_bytes * (1 + GPU_HEADROOM) + CUDA_CONTEXT_BYTES

    @property
    def host_need(self) -> float:
        """Host bytes per host (``host_bytes_per_host``) with the system's share."""
        return self.host_bytes_per_host * (1 + HOST_HEADROOM)

    def shortfalls(self, gpu_memory: int, host_memory: int) -> list[str]:
        """Why the run does not fit a GPU of ``gpu_memory`` bytes and a host of
        ``host_memory`` (empty when it fits): plan_text.shortfall_reasons."""
        return shortfall_reasons(self, gpu_memory, host_memory)

    def table(self) -> str:
        """The plan's parts as a table (plan_text.plan_table)."""
        return plan_table(self)


def plan_sub_groups(shape: ModelShape, run: Zero3Run) -> SubGroupSplit:
    """The optimizer's sub groups for ``run`` and ``ratio``'s cut of them, as
    ``sub_group_cut`` makes them from the model's params: the base optimizer's groups (the
    Trainer's decay and no-decay ones, or one), DeepSpeed's persistence threshold,
    ``sub_group_size`` and the rank's partition."""
    if not shape.param_numels:
        raise ValueError("the model shape lists no params (build it with ModelShape.of)")
    threshold = run.persistence_threshold
    if threshold is None:
        threshold = 10 * shape.hidden  # transformers' value for "auto"
    flags = persistent_params(shape.param_numels, threshold)
    params = [Param(n, keep) for n, keep in zip(shape.param_numels, flags, strict=True)]
    if run.decay_groups:
        decays = shape.param_decays
        groups = [
            [p for p, decay in zip(params, decays, strict=True) if decay],
            [p for p, decay in zip(params, decays, strict=True) if not decay],
        ]
    else:
        groups = [params]
    numels = sub_group_numels(groups, run.ranks, run.sub_group_size)
    blocks = sub_group_blocks(groups, run.ranks, run.sub_group_size) if run.compact_moments else ()
    return split_sub_groups(numels, run.ratio, blocks)


def save_extra_host_bytes(shape: ModelShape, run: Zero3Run) -> int:
    """Host bytes rank 0 holds beyond training's while the model is saved (the Trainer's
    checkpoints and final save): the streamed ZeRO-3 save (``streaming_save.py``) gathers one
    param at a time and holds at most one shard of ``STREAMED_SHARD_BYTES`` in 16 bits and one
    more param (``streamed_save_host_bytes``, the figure the save's own accounting is tested
    against)."""
    return streamed_save_host_bytes(run.dtype_bytes * shape.largest_param, STREAMED_SHARD_BYTES)


def activation_gpu_bytes(config, shape: ModelShape, run: Zero3Run) -> dict[str, int]:
    """GPU bytes of the activations per rank, by part. With activation checkpointing: the
    layers' inputs (activation_memory.py) and the layer recomputed in backward. Without: every
    tensor autograd saves (``decoder_saved_bytes``; ValueError for a model it does not count),
    and the first layer's backward beyond them: the gradient of its MLP's product, then of the
    gate and up projections, as their saved inputs are freed."""
    tokens, low = run.seq * run.batch, run.dtype_bytes
    in_flight = 3 * low * tokens * shape.active_intermediate
    if run.activation_checkpointing:
        offload = run.activation_checkpoint_offload
        return {
            "layer_inputs": layer_inputs_gpu_bytes(
                shape.layers, tokens, shape.hidden, low, offload
            ),
            "layer_recompute": in_flight,
        }
    if run.activation_checkpoint_offload:
        raise ValueError(
            "activation checkpoint offload moves the inputs activation checkpointing keeps, and "
            "activation checkpointing is off: turn it on, or drop the offload"
        )
    widths = DecoderWidths.of(config)
    return {
        "layer_activations": decoder_saved_bytes(widths, run.batch, run.seq, low),
        "layer_backward": in_flight,
    }


def _model_dtype(dtype_bytes: int) -> torch.dtype:
    """The params' dtype of ``Zero3Run.dtype_bytes`` (fp16 is refused on this path)."""
    if dtype_bytes not in (2, 4):
        raise ValueError(f"dtype_bytes must be 2 (bf16) or 4 (fp32), got {dtype_bytes}")
    return torch.bfloat16 if dtype_bytes == 2 else torch.float32


def gradient_dtype(run: Zero3Run) -> torch.dtype:
    """The dtype the optimizer's gradients are in: DeepSpeed's gradient accumulation dtype
    (``DeepSpeedEngine.get_data_types``: the config's ``data_types.grad_accum_dtype``, else the
    model's), which the optimizer reads as ``gradient_accumulation_dtype``. The host gradients,
    DeepSpeed's accumulation buffer, the gradient slots and the speculative passes' staging on
    the GPU all hold it."""
    if run.grad_accum_dtype is None:
        return _model_dtype(run.dtype_bytes)
    if run.grad_accum_dtype not in GRAD_ACCUM_DTYPES:
        raise ValueError(
            f"grad_accum_dtype must be None (the model's) or one of "
            f"{', '.join(GRAD_ACCUM_DTYPES)}, got {run.grad_accum_dtype!r}"
        )
    return GRAD_ACCUM_DTYPES[run.grad_accum_dtype]


def zero3_memory_plan(config, run: Zero3Run, shape: ModelShape | None = None) -> MemoryPlan:
    """Per-rank GPU and host bytes of training ``config``'s model on the ZeRO-3 path
    (``shape``: ``ModelShape.of(config)`` when the caller has it, for plans of many runs)."""
    if not 0.0 <= run.ratio <= 1.0:
        raise ValueError(f"ratio must be within [0, 1], got {run.ratio}")
    shape = shape or ModelShape.of(config)
    low = run.dtype_bytes
    grad_dtype = gradient_dtype(run)
    split = plan_sub_groups(shape, run)
    partition = split.partition  # padding included: at most one element a param
    tokens = run.seq * run.batch

    compact = run.compact_moments
    ring = copy_out_ring_dtype(_model_dtype(low), run.cast, run.device_type, compact)
    copy_out = copy_out_bytes(split.largest_host_sub_group, ring)
    host = {
        **optimizer_host_parts(
            partition,
            split.host_numel,
            grad_dtype.itemsize,
            copy_out,
            run.gradient_accumulation > 1,
            split.host_blocks if compact else None,
            split.largest_host_sub_group,
        ),
        "offloaded_params": low * partition if run.offload_param else 0,
        "offloaded_layer_inputs": layer_inputs_host_bytes(
            shape.layers, tokens, shape.hidden, low, run.activation_checkpoint_offload
        ),
        "process": HOST_PROCESS_BYTES,
    }
    gathered = 0
    if run.ranks > 1:
        # DeepSpeed prefetches and keeps params gathered up to max_live_parameters; a layer in
        # use and the next one, or the embedding, are gathered whatever the limit. Measured at
        # 3.37B on 4 ranks: 12.43 GiB, 1.1 GiB above a plan of two layers only.
        live = min(run.max_live_parameters, shape.params)
        gathered = low * max(live, 2 * shape.layer_params, shape.vocab * shape.hidden)
    gpu = {
        "param_partition": 0 if run.offload_param else low * partition,
        "gathered_params": gathered,
        "optimizer_on_gpu": device_state_bytes(split.device_numel, split.device_blocks, compact),
        "optimizer_step_scratch": (
            step_scratch_bytes(split.largest_device_sub_group, compact, run.device_type)
            if split.device_count
            else 0
        ),
        # Compact moments: the speculative pass's staging on the GPU (device_speculation.py).
        "compact_speculation": (
            device_speculation_bytes(split.largest_host_sub_group, grad_dtype)
            if compact and run.device_type == "cuda" and not run.offload_param
            else 0
        ),
        "reduce_bucket": low * run.reduce_bucket_size,
        **activation_gpu_bytes(config, shape, run),
        "logits_and_loss": loss_bytes(config, shape, run, tokens),
    }
    start_up = (
        start_up_host_bytes(partition, grad_dtype.itemsize, run.gradient_accumulation > 1)
        + host["offloaded_params"]
        + host["process"]
    )
    # A resume loads before the first forward, before the offloaded layer inputs take their
    # pinned blocks.
    resume = (
        sum(host.values())
        - host["offloaded_layer_inputs"]
        + resume_extra_host_bytes(split, compact)
    )
    save = sum(host.values()) + save_extra_host_bytes(shape, run) if run.saves_model else 0
    return MemoryPlan(shape, run, gpu, host, start_up, resume, split, save)
