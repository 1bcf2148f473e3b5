"""Checks of what SuperOffloadOptimizer is given, with errors that say what to change."""

from __future__ import annotations

import os

import torch

HYPER_KEYS = ("lr", "betas", "eps", "weight_decay")


def check_group(group: dict) -> None:
    unknown = set(group) - {"params", *HYPER_KEYS, "initial_lr", "name"}
    if unknown:
        raise ValueError(
            f"unknown param-group keys {sorted(unknown)}; SuperOffloadOptimizer groups take "
            f"{list(HYPER_KEYS)}."
        )
    for key in ("lr", "eps", "weight_decay"):
        if float(group[key]) < 0:
            raise ValueError(f"{key} must be >= 0, got {float(group[key])}.")
    beta1, beta2 = group["betas"]
    if not (0 < beta1 < 1 and 0 < beta2 < 1):
        raise ValueError(
            f"betas must be in (0, 1) (a zero beta cannot be rolled back), got {group['betas']}."
        )
    if group["lr"] * group["weight_decay"] >= 1:
        raise ValueError(
            f"lr * weight_decay must be < 1 (got {group['lr']} * {group['weight_decay']}): the "
            f"decay factor 1 - lr * weight_decay must stay positive for a speculated step to be "
            f"undone. Lower lr or weight_decay."
        )


def common_device_and_dtype(params: list[torch.nn.Parameter]) -> tuple[torch.device, torch.dtype]:
    device, dtype = params[0].device, params[0].dtype
    for param in params:
        if param.device != device:
            raise ValueError(
                f"all trainable params must be on one device; found {device} and {param.device}. "
                f"Move the model with model.to(device) before building the optimizer."
            )
        if param.dtype != dtype:
            raise ValueError(
                f"all trainable params must share one dtype; found {dtype} and {param.dtype}. "
                f"Cast the model (e.g. model.to(torch.bfloat16)) first."
            )
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"params must be float32, bfloat16 or float16, got {dtype}.")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"params must be on a CUDA device or the CPU, got {device}.")
    return device, dtype


def cores_of_this_rank(bound: bool) -> int:
    """The cores this process may use, shared out between the ranks of one host unless each
    rank is ``bound`` to cores of its own."""
    cores = len(os.sched_getaffinity(0))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if local_ranks > 1 and not bound:
        cores = max(1, cores // local_ranks)
    return cores


def default_cpu_threads(device: torch.device) -> int:
    if device.type != "cuda":
        return torch.get_num_threads()
    # Ranks accelerate bound each to its GPU's NUMA node keep their cores; others share them
    # (set cpu_threads to override, e.g. after binding ranks yourself with numactl).
    cores = cores_of_this_rank(bound=os.environ.get("ACCELERATE_CPU_AFFINITY") == "1")
    # Leave one core to the training thread that feeds the GPU.
    return max(1, cores - 1)
