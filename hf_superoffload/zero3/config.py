"""What a DeepSpeed config must say for the SuperOffload trainers to run on ZeRO-3.

No DeepSpeed import: the trainers call this on the config dict accelerate holds, before
DeepSpeed builds the engine from it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from contextlib import contextmanager

from .. import env
from ..engine.optimizer import DEFAULT_BUCKET_SIZE
from ..integrations.plugin import ENV_PREFIX, SuperOffloadOptions

# Options of the standalone engine that DeepSpeed's config replaces on this path.
REPLACED_BY_DEEPSPEED = {
    "gpu_tail": "offload_optimizer.ratio",
    "bucket_size": "zero_optimization.sub_group_size",
    "gpu_tail_cap": "offload_optimizer.ratio",
}

logger = logging.getLogger("hf_superoffload")

# The value of ``offload_optimizer.super_offload`` in the shipped configs: SuperOffload by this
# package. DeepSpeed alone rejects it (``super_offload`` is a boolean there), so a script that
# never imports hf_superoffload stops at once, naming it, instead of running DeepSpeed's own
# SuperOffload; with the package imported it reads as ``true``.
OUR_ENGINE = "hf_superoffload"


def super_offload_requested(value) -> bool:
    return value is True or value == OUR_ENGINE


def _offload_optimizer(param_dict) -> dict | None:
    """The ``zero_optimization.offload_optimizer`` section of a whole DeepSpeed config, if any."""
    zero = param_dict.get("zero_optimization") if isinstance(param_dict, dict) else None
    offload = zero.get("offload_optimizer") if isinstance(zero, dict) else None
    return offload if isinstance(offload, dict) else None


def with_flag_read(param_dict):
    """``param_dict`` (a whole DeepSpeed config) with ``"super_offload": "hf_superoffload"`` as
    ``true``, in a copy of the dicts on the way there; anything else is returned as it is."""
    offload = _offload_optimizer(param_dict)
    if offload is None or offload.get("super_offload") != OUR_ENGINE:
        return param_dict
    zero = param_dict["zero_optimization"]
    offload = {**offload, "super_offload": True}
    return {**param_dict, "zero_optimization": {**zero, "offload_optimizer": offload}}


def require_super_offload(config: dict) -> None:
    """Turn on ``offload_optimizer.super_offload`` in ``config`` (in place): a user of a
    SuperOffload trainer asked for it. Refuses configs it cannot run, saying what to change,
    before it changes anything (``check_super_offload_config``)."""
    check_super_offload_config(config)
    offload = config["zero_optimization"]["offload_optimizer"]
    if not super_offload_requested(offload.get("super_offload")):
        logger.info("hf_superoffload: setting offload_optimizer.super_offload = true")
        offload["super_offload"] = True


def check_super_offload_config(config: dict) -> None:
    """Refuse a DeepSpeed config SuperOffload cannot run on; changes nothing."""
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


def refuse_super_offload_below_stage3(stage: int, super_offload: bool) -> None:
    """DeepSpeed honours ``super_offload`` on stage 3 only and drops it silently elsewhere."""
    if super_offload and stage != 3:
        raise ValueError(
            f'"super_offload": true runs on ZeRO stage 3 only, and this DeepSpeed config has '
            f"stage {stage}, where DeepSpeed would ignore it and run plain ZeRO-Offload. Set "
            f'"zero_optimization": {{"stage": 3, ...}}, or remove "super_offload" from '
            f'"offload_optimizer" to run ZeRO-Offload on stage {stage} knowingly.'
        )


# The variables only hf_superoffload's ZeRO-3 optimizer reads on the DeepSpeed path: one per
# SuperOffloadOptions field (those REPLACED_BY_DEEPSPEED it refuses), and the CPU Adam's CPUs.
ENGINE_VARIABLES = tuple(
    ENV_PREFIX + name.upper()
    # save_dtype: the standalone trainers' (superoffload_save_dtype), read by nothing here.
    for name in [f.name for f in dataclasses.fields(SuperOffloadOptions)]
    + ["cpu_cores", "save_dtype"]
)


def export_zero3_options(options: dict) -> None:
    """Hand the trainer's SuperOffload options to the ZeRO-3 optimizer DeepSpeed will build
    (it reads HF_SUPEROFFLOAD_* when it is constructed), once ``check_zero3_options`` found
    nothing to refuse. What an earlier trainer of the process exported is withdrawn first: a
    trainer's optimizer gets its own options and the user's environment, never another
    trainer's (the trainers export again when train() starts)."""
    check_zero3_options(options)
    withdraw_exported_options()
    for name, value in options.items():
        if name not in REPLACED_BY_DEEPSPEED and value is not None:
            variable = ENV_PREFIX + name.upper()
            text = str(value).lower() if isinstance(value, bool) else str(value)
            _REPLACED[variable] = os.environ.get(variable)
            _EXPORTED[variable] = text
            os.environ[variable] = text


def withdraw_exported_options() -> None:
    """Put back what the last export replaced (unset, or the user's value), for each variable
    still holding what was exported."""
    for variable, text in _EXPORTED.items():
        if os.environ.get(variable) == text:
            before = _REPLACED.get(variable)
            if before is None:
                del os.environ[variable]
            else:
                os.environ[variable] = before
    _EXPORTED.clear()
    _REPLACED.clear()


@contextmanager
def zero3_options_exported(options: dict):
    """``export_zero3_options`` for the block (a trainer's ``train()``, which builds the ZeRO-3
    optimizer), withdrawn when it ends, raised or not: the options are that trainer's, not a
    later-made trainer's, and no later optimizer of the process reads them."""
    export_zero3_options(options)
    try:
        yield
    finally:
        withdraw_exported_options()


