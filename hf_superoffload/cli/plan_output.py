"""What ``hf-superoffload plan`` prints: the plan of a run as text and as JSON, its model and
run lines, and the notes on the model."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from .hardware import GIB

if TYPE_CHECKING:
    from ..zero3.memory_plan import MemoryPlan
    from .plan import Verdict

# --loss: what computes the loss, as Zero3Run.fused_cross_entropy and label_smoothing name it,
# and what the output calls it. TRL's SFT and DPO trainers (examples/sft.py, the recipes)
# compute it through TRL's fused LM head whether or not Liger's kernels are on (TRL refuses
# Liger's fused cross-entropy), and TRL's SFTTrainer with label smoothing from the full logits.
LOSSES = {
    "full": (None, False, "the model's own (a batch's full logits)"),
    "smoothed": (None, True, "transformers' LabelSmoother (a batch's full logits)"),
    "trl": ("trl", False, "TRL's fused LM head (chunked, no full logits)"),
    "liger": ("liger", False, "Liger-Kernel's fused linear cross-entropy (no full logits)"),
}


def gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.1f} GiB"


def usage(verdict: Verdict) -> str:
    return (
        f"GPU {gib(verdict.gpu_need)} of {gib(verdict.gpu_memory)}, host "
        f"{gib(verdict.host_need)} of {gib(verdict.host_memory)}"
    )


def experts(config) -> tuple[int, int]:
    total = getattr(config, "num_local_experts", 0) or getattr(config, "num_experts", 0) or 0
    return total, getattr(config, "num_experts_per_tok", 0) or 0


def model_notes(config, plan: MemoryPlan) -> list[str]:
    total, top_k = experts(config)
    if not total:
        return []
    return [
        f"MoE ({total} experts, top-{top_k}): every expert's weights and optimizer state "
        f"count; the recomputed layer's MLP activations are planned "
        f"{plan.shape.active_intermediate} wide. The plan was checked against measured peaks "
        "of dense models only."
    ]


def bound_notes(plan: MemoryPlan) -> list[str]:
    """What the plan counted at its most, and how to count it exactly."""
    return [
        f"host {name} counted {why}. Give --cast the run's cast (its superoffload_cast or "
        "HF_SUPEROFFLOAD_CAST; with neither, auto) to count it exactly"
        for name, why in plan.upper_bounds.items()
    ]


def upper_bounds(plan: MemoryPlan) -> list[dict]:
    """The JSON's list of the parts counted at their most: which part, where, and why."""
    return [
        {"part": name, "counted_in": "host_bytes_per_rank", "bytes": plan.host[name], "why": why}
        for name, why in plan.upper_bounds.items()
    ]


def model_line(source, plan: MemoryPlan) -> str:
    shape, config = plan.shape, source.config
    total, top_k = experts(config)
    moe = f", {total} experts (top-{top_k})" if total else ""
    return (
        f"model: {source.name} ({config.model_type}, {shape.params / 1e9:.2f}B params, "
        f"{shape.layers} layers, hidden {shape.hidden}, vocab {shape.vocab}{moe})"
    )


def run_line(plan: MemoryPlan) -> str:
    run, split = plan.run, plan.split
    where = (
        "all optimizer state on the host"
        if not split.device_count
        else f"the first {split.device_count} sub groups' optimizer state on the GPU "
        f"({split.device_numel / 1e9:.2f}B params, {split.device_numel / split.partition:.0%} "
        "of the partition)"
    )
    extras = [
        f"{len(split.numels)} sub groups (speculation buckets) of up to "
        f"{run.sub_group_size / 1e6:.1f}M params (a larger param alone)",
        where,
    ]
    if run.dtype_bytes == 4:
        extras.append("fp32 weights")
    if run.offload_param:
        extras.append("the params on the host")
    if not run.activation_checkpointing:
        extras.append("no activation checkpointing: every layer's saved tensors on the GPU")
    elif run.activation_checkpoint_offload:
        extras.append("checkpointed layer inputs in pinned host memory")
    if run.gradient_accumulation > 1:
        extras.append(f"gradient accumulation {run.gradient_accumulation}")
    extras.append(f"loss: {loss_label(run)}")
    extras.append("cast not given" if run.cast is None else f"cast {run.cast}")
    return (
        f"run: {run.ranks} GPU(s), {run.ranks_per_host} per host, seq {run.seq} x batch "
        f"{run.batch} per GPU, ratio {run.ratio}; " + ", ".join(extras)
    )


