"""The compact optimizer state (both Adam moments in 8 bits a value) in plain PyTorch, in one
namespace: its format (``compact_format``: codes, blocks, rounding bits, ``CompactMoments``)
and its reference update (``compact_adamw``: ``compact_adam_pass``, ``compact_adam_step``,
``CompactAdamW``)."""

from .compact_adamw import CompactAdamW, compact_adam_pass, compact_adam_step
from .compact_format import (
    BLOCK,
    EXP_AVG_FORMAT,
    EXP_AVG_SQ_FORMAT,
    SIGN,
    CompactFormat,
    CompactMoments,
    block_reciprocals,
    check_element_offset,
    check_sizes,
    decode,
    encode,
    ieee_sqrt,
    rounding_bits,
)

__all__ = [
    "BLOCK",
    "EXP_AVG_FORMAT",
    "EXP_AVG_SQ_FORMAT",
    "SIGN",
    "CompactAdamW",
    "CompactFormat",
    "CompactMoments",
    "block_reciprocals",
    "check_element_offset",
    "check_sizes",
    "compact_adam_pass",
    "compact_adam_step",
    "decode",
    "encode",
    "ieee_sqrt",
    "rounding_bits",
]