# The engine variables the last SuperOffload trainer of this process set from its own arguments
# (variable -> value): options for that trainer's optimizer, not a setting a later plain
# DeepSpeed run of the same process could be thought to honour; and what each held before.
_EXPORTED: dict[str, str] = {}
_REPLACED: dict[str, str | None] = {}


def check_zero3_options(options: dict) -> None:
    """Refuse the trainer's SuperOffload options that DeepSpeed's config replaces, and, when
    DeepSpeed builds its own SuperOffload (HF_SUPEROFFLOAD_DEEPSPEED=0), any of them; changes
    nothing."""
    refuse_engine_options_without_engine(options)
    replaced = {k: REPLACED_BY_DEEPSPEED[k] for k in options if k in REPLACED_BY_DEEPSPEED}
    defaults = {"gpu_tail": "auto", "bucket_size": DEFAULT_BUCKET_SIZE, "gpu_tail_cap": None}
    replaced = {k: v for k, v in replaced.items() if options[k] != defaults[k]}
    if replaced:
        raise ValueError(
            "under DeepSpeed ZeRO-3 these SuperOffload options come from the DeepSpeed config: "
            + ", ".join(f"{k} -> {v}" for k, v in replaced.items())
            + "; set them there and drop the superoffload_ arguments."
        )


def refuse_engine_options_without_engine(options: dict) -> None:
    """Under ``HF_SUPEROFFLOAD_DEEPSPEED=0`` DeepSpeed builds its own SuperOffload, which reads
    none of this package's engine options: refuse those given (``options``: the trainer's
    explicit ones) or set in the environment, rather than export and report them unread."""
    from .activation import OPT_OUT_ENV, engine_on  # activation imports this module

    if engine_on():
        return
    arguments = [f"superoffload_{name}" for name, value in options.items() if value is not None]
    variables = [name for name in ENGINE_VARIABLES if env.read(name) is not None]
    if not arguments and not variables:
        return
    if arguments and variables:
        remedy = "Drop those arguments (and superoffload_options) and unset those variables"
    else:
        remedy = "Drop them (and superoffload_options)" if arguments else "Unset them"
    raise ValueError(
        f"{OPT_OUT_ENV}=0: DeepSpeed builds its own SuperOffload optimizer, which does not "
        f"read {', '.join(arguments + variables)} (hf_superoffload's engine options). {remedy} "
        f"to run DeepSpeed's own SuperOffload, or unset {OPT_OUT_ENV} to run hf_superoffload's "
        f"engine."
    )


def engine_variables_set() -> list[str]:
    """The engine variables set in the environment, less those a trainer of this process
    exported from its arguments where the user had set none (``_EXPORTED``, ``_REPLACED``)."""
    return [
        name
        for name in ENGINE_VARIABLES
        if env.read(name) is not None
        and not (os.environ[name] == _EXPORTED.get(name) and _REPLACED.get(name) is None)
    ]


def builds_super_offload(param_dict) -> bool:
    """Whether a whole DeepSpeed config asks for SuperOffload (``offload_optimizer.super_offload``),
    ours or DeepSpeed's own (``HF_SUPEROFFLOAD_DEEPSPEED=0``)."""
    offload = _offload_optimizer(param_dict)
    return offload is not None and super_offload_requested(offload.get("super_offload"))


def refuse_engine_variables_unread(param_dict) -> None:
    """A DeepSpeed config read in a plain script (``deepspeed.initialize``, ``zero.Init``, the
    Trainer through accelerate): when it asks for SuperOffload and DeepSpeed builds its own
    (``HF_SUPEROFFLOAD_DEEPSPEED=0``), the engine variables set are refused as the trainers
    refuse them. A config asking for none may still be read for a model that trains nothing
    (``zero.Init``, TRL's reference model) or for a SuperOffload trainer, which turns it on:
    ``refuse_engine_variables_without_super_offload`` refuses where an optimizer is built."""
    if builds_super_offload(param_dict):
        refuse_engine_options_without_engine({})


def refuse_engine_variables_without_super_offload(param_dict) -> None:
    """Where an optimizer is built from the DeepSpeed config ``param_dict`` (DeepSpeed's engine
    given one) or will be (a Trainer other than the SuperOffload ones is made): a config that
    asks for no SuperOffload builds DeepSpeed's own optimizer, ZeRO-Offload or not, which reads
    none of the engine variables; those set are refused, under either switch."""
    if builds_super_offload(param_dict):
        return  # refused under the opt-out when read (refuse_engine_variables_unread)
    variables = engine_variables_set()
    if not variables:
        return
    from .activation import OPT_OUT_ENV, engine_on

    zero = param_dict.get("zero_optimization") if isinstance(param_dict, dict) else None
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0  # DeepSpeed's default
    device = (_offload_optimizer(param_dict) or {}).get("device")
    switch = "" if engine_on() else f" and unset {OPT_OUT_ENV}"
    raise ValueError(
        f'This DeepSpeed config asks for no SuperOffload (no "super_offload": true in '
        f"zero_optimization.offload_optimizer; stage {stage!r}, offload_optimizer.device "
        f"{device!r}), so DeepSpeed builds an optimizer that reads none of "
        f"{', '.join(variables)} (hf_superoffload's engine options). Unset them to run this "
        f'config, or add "super_offload": true to offload_optimizer on ZeRO stage 3 with '
        f'"device": "cpu"{switch} to run hf_superoffload\'s engine with them.'
    )
