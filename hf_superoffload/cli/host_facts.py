"""What the host's CPU side offers: CPU model and SIMD features, NUMA nodes, and memory
bandwidth partitioning (resctrl: Intel RDT on x86, MPAM on Arm). Read from /proc and /sys
only, so it is instant and needs no privileges.
"""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

# SIMD and matrix features that matter to the CPU Adam and to torch's CPU kernels.
_X86_FEATURES = (
    "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
    "avx512_fp16", "amx_bf16", "amx_tile",
)  # fmt: skip
_ARM_FEATURES = ("asimd", "asimdhp", "sve", "sve2", "bf16", "svebf16", "i8mm")
# Resource-control flags (Intel RDT, AMD PQoS): cache allocation, memory bandwidth allocation.
_X86_RESCTRL_FLAGS = ("rdt_a", "cat_l3", "cat_l2", "cdp_l3", "mba", "cqm_llc", "cqm_mbm_total")
# "CPU part" of Arm cores as /proc/cpuinfo numbers them (it has no model name on Arm).
_ARM_PARTS = {
    "0xd4f": "Neoverse V2 (NVIDIA Grace)",
    "0xd40": "Neoverse V1",
    "0xd0c": "Neoverse N1",
    "0xd49": "Neoverse N2",
}

NODE_ROOT = Path("/sys/devices/system/node")
RESCTRL_ROOT = Path("/sys/fs/resctrl")


def _read(path: Path | str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _cpuinfo_field(text: str, name: str) -> str | None:
    match = re.search(rf"^{re.escape(name)}\s*:\s*(.*)$", text, re.MULTILINE)
    return match.group(1).strip() if match else None


def cpu() -> dict:
    info = _read("/proc/cpuinfo")
    machine = platform.machine()
    model = _cpuinfo_field(info, "model name")
    if model is None:
        part = _cpuinfo_field(info, "CPU part")
        model = _ARM_PARTS.get(part or "", f"CPU part {part}" if part else platform.processor())
    flags = set((_cpuinfo_field(info, "flags") or _cpuinfo_field(info, "Features") or "").split())
    wanted = _ARM_FEATURES if machine in ("aarch64", "arm64") else _X86_FEATURES
    facts = {
        "model": model or "unknown",
        "arch": machine,
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "features": [name for name in wanted if name in flags],
        "resctrl_flags": [name for name in _X86_RESCTRL_FLAGS if name in flags],
    }
    sve_bytes = _read("/proc/sys/abi/sve_default_vector_length").strip()
    if sve_bytes.isdigit():  # Grace: 16 bytes, i.e. 128-bit SVE2
        facts["sve_vector_bits"] = 8 * int(sve_bytes)
    return facts


def expected_isa(cpu_facts: dict) -> str:
    """The instruction set the CPU Adam would pick here, from /proc/cpuinfo; the compiled
    kernel decides for itself (ops/csrc/dispatch.cpp) and is asked instead once it is built."""
    features = set(cpu_facts["features"])
    if "avx512f" in features:
        return "avx512"
    if {"avx2", "fma", "f16c"} <= features:
        return "avx2"
    if cpu_facts["arch"] in ("aarch64", "arm64"):
        return "sve" if "sve" in features else "neon"
    return "scalar"


def numa_nodes() -> list[dict]:
    """One entry per NUMA node: its CPUs and memory. A node with memory but no CPUs is
    device or far memory (on GH200 the GPU's HBM shows up that way)."""
    nodes = []
    for folder in sorted(NODE_ROOT.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        meminfo = _read(folder / "meminfo")
        match = re.search(r"MemTotal:\s*(\d+)\s*kB", meminfo)
        nodes.append(
            {
                "node": int(folder.name[4:]),
                "cpus": _read(folder / "cpulist").strip(),
                "memory_bytes": int(match.group(1)) * 1024 if match else None,
            }
        )
    return nodes


def resctrl(cpu_facts: dict) -> dict:
    """Whether cache / memory-bandwidth partitioning can be used to keep the CPU Adam from
    starving the training process (the paper uses MPAM on Grace)."""
    kernel = "resctrl" in _read("/proc/filesystems").split()
    mounted = (RESCTRL_ROOT / "info").is_dir()
    resources = []
    if mounted:
        resources = sorted(p.name for p in (RESCTRL_ROOT / "info").iterdir() if p.is_dir())
    if not kernel:
        hint = "the kernel has no resctrl (needs CONFIG_X86_CPU_RESCTRL, or ARM64_MPAM on Arm)"
    elif not mounted:
        hint = "supported but not mounted: mount -t resctrl resctrl /sys/fs/resctrl (as root)"
    else:
        hint = "mounted"
    return {
        "kernel_support": kernel,
        "mounted": mounted,
        "resources": resources,
        "cpu_flags": cpu_facts["resctrl_flags"],
        "status": hint,
    }
