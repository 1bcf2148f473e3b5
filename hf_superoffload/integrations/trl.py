"""TRL trainers with SuperOffload: SFT and DPO (for DPO only the policy is offloaded; the
reference model, which takes no optimizer step, stays as TRL places it)."""

from __future__ import annotations

import dataclasses

from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

from .arguments import SuperOffloadArgumentsMixin
from .trainer import SuperOffloadTrainerMixin


@dataclasses.dataclass
class SuperOffloadSFTConfig(SuperOffloadArgumentsMixin, SFTConfig):
    """SFTConfig with the SuperOffload options (``superoffload_*``)."""


@dataclasses.dataclass
class SuperOffloadDPOConfig(SuperOffloadArgumentsMixin, DPOConfig):
    """DPOConfig with the SuperOffload options (``superoffload_*``)."""


class SuperOffloadSFTTrainer(SuperOffloadTrainerMixin, SFTTrainer):
    """TRL's SFTTrainer whose optimizer is SuperOffloadOptimizer."""


class SuperOffloadDPOTrainer(SuperOffloadTrainerMixin, DPOTrainer):
    """TRL's DPOTrainer whose policy optimizer is SuperOffloadOptimizer."""
