"""Compiled CPU kernels, built once and cached (see ``_build``).

``prepare()`` builds (announced with a warning) or loads them and checks
``HF_SUPEROFFLOAD_CPU_ADAM_ISA``; the optimizers call it in their constructors. To build ahead
of time: ``python -c "import hf_superoffload.ops as o; o.prepare()"``.
"""

from types import ModuleType

from . import _build
from ._build import BuildToolMissingError, load_extension
from .adam import (
    _forced_isa,
    active_isa,
    adam_replay,
    adam_rollback,
    adam_step,
    available_isas,
    get_num_threads,
    set_isa,
    set_num_threads,
)
from .compact import compact_adam, compact_adam_commit_speculate
from .compact_pieces import CommitPiece, compact_adam_pieces


def prepare() -> ModuleType:
    """Build the CPU Adam now if it is not in the cache yet, load it and return it (see
    ``_build.prepare``), and refuse a ``HF_SUPEROFFLOAD_CPU_ADAM_ISA`` this CPU cannot run:
    in the optimizer's constructor, not at its first step inside the worker."""
    module = _build.prepare()
    _forced_isa()  # reads and checks the variable once (unset: nothing to check)
    return module


__all__ = [
    "BuildToolMissingError",
    "CommitPiece",
    "active_isa",
    "adam_replay",
    "adam_rollback",
    "adam_step",
    "available_isas",
    "compact_adam",
    "compact_adam_commit_speculate",
    "compact_adam_pieces",
    "get_num_threads",
    "load_extension",
    "prepare",
    "set_isa",
    "set_num_threads",
]
