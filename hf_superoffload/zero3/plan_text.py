"""The ZeRO-3 memory plan in words (memory_plan.py computes its figures): its table, why a run
does not fit, and the parts it counts at their most. ``hf-superoffload plan`` prints them
(cli/plan_output.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .plan_allowances import CUDA_CONTEXT_BYTES

if TYPE_CHECKING:
    from .memory_plan import MemoryPlan

# Why a host phase above training's is the peak, by phase (shortfall_reasons).
_HOST_PHASE_WHY = {
    "training": "",
    "start-up": " while the optimizer is built",
    "resume": " while a checkpoint is loaded (a resume maps the optimizer file "
    "and copies it in a sub group at a time, beside the live state)",
    "save": " while the model is saved (rank 0 holds a shard of the 16-bit model beside its state)",
}


def upper_bound_reasons(plan: MemoryPlan) -> dict[str, str]:
    """Host parts counted at their most, each with why (``MemoryPlan.copy_out_at_most``)."""
    if plan.copy_out_at_most:
        return {
            "param_copy_out": "at most: none with cast 'auto' or 'gpu' on a GPU "
            "(HF_SUPEROFFLOAD_CAST); the cast was not given"
        }
    return {}


def shortfall_reasons(plan: MemoryPlan, gpu_memory: int, host_memory: int) -> list[str]:
    """Why the run does not fit a GPU of ``gpu_memory`` bytes and a host of ``host_memory``
    (empty when it fits), each with what to change."""
    reasons = []
    gpu_need = plan.gpu_need
    if gpu_need > gpu_memory:
        parts = plan.gpu_phases[plan.gpu_peak_phase]
        biggest = max(parts, key=parts.get)
        reasons.append(
            f"GPU: needs {gpu_need / 2**30:.1f} GiB per rank with the allocator's headroom, "
            f"has {gpu_memory / 2**30:.1f} (in the {plan.gpu_peak_phase} phase; largest "
            f"part: {biggest}, {parts[biggest] / 2**30:.1f} GiB); lower the "
            "batch or sequence length, add GPUs, or set offload_param / a ratio of 1.0"
        )
    host_need = plan.host_need
    if host_need > host_memory:
        why = _HOST_PHASE_WHY[plan.host_peak_phase]
        reasons.append(
            f"host: needs {host_need / 2**30:.1f} GiB (with the system's share) for "
            f"{plan.run.ranks_per_host or plan.run.ranks} rank(s){why}, has "
            f"{host_memory / 2**30:.1f}; use more hosts (fewer ranks per host), a lower "
            "ratio (more optimizer state on the GPU), fewer accumulation buffers "
            "(gradient_accumulation_steps 1), or a smaller model"
        )
    return reasons


def plan_table(plan: MemoryPlan) -> str:
    """Every part of the plan, GPU and host, by phase, in GiB."""

    def row(name: str, nbytes: int, note: str = "") -> str:
        return f"  {name:<22} {nbytes / 2**30:8.2f} GiB{note}"

    per_host = plan.run.ranks_per_host or plan.run.ranks
    phase = plan.host_peak_phase
    bounds = {name: f" ({why})" for name, why in upper_bound_reasons(plan).items()}
    return "\n".join(
        [
            f"{plan.shape.params / 1e9:.2f}B params, {plan.run.ranks} rank(s), seq "
            f"{plan.run.seq} x batch {plan.run.batch} per GPU",
            f"GPU per rank (allocated; +{CUDA_CONTEXT_BYTES / 2**30:.1f} GiB CUDA context):",
            *(row(name, nbytes) for name, nbytes in plan.gpu.items()),
            *(
                row(
                    f"{phase} phase",
                    sum(parts.values()),
                    " (the peak)" * (phase == plan.gpu_peak_phase),
                )
                for phase, parts in plan.gpu_phases.items()
            ),
            row("total", plan.gpu_bytes),
            "host per rank, while training:",
            *(row(name, nbytes, bounds.get(name, "")) for name, nbytes in plan.host.items()),
            row("training", plan.host_training, " (the peak)" * (phase == "training")),
            row("start-up", plan.host_start_up, " (the peak)" * (phase == "start-up")),
            row("resume", plan.host_resume, " (the peak)" * (phase == "resume")),
            row("save (rank 0)", plan.host_save, " (the peak)" * (phase == "save")),
            f"  {'peak':<22} {plan.host_bytes / 2**30:8.2f} GiB "
            f"({plan.host_bytes_per_host / 2**30:.1f} GiB for {per_host} rank(s) per host)",
        ]
    )
