"""The GPU and host memory a planned run is checked against, from the options, a hardware
preset or, failing both, this machine.

Explicit ``--gpu-mem`` / ``--cpu-mem`` win over the preset, so a preset can be corrected for
one's own site (a GH200 node with a different memory size, say).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from .errors import UsageError
from .hardware import GIB, PRESETS, preset

# What the optimizer's start-up check compares its host state with; MemTotal would say "fits"
# where the check refuses (memory others use, a container's limit).
HOST_SOURCE = (
    "the host memory available now, as the optimizer's start-up check counts it: MemAvailable, "
    "or less where the memory limit of this process's cgroup or of a parent leaves less (its "
    "usage less the inactive page cache the kernel reclaims first); "
    "HF_SUPEROFFLOAD_HOST_MEMORY_GIB where set (on VMs whose memory grows on use MemAvailable "
    "reads low: set it, or give --cpu-mem)"
)


@dataclasses.dataclass(frozen=True)
class Capacity:
    label: str  # a preset's name, "custom" or "this machine"
    gpu_memory: int  # bytes per GPU
    gpus_per_host: int | None  # ranks sharing one host's memory; None: all on one host
    source: str  # where the figures come from, for the output
    host_memory_for: Callable[[int], int]  # GPUs on one host -> bytes of memory they share

    def ranks_per_host(self, gpus: int) -> int:
        return gpus if self.gpus_per_host is None else min(self.gpus_per_host, gpus)


def _gib(value: float | None, option: str) -> int | None:
    if value is None:
        return None
    if not value > 0:
        raise UsageError(f"{option} must be a positive number of GiB, got {value}")
    return int(value * GIB)


def resolve(args) -> Capacity:
    """What ``plan``'s options say to check against."""
    gpu_memory = _gib(args.gpu_mem, "--gpu-mem")
    host_memory = _gib(args.cpu_mem, "--cpu-mem")
    if args.gpus_per_host is not None and args.gpus_per_host < 1:
        raise UsageError(f"--gpus-per-host must be at least 1, got {args.gpus_per_host}")
    if args.hardware:
        hardware = preset(args.hardware)
        overridden = gpu_memory is not None or host_memory is not None
        return Capacity(
            label=hardware.name + (" (overridden)" if overridden else ""),
            gpu_memory=gpu_memory or hardware.gpu_memory,
            gpus_per_host=args.gpus_per_host or hardware.gpus_per_domain,
            source=hardware.source + ("; --gpu-mem/--cpu-mem override it" if overridden else ""),
            host_memory_for=(lambda _: host_memory) if host_memory else hardware.host_memory_for,
        )
    gpu_memory = gpu_memory or _this_gpu()
    if gpu_memory is None:
        raise UsageError(
            f"no GPU here to plan for: name one with --hardware {'|'.join(PRESETS)}, or give "
            "--gpu-mem (GiB per GPU) and --cpu-mem (GiB per host)"
        )
    if host_memory:
        host_source = "--cpu-mem"
    else:
        host_memory, here = _this_host()
        host_source = f"{HOST_SOURCE}; here {here}"
    custom = args.gpu_mem is not None and args.cpu_mem is not None
    return Capacity(
        label="custom" if custom else "this machine",
        gpu_memory=gpu_memory,
        gpus_per_host=args.gpus_per_host,
        source="--gpu-mem/--cpu-mem" if custom else f"this machine: torch, and {host_source}",
        host_memory_for=lambda _: host_memory,
    )


def _this_gpu() -> int | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory


def _this_host() -> tuple[int, str]:
    """The host memory the run may take here, and what says so, as the optimizer's start-up
    check counts it (engine/host_memory.host_memory_available): so that a plan that fits this
    machine is not refused there at start."""
    from ..engine.host_memory import host_memory_available  # here: it loads torch

    try:
        return host_memory_available()
    except ValueError as error:  # a bad HF_SUPEROFFLOAD_HOST_MEMORY_GIB, refused there too
        raise UsageError(str(error)) from None
    except (OSError, KeyError, IndexError) as error:
        raise UsageError(
            f"cannot read this host's available memory ({error}): give --cpu-mem (GiB per host)"
        ) from None
