"""Hardware presets for ``plan``: GPU and host memory as the software sees them.

GPU memory is what ``torch.cuda.get_device_properties(i).total_memory`` reports, which is what
the memory plan's allocator headroom is measured against; it is a little under the card's
label. Host memory is per host memory domain: a GH200 superchip's Grace memory belongs to its
one GPU, while an x86 host's memory is shared by all of its GPUs.
"""

from __future__ import annotations

import dataclasses

from .errors import UsageError

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    summary: str
    gpu_memory: int  # bytes per GPU, as torch reports them
    host_memory: dict[int, int]  # GPUs sharing one host memory domain -> its bytes
    gpus_per_host: int | None  # fixed memory domain size; None: every GPU on one host
    source: str  # where the numbers come from

    def host_memory_for(self, gpus_on_host: int) -> int:
        """Bytes of host memory that ``gpus_on_host`` GPUs of one host share."""
        if self.gpus_per_host == 1:  # each GPU brings its own memory domain (a superchip)
            return gpus_on_host * self.host_memory[1]
        try:
            return self.host_memory[gpus_on_host]
        except KeyError:
            known = ", ".join(
                f"{count} GPU(s): {nbytes / GIB:.0f} GiB"
                for count, nbytes in self.host_memory.items()
            )
            raise UsageError(
                f"the {self.name} preset knows hosts with {known}, not {gpus_on_host} GPUs on "
                f"one host; give --cpu-mem (GiB per host) or --gpus-per-host"
            ) from None


PRESETS = {
    "gh200": Hardware(
        name="gh200",
        summary="NVIDIA GH200 superchip: 96 GB HBM3 GPU, 480 GB LPDDR5X Grace memory, "
        "one GPU per host memory domain",
        # nvidia-smi shows 97871 MiB; torch reports about 480 MiB less, as on the H100 here
        # (81559 MiB in nvidia-smi, 79.18 GiB in torch).
        gpu_memory=int(95.1 * GIB),
        host_memory={1: 480 * 10**9},  # the label's decimal GB: 447 GiB, the safe side
        gpus_per_host=1,
        source="GPU: 95.1 GiB of the 96 GB HBM3 as torch reports it; host: 480 GB (447 GiB) "
        "per superchip, its label",
    ),
    "h100": Hardware(
        name="h100",
        summary="NVIDIA H100 80GB HBM3 on an x86 host with 128 GiB of memory (the lent "
        "benchmark machine)",
        gpu_memory=int(79.18 * GIB),
        host_memory={1: 125 * GIB},
        gpus_per_host=None,
        source="measured here: torch 79.18 GiB, free(1) 125 GiB of the 128 GiB host",
    ),
    "h200": Hardware(
        name="h200",
        summary="NVIDIA H200 141GB HBM3e on an x86 host: 128 GiB of memory with 1 GPU, 256 "
        "with 2, 512 with 4, 560 with 8 (the lent benchmark machines)",
        gpu_memory=int(139.9 * GIB),  # nvidia-smi 143771 MiB, less the same ~480 MiB
        host_memory={1: 125 * GIB, 2: 256 * GIB, 4: 512 * GIB, 8: 560 * GIB},
        gpus_per_host=None,
        source="GPU: 139.9 GiB of the 141 GB as torch reports it; host: free(1) 125 GiB with 1 "
        "GPU (measured), the machines' 256/512/560 GiB limits with 2/4/8",
    ),
}


def preset(name: str) -> Hardware:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise UsageError(
            f"unknown hardware {name!r}; choose one of {', '.join(PRESETS)}, or give "
            "--gpu-mem and --cpu-mem in GiB"
        ) from None
