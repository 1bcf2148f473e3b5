"""Every environment variable of hf_superoffload's own, and the one function that reads them.

All of them are named ``HF_SUPEROFFLOAD_<NAME>`` and declared in ``VARIABLES`` below (name,
meaning, default). Variables of other tools that the package also reads (the launchers'
WORLD_SIZE and LOCAL_WORLD_SIZE, accelerate's ACCELERATE_*, XDG_CACHE_HOME, CXX) keep their
owners' meaning and are read where they are used. ``read`` first checks the whole environment: a variable of this prefix that
is not declared, or one of the package's former prefix ``SUPEROFFLOAD_``, is refused by name
with the closest declared one, since a misspelled name would otherwise be ignored and the run
would go on with the default. Importing this module reads nothing; the check runs when the
package first reads a variable (building options, an optimizer, the CPU Adam, a plan...).
"""

from __future__ import annotations

import dataclasses
import difflib
import os

PREFIX = "HF_SUPEROFFLOAD_"
FORMER_PREFIX = "SUPEROFFLOAD_"  # refused, naming the new name


@dataclasses.dataclass(frozen=True)
class Variable:
    name: str
    meaning: str
    default: str  # in words: what happens when it is unset


def _declare(*variables: Variable) -> dict[str, Variable]:
    return {v.name: v for v in variables}


VARIABLES = _declare(
    # The options of SuperOffloadOptions (integrations/plugin.py), one per field.
    Variable(
        "HF_SUPEROFFLOAD_GPU_TAIL",
        "the GPU tail: buckets (the first layers) whose optimizer state stays on the GPU, an int or 'auto'",
        "auto",
    ),
    Variable("HF_SUPEROFFLOAD_BUCKET_SIZE", "elements per gradient bucket", "2**25"),
    Variable(
        "HF_SUPEROFFLOAD_CPU_THREADS",
        "threads of the CPU Adam",
        "this rank's share of the host's cores, less one",
    ),
    Variable(
        "HF_SUPEROFFLOAD_CPU_CORES",
        "CPUs of the CPU Adam: 'auto' (each rank of a host its own share, NUMA-local), 'off' "
        "(threads float), or CPU lists, one per local rank, separated by ';' (0-13;14-27)",
        "auto",
    ),
    Variable(
        "HF_SUPEROFFLOAD_SPECULATE", "speculation-then-validation on or off (true/false)", "true"
    ),
    Variable(
        "HF_SUPEROFFLOAD_SPECULATE_AFTER_CLIP",
        "also speculate right after a clipped step (true/false)",
        "false",
    ),
    Variable("HF_SUPEROFFLOAD_CAST", "where bf16 <-> fp32 casts run: auto, gpu or cpu", "auto"),
    Variable(
        "HF_SUPEROFFLOAD_MOMENTS",
        "Adam moments in fp32 (exact) or compact (8 bits a value)",
        "fp32",
    ),
    Variable(
        "HF_SUPEROFFLOAD_GPU_TAIL_CAP",
        "most GPU memory (GiB) the optimizer's GPU tail may hold",
        "no cap",
    ),
    # The trainers', the metrics' and the host check's.
    Variable(
        "HF_SUPEROFFLOAD_SAVE_DTYPE",
        "precision save_model and checkpoints write: float32 or bfloat16",
        "float32",
    ),
    Variable(
        "HF_SUPEROFFLOAD_PEAK_TFLOPS",
        "the GPU's dense bf16 peak (TFLOP/s) for the logged MFU",
        "a table of known GPUs",
    ),
    Variable(
        "HF_SUPEROFFLOAD_HOST_MEMORY_GIB",
        "host memory (GiB) this job may use, where MemAvailable reads low (growing VMs)",
        "MemAvailable, or less where the process's cgroup limits memory",
    ),
    # The compiled CPU Adam's.
    Variable(
        "HF_SUPEROFFLOAD_CPU_ADAM_ISA",
        "force the CPU Adam's instruction set: avx512, avx2, sve, neon or scalar",
        "the best this CPU runs",
    ),
    Variable(
        "HF_SUPEROFFLOAD_CACHE",
        "folder of the compiled CPU Adam",
        "$XDG_CACHE_HOME/hf_superoffload (~/.cache/hf_superoffload)",
    ),
    Variable("HF_SUPEROFFLOAD_VERBOSE_BUILD", "1: show the compiler's output", "quiet"),
    # The DeepSpeed switch (zero3/activation.py).
    Variable(
        "HF_SUPEROFFLOAD_DEEPSPEED",
        "0: DeepSpeed's \"super_offload\" builds DeepSpeed's own optimizer, not this package's",
        "1",
    ),
)


# Variables renamed before 0.1.0 (the GPU tail's): refused like any undeclared one, naming
# the new variable (difflib would point GPU_BUCKETS at BUCKET_SIZE).
RENAMED = {
    PREFIX + "GPU_BUCKETS": PREFIX + "GPU_TAIL",
    PREFIX + "GPU_MEMORY_CAP": PREFIX + "GPU_TAIL_CAP",
}


def _successor(name: str) -> tuple[str | None, bool]:
    """(the declared variable ``name`` most likely meant, whether it is ``name``'s new name):
    a renamed variable's new name, else the closest declared one (difflib), else None."""
    if name in VARIABLES or name in RENAMED:
        return RENAMED.get(name, name), True
    close = difflib.get_close_matches(name, VARIABLES, n=1)
    return (close[0] if close else None), False


def check() -> None:
    """Refuse an ``HF_SUPEROFFLOAD_*`` variable that is not declared, or a ``SUPEROFFLOAD_*``
    one (the former prefix), naming the closest declared variable."""
    for name in sorted(os.environ):
        if name in VARIABLES:
            continue
        if name.startswith(PREFIX):
            target, renamed = _successor(name)
            if renamed:
                hint = f"it is now {target}. "
            else:
                hint = f"did you mean {target}? " if target else ""
            raise ValueError(
                f"unknown environment variable {name}: {hint}Rename or unset it. "
                f"hf_superoffload reads {', '.join(VARIABLES)}."
            )
        if name.startswith(FORMER_PREFIX):
            target, renamed = _successor(PREFIX + name[len(FORMER_PREFIX) :])
            if renamed:
                hint = f"it is now {target}"
            else:
                hint = f"did you mean {target}?" if target else "no variable of that name"
            raise ValueError(
                f"environment variable {name}: hf_superoffload's variables are named "
                f"{PREFIX}*; {hint}. Rename or unset it."
            )


def read(name: str, *, check_others: bool = True) -> str | None:
    """The value of the declared variable ``name`` (its full name), None when it is unset;
    refuses first any variable of the package's prefixes that is not declared (``check``).
    ``check_others=False`` only for the DeepSpeed switch read by ``import hf_superoffload``,
    which must not fail on a variable the script may still fix before it uses the package."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not declared in hf_superoffload/env.py")
    if check_others:
        check()
    return os.environ.get(name)
