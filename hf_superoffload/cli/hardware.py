"""Hardware presets for ``plan``: the nodes people train on, with the GPU and host memory the
software sees.

A preset is one node: its GPUs, the memory of each as ``torch.cuda.get_device_properties(i)
.total_memory`` reports it (what the plan's allocator headroom is measured against; a little
under the card's label), and its host memory per memory domain: the ranks of one domain share
it. An x86 node is one domain (all its GPUs share the host's memory); on a Grace node each Grace
CPU's memory belongs to its own GPUs (one on GH200, two on GB200), and a rank is bound to its
Grace. ``--gpus`` beyond one node's count means more nodes of the same kind.

Where the figures come from:
- GPU memory measured with torch: H100 80GB HBM3 79.18 GiB, H200 141GB 139.9 GiB, GH200 96GB
  HBM3 95.1 GiB, each 0.99 GiB per labelled GB. Cards not measured here (GH200 144GB HBM3e,
  B200 of GB200 at 186 GB) are estimated at the same 0.99 GiB per labelled GB; ``--gpu-mem``
  gives the figure of one's own card.
- Host memory of x86 nodes: NVIDIA's DGX H100 and DGX H200 datasheets give 2 TB of system
  memory (2 TiB of DIMMs; HGX H100/H200 cloud nodes such as AWS p5.48xlarge have 2 TiB too), of
  which the kernel leaves about 97.7% to processes (MemTotal read 125 GiB of a 128 GiB host):
  2000 GiB.
- Grace memory: 480 GB LPDDR5X per Grace CPU (NVIDIA's GH200 Grace Hopper Superchip and GB200
  datasheets), taken as decimal GB, 447 GiB: the safe side.
"""

from __future__ import annotations

import dataclasses
import math

from .errors import UsageError

GIB = 2**30
GPU_GIB_PER_LABELLED_GB = 0.99  # torch / label, measured on H100, H200 and GH200
X86_NODE_HOST = 2000 * GIB  # 2 TiB of DIMMs less the kernel's share (see above)
GRACE_HOST = 480 * 10**9  # LPDDR5X per Grace CPU


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    summary: str
    node_gpus: int  # GPUs in one node
    gpu_memory: int  # bytes per GPU, as torch reports them
    gpus_per_domain: int  # GPUs sharing one host memory domain
    domain_memory: int  # bytes of one domain's host memory
    source: str  # where the numbers come from

    def host_memory_for(self, gpus_on_host: int) -> int:
        """Bytes of host memory ``gpus_on_host`` ranks of one host share: the memory of the
        domains they fill."""
        return self.domain_memory * max(1, math.ceil(gpus_on_host / self.gpus_per_domain))


def _estimated(labelled_gb: float) -> int:
    return int(labelled_gb * GPU_GIB_PER_LABELLED_GB * GIB)


_H100_GPU = int(79.18 * GIB)  # measured: nvidia-smi 81559 MiB, torch 79.18 GiB
_H200_GPU = int(139.9 * GIB)  # measured: nvidia-smi 143771 MiB, torch about 480 MiB less
_VM_HOST = 125 * GIB  # measured: free(1) on a 1-GPU VM with a 128 GiB host

PRESETS = {
    h.name: h
    for h in (
        Hardware(
            name="h100-sxm-8",
            summary="8 x H100 80GB SXM sharing 2 TiB of host memory (DGX/HGX H100)",
            node_gpus=8,
            gpu_memory=_H100_GPU,
            gpus_per_domain=8,
            domain_memory=X86_NODE_HOST,
            source="GPU: 79.18 GiB measured with torch; host: DGX H100's 2 TB, 2000 GiB usable",
        ),
        Hardware(
            name="h200-sxm-8",
            summary="8 x H200 141GB SXM sharing 2 TiB of host memory (DGX/HGX H200)",
            node_gpus=8,
            gpu_memory=_H200_GPU,
            gpus_per_domain=8,
            domain_memory=X86_NODE_HOST,
            source="GPU: 139.9 GiB measured with torch; host: DGX H200's 2 TB, 2000 GiB usable",
        ),
        Hardware(
            name="h100",
            summary="1 x H100 80GB on a 128 GiB host (a one-GPU cloud VM); --gpus N: N such VMs",
            node_gpus=1,
            gpu_memory=_H100_GPU,
            gpus_per_domain=1,
            domain_memory=_VM_HOST,
            source="measured: torch 79.18 GiB, free(1) 125 GiB of the 128 GiB host",
        ),
        Hardware(
            name="h200",
            summary="1 x H200 141GB on a 128 GiB host (a one-GPU cloud VM); --gpus N: N such VMs",
            node_gpus=1,
            gpu_memory=_H200_GPU,
            gpus_per_domain=1,
            domain_memory=_VM_HOST,
            source="measured: torch 139.9 GiB, free(1) 125 GiB of the 128 GiB host",
        ),
        Hardware(
            name="gh200",
            summary="GH200 superchip, 96 GB HBM3 variant: 1 GPU with its Grace's 480 GB LPDDR5X; "
            "--gpus N: N superchips, each with its own memory",
            node_gpus=1,
            gpu_memory=int(95.1 * GIB),  # nvidia-smi 97871 MiB, torch about 480 MiB less
            gpus_per_domain=1,
            domain_memory=GRACE_HOST,
            source="GPU: 95.1 GiB of the 96 GB HBM3 as torch reports it; host: 480 GB (447 GiB) "
            "per superchip, its label",
        ),
        Hardware(
            name="gh200-144gb",
            summary="GH200 superchip, 144 GB HBM3e variant: 1 GPU with its Grace's 480 GB "
            "LPDDR5X; --gpus N: N superchips",
            node_gpus=1,
            gpu_memory=_estimated(144),
            gpus_per_domain=1,
            domain_memory=GRACE_HOST,
            source="GPU: 144 GB HBM3e, estimated at 0.99 GiB per GB as torch reports (not "
            "measured; --gpu-mem corrects it); host: 480 GB (447 GiB) per superchip",
        ),
        Hardware(
            name="gb200",
            summary="GB200 node (NVL4 board or NVL72 compute tray): 4 B200 ~186 GB and 2 Grace "
            "CPUs, each Grace's 480 GB LPDDR5X shared by its 2 GPUs",
            node_gpus=4,
            gpu_memory=_estimated(186),
            gpus_per_domain=2,
            domain_memory=GRACE_HOST,
            source="GPU: 186 GB HBM3e, estimated at 0.99 GiB per GB as torch reports (not "
            "measured; --gpu-mem corrects it); host: 480 GB (447 GiB) per Grace, 2 GPUs each",
        ),
    )
}


def preset(name: str) -> Hardware:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise UsageError(
            f"unknown hardware {name!r}; choose one of {', '.join(PRESETS)}, or give "
            "--gpu-mem and --cpu-mem in GiB"
        ) from None
