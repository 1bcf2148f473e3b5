"""TRL trainers with SuperOffload: SFT and DPO (for DPO only the policy is offloaded; the
reference model, which takes no optimizer step, stays as TRL places it)."""

from __future__ import annotations

import dataclasses

from transformers import TrainerCallback

from ..extras import require
from .arguments import SuperOffloadArgumentsMixin
from .trainer import SuperOffloadTrainerMixin

require("trl", purpose="the SuperOffload TRL trainers")

from trl import (  # noqa: E402
    DPOConfig,
    DPOTrainer,
    SFTConfig,
    SFTTrainer,
    SyncRefModelCallback,
)

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


class _UpdatesLandBeforeRefSync(TrainerCallback):
    """TR-DPO (``sync_ref_model``): TRL's SyncRefModelCallback mixes the policy's params into
    the reference at the end of every ``ref_model_sync_steps``-th step, reading them directly.
    step() returns with CPU Adam updates still in flight (the next forward waits for them, a
    plain read does not), so on those steps this callback, ordered before TRL's, waits for
    all of them. On ZeRO-3 too: TRL gathers through the first param by ds_id, which may be a
    reference param, whose gather does not wait for the policy's updates."""

    def __init__(self, trainer: SuperOffloadDPOTrainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % args.ref_model_sync_steps == 0:
            self.trainer._superoffload_synchronize()


class SuperOffloadDPOTrainer(_TrainingMetrics, SuperOffloadTrainerMixin, DPOTrainer):
    """TRL's DPOTrainer whose policy optimizer is SuperOffloadOptimizer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.args.sync_ref_model:
            callbacks = self.callback_handler.callbacks
            syncs = [i for i, c in enumerate(callbacks) if isinstance(c, SyncRefModelCallback)]
            if not syncs:
                raise RuntimeError(
                    "sync_ref_model=True, but DPOTrainer added no SyncRefModelCallback: this "
                    "TRL syncs the reference another way, which SuperOffload cannot make wait "
                    "for its in-flight updates. Use a TRL release in "
                    f"{upstream.supported_range('trl')} or set sync_ref_model=False."
                )
            callbacks.insert(syncs[0], _UpdatesLandBeforeRefSync(self))
