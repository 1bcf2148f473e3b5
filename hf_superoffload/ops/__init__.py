"""Compiled CPU kernels, built once and cached (see ``_build``).

``prepare()`` builds (announced with a warning) or loads them; the optimizers call it in their
constructors. To build ahead of time: ``python -c "import hf_superoffload.ops as o; o.prepare()"``.
"""

from ._build import BuildToolMissingError, load_extension, prepare
from .adam import (
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

__all__ = [
    "BuildToolMissingError",
    "active_isa",
    "adam_replay",
    "adam_rollback",
    "adam_step",
    "available_isas",
    "compact_adam",
    "compact_adam_commit_speculate",
    "get_num_threads",
    "load_extension",
    "prepare",
    "set_isa",
    "set_num_threads",
]
