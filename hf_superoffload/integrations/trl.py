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


class _TrainingMetrics:
    """TRL's trainers record each micro-batch's metrics (token accuracy, entropy, rewards...)
    in ``_metrics["train"]`` and count its tokens in ``_total_train_tokens``, beside the loss:
    an out-of-memory retry rolls both back to the window's start before running it again."""

    def _metric_records(self):
        lists = {name: list(values) for name, values in self._metrics["train"].items()}
        return lists, self._total_train_tokens

    def _restore_metric_records(self, records) -> None:
        lists, tokens = records
        self._metrics["train"].clear()
        self._metrics["train"].update(lists)
        self._total_train_tokens = tokens


class SuperOffloadSFTTrainer(_TrainingMetrics, SuperOffloadTrainerMixin, SFTTrainer):
    """TRL's SFTTrainer whose optimizer is SuperOffloadOptimizer."""


class SuperOffloadDPOTrainer(_TrainingMetrics, SuperOffloadTrainerMixin, DPOTrainer):
    """TRL's DPOTrainer whose policy optimizer is SuperOffloadOptimizer."""