def loss_label(run) -> str:
    chosen = (run.fused_cross_entropy, run.label_smoothing)
    return next(label for *value, label in LOSSES.values() if tuple(value) == chosen)


def as_text(source, capacity, verdict: Verdict, suggestions, notes) -> str:
    plan = verdict.plan
    per_host = plan.run.ranks_per_host
    lines = [
        model_line(source, plan),
        run_line(plan),
        f"hardware: {capacity.label}: {gib(capacity.gpu_memory)} per GPU, "
        f"{gib(verdict.host_memory)} per host of {per_host} GPU(s) ({capacity.source})",
        "",
        plan.table(),
        "",
        f"GPU per rank: needs {gib(verdict.gpu_need)} with the allocator's headroom and the "
        f"CUDA context, has {gib(verdict.gpu_memory)} "
        f"({verdict.gpu_need / verdict.gpu_memory:.0%})",
        f"host, {per_host} rank(s): needs {gib(verdict.host_need)} with the system's share, "
        f"has {gib(verdict.host_memory)} ({verdict.host_need / verdict.host_memory:.0%})",
        f"host bytes per param while training: {plan.host_bytes_per_param:.1f} (a lower "
        "--ratio moves the state of the first sub groups to the GPU, "
        f"{10 if plan.run.compact_moments else 16} bytes per param there)",
        *(f"note: {note}" for note in notes),
        "",
    ]
    if verdict.fits:
        lines.append("fits")
    else:
        lines.append("does not fit, because " + "; and ".join(verdict.reasons))
        lines.extend(f"change: {suggestion}" for suggestion in suggestions)
    return "\n".join(lines)


def as_json(source, capacity, verdict: Verdict, suggestions, notes) -> dict:
    plan, split = verdict.plan, verdict.plan.split
    per_param = ("param_numels", "param_decays")  # the model's every param: not for the output
    return {
        "model": {
            "name": source.name,
            "config": source.path,
            "model_type": source.config.model_type,
            **{k: v for k, v in dataclasses.asdict(plan.shape).items() if k not in per_param},
        },
        "run": dataclasses.asdict(plan.run),
        "hardware": {
            "name": capacity.label,
            "gpu_memory_bytes": verdict.gpu_memory,
            "host_memory_bytes": verdict.host_memory,
            "gpus_per_host": plan.run.ranks_per_host,
            "source": capacity.source,
        },
        "gpu_bytes_per_rank": plan.gpu,
        "host_bytes_per_rank": plan.host,
        "gpu_total_bytes": plan.gpu_bytes,
        "sub_groups": {
            "count": len(split.numels),
            "on_gpu": split.device_count,
            "gpu_params_per_rank": split.device_numel,
            "host_params_per_rank": split.host_numel,
        },
        "host_total_bytes_per_rank": plan.host_bytes,
        "host_training_bytes_per_rank": plan.host_training,
        "host_start_up_bytes_per_rank": plan.host_start_up,
        "host_resume_bytes_per_rank": plan.host_resume,
        "host_save_bytes_rank0": plan.host_save,
        "host_peak": plan.host_peak_phase,
        "host_total_bytes_per_host": plan.host_bytes_per_host,
        "host_bytes_per_param": plan.host_bytes_per_param,
        # Parts counted at their most (the figures above include them as counted).
        "upper_bounds": upper_bounds(plan),
        "gpu_need_bytes": verdict.gpu_need,
        "host_need_bytes": verdict.host_need,
        "fits": verdict.fits,
        "reasons": verdict.reasons,
        "suggestions": suggestions,
        "notes": notes,
    }
