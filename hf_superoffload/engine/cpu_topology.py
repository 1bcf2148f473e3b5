"""The host's CPUs as the core split needs them, read from /proc and /sys (no privileges).

``Topology`` holds what ``core_split.split_cores`` decides from: the CPUs this process may
run on, the CPUs the host lets the job use, the NUMA nodes' CPUs, and which CPUs are
hyperthreads of one physical core. ``read_topology`` reads them for this process; tests build
any ``Topology`` by hand.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

CPU_ROOT = Path("/sys/devices/system/cpu")
NODE_ROOT = Path("/sys/devices/system/node")
# The container's CPUs (cgroup v2, then v1): a process bound by nobody still sees only these.
CGROUP_CPUSETS = (
    Path("/sys/fs/cgroup/cpuset.cpus.effective"),
    Path("/sys/fs/cgroup/cpuset/cpuset.effective_cpus"),
    Path("/sys/fs/cgroup/cpuset/cpuset.cpus"),
)


@dataclasses.dataclass(frozen=True)
class Topology:
    usable: frozenset[int]  # this process's affinity
    host: frozenset[int]  # the CPUs any rank of the job may use on this host
    nodes: Mapping[int, frozenset[int]]  # NUMA node -> its CPUs (nodes without CPUs left out)
    core_of: Mapping[int, int]  # CPU -> a key its hyperthread siblings share (absent: own core)

    def core(self, cpu: int) -> int:
        return self.core_of.get(cpu, cpu)

    def node_of(self, cpus: Iterable[int]) -> int | None:
        """The NUMA node holding all of ``cpus``, None when they span nodes or none is known."""
        cpus = frozenset(cpus)
        return next((n for n, held in self.nodes.items() if cpus and cpus <= held), None)


def parse_cpulist(text: str) -> frozenset[int]:
    """``"0-3,8,10-11"`` -> {0, 1, 2, 3, 8, 10, 11}; raises ValueError on anything else."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        first, _, last = part.partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"not a CPU list: {text!r} (write e.g. 0-3,8)")
        low, high = int(first), int(last or first)
        if high < low:
            raise ValueError(f"not a CPU list: {text!r} ({part} runs backwards)")
        cpus.update(range(low, high + 1))
    return frozenset(cpus)


def format_cpulist(cpus: Iterable[int]) -> str:
    """{0, 1, 2, 3, 8} -> ``"0-3,8"``."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _cpulist_file(path: Path) -> frozenset[int] | None:
    text = _read(path)
    try:
        return parse_cpulist(text) if text else None
    except ValueError:
        return None


def host_cpus(usable: frozenset[int]) -> frozenset[int]:
    """Online CPUs within the container's cpuset; the affinity is always among them."""
    host = _cpulist_file(CPU_ROOT / "online") or frozenset(range(os.cpu_count() or 1))
    for path in CGROUP_CPUSETS:
        limit = _cpulist_file(path)
        if limit:
            host &= limit
            break
    return host | usable


def numa_node_cpus() -> dict[int, frozenset[int]]:
    nodes = {}
    for folder in NODE_ROOT.glob("node[0-9]*"):
        cpus = _cpulist_file(folder / "cpulist")
        if cpus:
            nodes[int(folder.name[4:])] = cpus
    return nodes


def hyperthread_cores(cpus: Iterable[int]) -> dict[int, int]:
    """CPU -> the lowest CPU of its hyperthread siblings (the same for all of them)."""
    core_of = {}
    for cpu in cpus:
        siblings = _cpulist_file(CPU_ROOT / f"cpu{cpu}" / "topology" / "thread_siblings_list")
        core_of[cpu] = min(siblings) if siblings else cpu
    return core_of


def read_topology() -> Topology:
    if hasattr(os, "sched_getaffinity"):
        usable = frozenset(os.sched_getaffinity(0))
    else:  # macOS, Windows: no affinity to read (nor threads to bind)
        usable = frozenset(range(os.cpu_count() or 1))
    host = host_cpus(usable)
    return Topology(usable, host, numa_node_cpus(), hyperthread_cores(host))


def pci_numa_node(pci_domain: int, pci_bus: int, pci_device: int) -> int | None:
    """The NUMA node the kernel assigns to a PCI device (None when it does not say)."""
    address = f"{pci_domain:04x}:{pci_bus:02x}:{pci_device:02x}.0"
    value = _read(Path(f"/sys/bus/pci/devices/{address}/numa_node"))
    return int(value) if value.lstrip("-").isdigit() and int(value) >= 0 else None


def gpu_numa_node(index: int) -> int | None:
    """The NUMA node of visible CUDA device ``index`` (None when torch or the kernel cannot
    say, e.g. a torch without the PCI ids in its device properties)."""
    import torch

    props = torch.cuda.get_device_properties(index)
    ids = [getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if any(not isinstance(value, int) for value in ids):
        return None
    return pci_numa_node(*ids)
