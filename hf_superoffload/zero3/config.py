"""What a DeepSpeed config must say for the SuperOffload trainers to run on ZeRO-3.

No DeepSpeed import: the trainers call this on the config dict accelerate holds, before
DeepSpeed builds the engine from it.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("hf_superoffload")


def require_super_offload(config: dict) -> None:
    """Turn on ``offload_optimizer.super_offload`` in ``config`` (in place): a user of a
    SuperOffload trainer asked for it. Refuses configs it cannot run, saying what to change."""
    zero = config.get("zero_optimization") or {}
    offload = zero.get("offload_optimizer") or {}
    stage, device = zero.get("stage"), offload.get("device")
    if stage != 3 or device != "cpu":
        raise ValueError(
            f"SuperOffload under DeepSpeed runs on ZeRO stage 3 with the optimizer offloaded to "
            f"the CPU; this config has stage {stage!r} and offload_optimizer.device {device!r}. "
            f'Set "zero_optimization": {{"stage": 3, "offload_optimizer": {{"device": "cpu"}}}} '
            f"(accelerate_configs/ has ready ones), or drop the DeepSpeed config to use the "
            f"standalone engine."
        )
    if offload.get("super_offload") is not True:
        logger.info("hf_superoffload: setting offload_optimizer.super_offload = true")
        offload["super_offload"] = True
