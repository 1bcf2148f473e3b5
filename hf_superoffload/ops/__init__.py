"""Compiled CPU kernels (built on first use, see ``_build``)."""

from ._build import BuildToolMissingError, load_extension
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

__all__ = [
    "BuildToolMissingError",
    "active_isa",
    "adam_replay",
    "adam_rollback",
    "adam_step",
    "available_isas",
    "get_num_threads",
    "load_extension",
    "set_isa",
    "set_num_threads",
]
