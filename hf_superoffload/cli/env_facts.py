"""The facts ``hf-superoffload env`` reports, gathered into one JSON-ready dict.

Nothing here builds the CPU Adam unless asked (``build=True``): a first build takes a minute or
two, and a report should be instant. Importing DeepSpeed is avoided as well (seconds); its
files are looked up instead.
"""

from __future__ import annotations

import importlib.util
import platform
import time
from importlib import metadata
from pathlib import Path

import torch

from .. import __version__, env
from ..engine.cpu_topology import gpu_numa_node
from ..engine.host_memory import host_memory_available
from . import bandwidth, host_facts

PACKAGES = ("torch", "transformers", "accelerate", "trl", "deepspeed", "datasets", "ninja")
ISA_ENV = "HF_SUPEROFFLOAD_CPU_ADAM_ISA"  # hf_superoffload/ops/adam.py reads it


def collect(build: bool = False, measure_bandwidth: bool = True) -> dict:
    cpu = host_facts.cpu()
    found_gpus = gpus(measure_bandwidth)
    return {
        "hf_superoffload": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": packages(),
        "torch": torch_facts(),
        "cpu": cpu,
        "cpu_adam": cpu_adam(cpu, build),
        "gpus": found_gpus,
        "numa": host_facts.numa_nodes(),
        "host_memory": host_memory(),
        "core_split": core_split(found_gpus),
        "resctrl": host_facts.resctrl(cpu),
        "deepspeed": deepspeed(),
        "environment": variables_set(),
    }


def host_memory() -> dict:
    """The host memory this process may still take and what says so, as the optimizers'
    start-up check and ``plan`` count it; or why it cannot be read (they refuse then too)."""
    try:
        available, source = host_memory_available()
    except (ValueError, OSError) as error:
        return {"available_bytes": None, "source": None, "error": str(error)}
    return {"available_bytes": available, "source": source}


def variables_set() -> dict[str, str]:
    """The package's environment variables that are set (all are declared in env.py)."""
    return {name: value for name in env.VARIABLES if (value := env.read(name)) is not None}


def packages() -> dict[str, str | None]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def torch_facts() -> dict:
    cuda = torch.cuda.is_available()
    nccl = None
    if cuda and hasattr(torch.cuda, "nccl"):
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except (RuntimeError, AttributeError, TypeError):
            nccl = None
    return {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": cuda,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "nccl": nccl,
        "threads": torch.get_num_threads(),
    }


def cpu_adam(cpu: dict, build: bool) -> dict:
    """Build status of the compiled CPU Adam and the instruction set it uses (or would)."""
    from ..ops import _build, adam

    folder = _build.build_dir()
    facts = {
        "cache": str(folder),
        "threads": adam.get_num_threads(),
        "isa_override": env.read(ISA_ENV) or None,
    }
    record = folder / _build._MARKER
    if _build._module is not None:
        facts["status"] = "loaded"
    elif record.is_file():
        facts["status"] = "cached"
    elif build:
        start = time.perf_counter()
        _build.prepare()
        facts["status"] = "built"
        facts["build_seconds"] = round(time.perf_counter() - start, 1)
    else:
        facts["status"] = "not built"
        try:
            _build.check_build_tools()
        except _build.BuildToolMissingError as error:
            facts["status"] = "cannot build"
            facts["error"] = str(error)
    override = facts["isa_override"]
    if facts["status"] in ("not built", "cannot build"):
        facts["isa"] = host_facts.expected_isa(cpu)
        facts["isa_source"] = "expected from /proc/cpuinfo (kernel not built)"
        if override is not None and override not in adam.ISAS:  # no kernel of that name
            facts["isa_override_error"] = (
                f"{ISA_ENV}={override}: not one of the CPU Adam's instruction sets "
                f"({', '.join(adam.ISAS)}); unset it or pick one this CPU runs."
            )
        return facts
    try:  # loading a finished build is quick: no compiler runs
        facts["available_isas"] = adam.available_isas()
        if override is not None and override not in facts["available_isas"]:
            # What the optimizers refuse to start with (ops.prepare()).
            facts["isa_override_error"] = adam.isa_refusal(override, facts["available_isas"])
            facts["isa"] = _build.load_extension().best_isa()
            facts["isa_source"] = f"the kernel's choice once {ISA_ENV} is unset"
        else:
            facts["isa"] = adam.active_isa()
            facts["isa_source"] = f"{ISA_ENV}" if override else "the kernel's choice"
    except (ImportError, OSError) as error:
        facts["status"] = "broken"
        facts["error"] = str(error)
    return facts


