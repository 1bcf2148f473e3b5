"""TRL trainers with SuperOffload: SFT and DPO (for DPO only the policy is offloaded; the
reference model, which takes no optimizer step, stays as TRL places it)."""

from __future__ import annotations

import dataclasses

from ..extras import require
from .arguments import SuperOffloadArgumentsMixin
from .trainer import SuperOffloadTrainerMixin

require("trl", purpose="the SuperOffload TRL trainers")

from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer  # noqa: E402

from .. import upstream  # noqa: E402

upstream.check("trl")


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
