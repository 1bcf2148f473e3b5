"""``hf-superoffload env``: what this machine offers SuperOffload, for bug reports and tuning.

Versions, the CPU and its SIMD features, the CPU Adam's build status and instruction set, GPUs
with measured host<->GPU bandwidth, NUMA nodes, each local rank's CPUs for its CPU Adam
(engine/core_split.py), the host memory the optimizers count as available, resctrl/MPAM and
DeepSpeed. ``--json`` prints the same facts for scripts.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..engine.core_split import CORES_ENV
from ..env import VARIABLES
from . import env_facts

_GIB = 2**30


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "env",
        help="report versions, CPU, CPU Adam build, GPUs and bandwidth, NUMA, DeepSpeed",
        description="Report what this machine offers SuperOffload. Builds nothing unless "
        "--build is given.",
        epilog="The package's environment variables (any other HF_SUPEROFFLOAD_* is refused): "
        + "; ".join(f"{v.name}: {v.meaning} (unset: {v.default})" for v in VARIABLES.values()),
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--build",
        action="store_true",
        help="build the CPU Adam now if it is not cached (about 1-2 minutes, once per machine)",
    )
    parser.add_argument("--no-bandwidth", action="store_true", help="skip timing host<->GPU copies")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.build:
        print("hf-superoffload env: building the CPU Adam if needed ...", file=sys.stderr)
    facts = env_facts.collect(build=args.build, measure_bandwidth=not args.no_bandwidth)
    print(json.dumps(facts, indent=2) if args.json else render(facts), file=args.out)
    return 0


def _row(name: str, value: object) -> str:
    return f"  {name:<16} {value}"


def render(facts: dict) -> str:
    torch_facts, cpu, kernel = facts["torch"], facts["cpu"], facts["cpu_adam"]
    lines = [
        f"hf_superoffload {facts['hf_superoffload']}, Python {facts['python']}, {facts['platform']}"
    ]
    lines.append("packages")
    for name, version in facts["packages"].items():
        lines.append(_row(name, version or "not installed"))
    cuda = torch_facts["cuda"] or "none (CPU build of torch)"
    nccl = f", NCCL {torch_facts['nccl']}" if torch_facts["nccl"] else ""
    lines.append(_row("CUDA", f"{cuda}{nccl}; available: {torch_facts['cuda_available']}"))

    lines.append("CPU")
    lines.append(_row("model", f"{cpu['model']} ({cpu['arch']})"))
    lines.append(
        _row(
            "cores",
            f"{cpu['logical_cores']} logical, {cpu['usable_cores']} usable by this process, "
            f"torch threads {torch_facts['threads']}",
        )
    )
    simd = " ".join(cpu["features"]) or "none of note"
    if "sve_vector_bits" in cpu:
        simd += f" (SVE {cpu['sve_vector_bits']}-bit)"
    lines.append(_row("SIMD", simd))

    lines.append("CPU Adam kernel")
    lines.append(_row("build", _build_line(kernel)))
    isa = kernel["isa"]
    if kernel.get("available_isas"):
        isa += f" (this CPU runs: {', '.join(kernel['available_isas'])})"
    lines.append(_row("instruction set", f"{isa}; {kernel['isa_source']}"))
    if kernel.get("isa_override_error"):
        refusal = kernel["isa_override_error"]
        lines.append(_row("INVALID", f"{refusal} The optimizers refuse to start with it."))
    lines.append(_row("threads", kernel["threads"]))

    lines.append("GPUs")
    if not facts["gpus"]:
        lines.append("  none visible to torch")
    for gpu in facts["gpus"]:
        numa = f", NUMA node {gpu['numa_node']}" if gpu["numa_node"] is not None else ""
        lines.append(
            f"  {gpu['index']}: {gpu['name']}, {gpu['memory_bytes'] / _GIB:.1f} GiB, "
            f"sm_{gpu['capability'].replace('.', '')}, {gpu['multiprocessors']} SMs{numa}"
        )
        if "h2d_bytes_per_s" in gpu:
            lines.append(
                f"     pinned copies: host->GPU {gpu['h2d_bytes_per_s'] / 1e9:.1f} GB/s, "
                f"GPU->host {gpu['d2h_bytes_per_s'] / 1e9:.1f} GB/s"
            )
        elif "bandwidth_error" in gpu:
            lines.append(f"     bandwidth not measured: {gpu['bandwidth_error']}")

    lines.append("NUMA nodes")
    if not facts["numa"]:
        lines.append("  none reported (/sys/devices/system/node)")
    for node in facts["numa"]:
        memory = node["memory_bytes"]
        size = f"{memory / _GIB:.1f} GiB" if memory is not None else "memory unknown"
        cpus = f"cpus {node['cpus']}" if node["cpus"] else "no CPUs (device or far memory)"
        lines.append(f"  node{node['node']}: {cpus}, {size}")

    memory = facts["host_memory"]
    lines.append("host memory (what the optimizers' start-up check and `plan` count)")
    if memory["available_bytes"] is None:
        lines.append(_row("UNREADABLE", f"{memory['error']}; the optimizers refuse to start"))
    else:
        lines.append(_row("available", f"{memory['available_bytes'] / _GIB:.1f} GiB"))
        lines.append(_row("from", memory["source"]))

    lines.extend(_core_split_lines(facts["core_split"]))

    resctrl = facts["resctrl"]
    lines.append("memory partitioning (resctrl: Intel RDT / Arm MPAM)")
    lines.append(_row("status", resctrl["status"]))
    if resctrl["resources"]:
        lines.append(_row("resources", " ".join(resctrl["resources"])))
    if resctrl["cpu_flags"]:
        lines.append(_row("CPU flags", " ".join(resctrl["cpu_flags"])))

    deepspeed = facts["deepspeed"]
    lines.append("DeepSpeed")
    lines.append(_row("version", deepspeed["version"] or "not installed"))
    lines.append(_row("ZeRO-3 path", deepspeed["zero3_path"]))

    lines.append("environment (HF_SUPEROFFLOAD_*; `hf-superoffload env --help` lists them)")
    if not facts["environment"]:
        lines.append("  none set")
    for name, value in facts["environment"].items():
        invalid = name == env_facts.ISA_ENV and kernel.get("isa_override_error")
        state = "INVALID, the optimizers refuse it; " if invalid else ""
        lines.append(f"  {name}={value}: {state}{VARIABLES[name].meaning}")
    return "\n".join(lines)


def _core_split_lines(split: dict) -> list[str]:
    lines = [
        f"CPU Adam cores per local rank ({split['ranks_from']}; {CORES_ENV}={split['setting']})"
    ]
    if split.get("error"):
        lines.append(f"  refused: {split['error']}")
    elif split["not_split"]:
        lines.append(f"  not split: {split['not_split']}")
    reasons = {rank["how"] for rank in split["ranks"]}
    for rank in split["ranks"]:
        node = f", NUMA node {rank['numa_node']}" if rank["numa_node"] is not None else ""
        kept = rank["kept_for_training_thread"]
        kept = f", CPU {kept} kept for the training thread" if kept else ""
        why = f" ({rank['how']})" if len(reasons) > 1 else ""
        lines.append(
            f"  rank {rank['local_rank']}: CPUs {rank['cpus']}{node}; CPU Adam {rank['threads']} "
            f"thread(s) on {rank['cpu_adam_cpus']}{kept}{why}"
        )
    if len(reasons) == 1:
        lines.append(f"  chosen as: {reasons.pop()}")
    return lines


def _build_line(kernel: dict) -> str:
    status = kernel["status"]
    if status == "not built":
        return (
            "not built: the first optimizer builds it (about 1-2 minutes); "
            f"`hf-superoffload env --build` builds it now; cache {kernel['cache']}"
        )
    if status in ("cannot build", "broken"):
        return f"{status}: {kernel['error']}"
    if status == "built":
        return f"built now in {kernel['build_seconds']} s, cached in {kernel['cache']}"
    return f"{status} ({kernel['cache']})"