def gpus(measure_bandwidth: bool) -> list[dict]:
    if not torch.cuda.is_available():
        return []
    found = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        facts = {
            "index": index,
            "name": props.name,
            "memory_bytes": props.total_memory,
            "capability": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
            "numa_node": gpu_numa_node(index),
        }
        if measure_bandwidth:
            try:
                rates = bandwidth.measure(index)
            except RuntimeError as error:  # out of memory, a busy or broken device
                facts["bandwidth_error"] = str(error).splitlines()[0]
            else:
                facts["h2d_bytes_per_s"], facts["d2h_bytes_per_s"] = rates["h2d"], rates["d2h"]
        found.append(facts)
    return found


def core_split(found_gpus: list[dict]) -> dict:
    """Each local rank's CPUs for its CPU Adam (engine/core_split.py): for the ranks a launcher
    started on this host, else one rank per GPU of this host (one rank without a GPU)."""
    from ..engine import core_split as split

    _, count, counted = split.local_rank_and_count()
    if count > 1:
        ranks, source = count, f"{count} ranks on this host ({counted})"
    elif found_gpus:
        ranks, source = len(found_gpus), f"one rank per GPU of this host ({len(found_gpus)})"
    else:
        ranks, source = 1, "one rank (no launcher, no GPU)"
    gpu_nodes = None
    if found_gpus and len(found_gpus) >= ranks:
        gpu_nodes = [gpu["numa_node"] for gpu in found_gpus[:ranks]]
    try:
        report = split.host_split(ranks, "cuda" if found_gpus else "cpu", gpu_nodes)
    except ValueError as error:  # a setting the engine would refuse: say so, as it would
        report = {
            "setting": split.cores_setting(),
            "not_split": None,
            "ranks": [],
            "error": str(error),
        }
    return {"ranks_from": source, **report}


def deepspeed() -> dict:
    """Whether DeepSpeed is here, has the SuperOffload entry point our ZeRO-3 optimizer takes
    over, and whether the takeover is on (``import hf_superoffload`` turns it on)."""
    from ..zero3 import activation

    spec = importlib.util.find_spec("deepspeed")
    facts = {"installed": spec is not None, "version": packages()["deepspeed"], "active": False}
    if spec is None or spec.origin is None:
        facts["zero3_path"] = "inactive: DeepSpeed is not installed (pip install deepspeed)"
        return facts
    target = Path(spec.origin).parent / "runtime" / "superoffload" / "superoffload_stage3.py"
    facts["superoffload_module"] = target.is_file()
    try:
        enabled = activation.enabled()
    except ValueError as error:
        facts["zero3_path"] = f"inactive: {error}"
        return facts
    if not target.is_file():
        facts["zero3_path"] = (
            "inactive: this DeepSpeed has no SuperOffload entry point "
            f"({activation.TARGET_MODULE}); DeepSpeed 0.18 or newer has it"
        )
    elif not enabled:
        facts["zero3_path"] = f"inactive: {activation.OPT_OUT_ENV}=0 keeps DeepSpeed's own"
    else:
        facts["zero3_path"] = (
            'active: ZeRO-3 configs with "super_offload": true run hf_superoffload\'s optimizer '
            "in processes that import hf_superoffload"
        )
        facts["active"] = True
    return facts
