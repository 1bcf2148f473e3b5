"""How the ZeRO-3 path cuts a rank's partition into sub groups, and which of them ``ratio``
keeps on the device: one rule for the optimizer (``sub_groups.py``, ``optimizer.py``), the
host check (``host_check.py``) and the memory plan (``memory_plan.py``), so that the bytes
the check and the plan count are the bytes the optimizer allocates.

The cut, per param group of the base optimizer (DeepSpeed keeps the groups apart: the Trainer's
decay and no-decay groups give sub groups of their own), in the group's param order: the
params DeepSpeed does not persist, then the persistent ones (small params it gathers again at
every step's end), each run in sub groups of at most ``sub_group_size`` elements of the rank's
partition, a param never split; a param larger than that is a sub group alone. Every rank
holds ``ceil(numel / ranks)`` elements of every param (the last rank's partition padded), so
every rank's sub groups are the same size.

``ratio`` keeps DeepSpeed's meaning: the share of the sub groups (not of the elements) whose
optimizer state is on the host; the first ``int((1 - ratio) * sub groups)`` stay on the
device. The first sub group is the model's first param (the embedding) alone when that is
larger than ``sub_group_size``: Llama-3.1-8B's 525M-element embedding makes its first 10% of
sub groups hold 15% of its params (17.6 GiB of state, not 12.0).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")

# DeepSpeed's defaults for the persistence thresholds (stage3_param_persistence_threshold,
# stage3_model_persistence_threshold).
DEEPSPEED_PERSISTENCE_THRESHOLD = 100_000
NO_MODEL_PERSISTENCE_LIMIT = sys.maxsize


def partition_numel(numel: int, ranks: int) -> int:
    """Elements of a ``numel``-element param each of ``ranks`` ranks holds (padded)."""
    return math.ceil(numel / ranks)


def cut_sub_groups(
    params: Sequence[T],
    sub_group_size: int,
    numel: Callable[[T], int],
    persistent: Callable[[T], bool],
) -> list[list[T]]:
    """One param group's sub groups: the non-persistent params, then the persistent ones,
    each in runs of at most ``sub_group_size`` elements (``numel``: of the rank's partition),
    in the group's order."""
    others = [p for p in params if not persistent(p)]
    kept = [p for p in params if persistent(p)]
    return _runs(others, sub_group_size, numel) + _runs(kept, sub_group_size, numel)


def _runs(params: Sequence[T], sub_group_size: int, numel: Callable[[T], int]) -> list[list[T]]:
    runs, current, size = [], [], 0
    for param in params:
        if current and size + numel(param) > sub_group_size:
            runs.append(current)
            current, size = [], 0
        current.append(param)
        size += numel(param)
    return [*runs, current] if current else runs


def persistent_params(
    numels: Sequence[int],
    threshold: int = DEEPSPEED_PERSISTENCE_THRESHOLD,
    model_threshold: int = NO_MODEL_PERSISTENCE_LIMIT,
) -> list[bool]:
    """Which params DeepSpeed persists, in the module's param order: those of at most
    ``threshold`` elements, while their running total stays within ``model_threshold``."""
    flags, total = [], 0
    for n in numels:
        keep = n <= threshold and n + total <= model_threshold
        total += n if keep else 0
        flags.append(keep)
    return flags


@dataclasses.dataclass(frozen=True)
class Param:
    """What the cut reads of a param."""

    numel: int
    persistent: bool


def sub_group_numels(
    groups: Sequence[Sequence[Param]], ranks: int, sub_group_size: int
) -> list[int]:
    """Each sub group's elements per rank, in DeepSpeed's order (group by group), for the
    trainable params of the base optimizer's ``groups`` (empty groups make none)."""
    numels = []
    for group in groups:
        for sub_group in cut_sub_groups(
            group,
            sub_group_size,
            numel=lambda p: partition_numel(p.numel, ranks),
            persistent=lambda p: p.persistent,
        ):
            numels.append(sum(partition_numel(p.numel, ranks) for p in sub_group))
    return numels


def sub_group_blocks(
    groups: Sequence[Sequence[Param]], ranks: int, sub_group_size: int
) -> list[int]:
    """Each sub group's compact-moment blocks per rank (``sub_group_numels``' cut): a block
    grid per param partition (engine/compact_moments.py)."""
    from ..engine.compact_moments import blocks_of  # here: compact_moments -> ops

    blocks = []
    for group in groups:
        for sub_group in cut_sub_groups(
            group,
            sub_group_size,
            numel=lambda p: partition_numel(p.numel, ranks),
            persistent=lambda p: p.persistent,
        ):
            blocks.append(sum(blocks_of(partition_numel(p.numel, ranks)) for p in sub_group))
    return blocks


def device_sub_group_count(ratio: float, sub_groups: int) -> int:
    """How many of the first sub groups stay on the device: DeepSpeed's rule for ``ratio``
    (the share offloaded to the host; its config checks the range), so a config means what
    it meant under DeepSpeed."""
    return int((1 - ratio) * sub_groups)


@dataclasses.dataclass(frozen=True)
class SubGroupSplit:
    """A rank's sub groups (elements each) and how many of the first stay on the device."""

    numels: tuple[int, ...]
    device_count: int
    blocks: tuple[int, ...] = ()  # compact-moment blocks of each (``sub_group_blocks``)

    @property
    def host_blocks(self) -> int:
        return sum(self.blocks[self.device_count :])

    @property
    def device_blocks(self) -> int:
        return sum(self.blocks[: self.device_count])

    @property
    def partition(self) -> int:
        return sum(self.numels)

    @property
    def device_numel(self) -> int:
        return sum(self.numels[: self.device_count])

    @property
    def host_numel(self) -> int:
        return sum(self.numels[self.device_count :])

    @property
    def largest_sub_group(self) -> int:
        return max(self.numels, default=0)

    @property
    def largest_device_sub_group(self) -> int:
        return max(self.numels[: self.device_count], default=0)

    @property
    def largest_host_sub_group(self) -> int:
        return max(self.numels[self.device_count :], default=0)


def split_sub_groups(
    numels: Sequence[int], ratio: float, blocks: Sequence[int] = ()
) -> SubGroupSplit:
    """The device / host split of sub groups of ``numels`` elements (and ``blocks`` compact
    blocks) at ``ratio``: what the optimizer builds, the host check refuses and the plan
    counts."""
    return SubGroupSplit(tuple(numels), device_sub_group_count(ratio, len(numels)), tuple(blocks))
