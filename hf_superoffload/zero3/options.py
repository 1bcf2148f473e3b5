"""What the ZeRO-3 path takes from a DeepSpeed config and from HF_SUPEROFFLOAD_* variables.

DeepSpeed's keys of its SuperOffload example act here: ``pin_memory`` (our gradient and param
transfer buffers page-locked or not; DeepSpeed's own host buffers stay pageable), ``ratio`` (the first
``1 - ratio`` of the sub groups, the first layers and so the last to get gradients, keep their
optimizer state on the GPU and step there after validation: ``device_sub_groups.py``) and ``cpuadam_cores_perc`` (the
share of this rank's cores the CPU Adam uses; unset, the standalone engine's default applies:
the rank's cores less one). ``sub_group_size`` is the partition the STV core
speculates on; left out of the config (DeepSpeed's default then is 1e9 elements, a few sub
groups per model, so a sub group completes late in backward) it is our bucket size, 2**25.
``reduce_bucket_size`` left out (DeepSpeed's default 5e8 elements) is at most the sub group
size too: gradients reach the host one reduce bucket at a time, and the last bucket is reduced
only when backward ends, so its CPU work (15% of a 3B model at 5e8) could not overlap backward.
A value the config writes is used as written, DeepSpeed's default value included. The
speculation and cast options come from HF_SUPEROFFLOAD_* variables as on the standalone path.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from .. import env
from ..engine.adamw_switches import SWITCHES, check_switches
from ..engine.core_split import Team, choose_team
from ..engine.optimizer import DEFAULT_BUCKET_SIZE
from ..engine.replicas import Replicas
from ..integrations.plugin import ENV_PREFIX, SuperOffloadOptions
from .config import (
    REPLACED_BY_DEEPSPEED,
    check_super_offload_config,
    check_zero3_options,
    export_zero3_options,
    require_super_offload,
)
from .host_check import check_zero3_host_memory

logger = logging.getLogger("hf_superoffload")

DEEPSPEED_DEFAULT_SUB_GROUP_SIZE = 1_000_000_000
# Keys of "offload_optimizer" this path acts on (device must be cpu); the others configure
# NVMe offload, which DeepSpeed ignores with a CPU device too (unknown keys it refuses itself).
OFFLOAD_KEYS_ACTED_ON = ("device", "pin_memory", "ratio", "super_offload", "cpuadam_cores_perc")
DEEPSPEED_DEFAULT_REDUCE_BUCKET_SIZE = 500_000_000


@dataclasses.dataclass(frozen=True)
class Zero3Options:
    team: Team  # the CPU Adam's threads and CPUs (core_split.py)
    speculate: bool
    speculate_after_clip: bool
    cast: str
    compact: bool = False  # the moments are compact (engine/compact_moments.py)

    @property
    def cpu_threads(self) -> int:
        return self.team.threads


def cores_perc_if_set(offload_optimizer_config) -> float | None:
    """``cpuadam_cores_perc`` when the DeepSpeed config sets it; None when it is DeepSpeed's
    default (0.8), which is tuned for DeepSpeed's separate CPU Adam process, not ours."""
    if "cpuadam_cores_perc" not in getattr(offload_optimizer_config, "model_fields_set", ()):
        return None
    return offload_optimizer_config.cpuadam_cores_perc


def resolve_options(cpuadam_cores_perc: float | None, device: torch.device) -> Zero3Options:
    for option, key in REPLACED_BY_DEEPSPEED.items():
        name = ENV_PREFIX + option.upper()
        if env.read(name) is not None:
            raise ValueError(
                f"{name} does not apply under DeepSpeed ZeRO-3; set {key} in the DeepSpeed "
                f"config instead (and unset {name})."
            )
    refuse_save_dtype_variable()
    plugin = SuperOffloadOptions()  # resolves HF_SUPEROFFLOAD_* (and refuses bad values)
    if plugin.cpu_threads is not None and cpuadam_cores_perc is not None:
        raise ValueError(
            f"{ENV_PREFIX}CPU_THREADS={plugin.cpu_threads} (or superoffload_cpu_threads) and the "
            f"DeepSpeed config's offload_optimizer.cpuadam_cores_perc={cpuadam_cores_perc} both "
            f"size the CPU Adam's team; keep one: remove cpuadam_cores_perc from the config to "
            f"run {plugin.cpu_threads} threads, or unset {ENV_PREFIX}CPU_THREADS (drop "
            f"superoffload_cpu_threads) to use that share of this rank's cores."
        )
    # As on the standalone path: the rank's share of the host less one core for the training
    # thread, whose DeepSpeed hooks run during the CPU pass, unless HF_SUPEROFFLOAD_CPU_THREADS
    # or the config's cpuadam_cores_perc (a share of the rank's cores; not both) sizes the
    # team. Measured at 3.4B on an H100 host (16 cores): the pass took 0.88 s with 15 threads,
    # 0.97 with 12 (DeepSpeed's 0.8) and 1.18 with 16, where a kernel thread shared a core
    # with the training thread.
    team = choose_team(device, plugin.cpu_threads, cpuadam_cores_perc)
    return Zero3Options(
        team, plugin.speculate, plugin.speculate_after_clip, plugin.cast,
        plugin.moments == "compact",
    )  # fmt: skip


def refuse_save_dtype_variable() -> None:
    """HF_SUPEROFFLOAD_SAVE_DTYPE is the standalone trainers' (superoffload_save_dtype, which
    the trainers refuse under DeepSpeed): nothing on this path reads it, and a save writes the
    16-bit weights whatever it says, so it is refused rather than ignored."""
    name = ENV_PREFIX + "SAVE_DTYPE"
    value = env.read(name)
    if value is not None:
        raise ValueError(
            f"{name}={value} applies to the standalone engine; under DeepSpeed ZeRO-3 a save "
            "writes the 16-bit weights ZeRO-3 holds, and the fp32 master is in each "
            "checkpoint's optimizer state (DeepSpeed's zero_to_fp32 writes it as fp32 "
            f"weights). Unset {name}."
        )


def take_trainer_config(ds_config: dict, options: dict, save_dtype_argument) -> None:
    """A SuperOffload trainer on DeepSpeed: every refusal first (the config, the engine
    options, the standalone trainers' save dtype as argument or variable), then the two
    changes, which a refused trainer must not leave behind: the config's ``super_offload``
    on, and the options handed to the ZeRO-3 optimizer through the environment."""
    check_super_offload_config(ds_config)
    check_zero3_options(options)
    if save_dtype_argument is not None:
        raise ValueError(
            "superoffload_save_dtype applies to the standalone engine; under DeepSpeed "
            "ZeRO-3 the Trainer saves the 16-bit weights DeepSpeed gathers (use "
            "zero_to_fp32 on a checkpoint for the fp32 master). Drop the argument."
        )
    refuse_save_dtype_variable()
    require_super_offload(ds_config)
    export_zero3_options(options)


def written_in_config(ds_config, key: str) -> bool:
    """Whether the DeepSpeed config's ``zero_optimization`` sets ``key``: a value the user
    wrote, as against DeepSpeed's default for a key left out (both reach the optimizer alike)."""
    zero = ds_config.get("zero_optimization") if isinstance(ds_config, dict) else None
    return isinstance(zero, dict) and key in zero


def sub_group_size(requested: int, written: bool) -> int:
    """The sub group size the optimizer cuts by: as written in the config, or our bucket size
    where DeepSpeed's default (1e9) stands for a key left out."""
    return requested if written else DEFAULT_BUCKET_SIZE


def reduce_bucket_size(requested: int, sub_group: int, written: bool) -> int:
    """As written in the config, or at most a sub group where DeepSpeed's default stands."""
    return requested if written else min(requested, sub_group)


def resolve_sizes(kwargs: dict, ds_config) -> int:
    """Put the sub group and reduce bucket sizes this path runs with into ``kwargs`` (in
    place), before anything reads them: the host check, then DeepSpeed's constructor. Returns
    the sub group size DeepSpeed itself would cut at (the config's, else its default)."""
    deepspeed_size = kwargs.get("sub_group_size", DEEPSPEED_DEFAULT_SUB_GROUP_SIZE)
    sub_group = sub_group_size(deepspeed_size, written_in_config(ds_config, "sub_group_size"))
    kwargs["sub_group_size"] = sub_group
    kwargs["reduce_bucket_size"] = reduce_bucket_size(
        kwargs.get("reduce_bucket_size", DEEPSPEED_DEFAULT_REDUCE_BUCKET_SIZE),
        sub_group,
        written_in_config(ds_config, "reduce_bucket_size"),
    )
    return deepspeed_size


def check_supported(
    init_optimizer,
    ds_config,
    kwargs: dict,
    replicas: Replicas,
    options: Zero3Options,
    device_type: str,
) -> None:
    """Refuse what this path does not run, saying what to change (the host check last)."""
    offload = kwargs.get("offload_optimizer_config")
    device = getattr(getattr(offload, "device", None), "value", getattr(offload, "device", None))
    if device != "cpu":
        raise ValueError(
            f'"super_offload": true needs "offload_optimizer": {{"device": "cpu"}} under ZeRO '
            f"stage 3, got device {device!r}; NVMe offload is not supported with super_offload."
        )
    warn_unused_offload_keys(offload)
    if (ds_config.get("fp16") or {}).get("enabled") is True:
        raise ValueError(
            'hf_superoffload under ZeRO-3 does not run fp16 with loss scaling; use "bf16": '
            '{"enabled": true} (or fp32) in the DeepSpeed config.'
        )
    for flag in ("fp16_master_weights_and_gradients", "bf16_master_weights_and_gradients"):
        if kwargs.get(flag):
            raise ValueError(
                f"{flag} is not supported with super_offload (its masters are fp32): remove "
                f"{flag} from the DeepSpeed config."
            )
    if kwargs.get("bf16_optimizer_states"):
        raise ValueError(
            "bf16_optimizer_states is not supported with super_offload (its moments are fp32): "
            "remove it from the DeepSpeed config."
        )
    zenflow = kwargs.get("zenflow_config")
    if zenflow is not None:
        raise ValueError(
            'ZenFlow and super_offload cannot be combined: remove "zenflow" from '
            '"zero_optimization", or "super_offload" from "offload_optimizer".'
        )
    check_adamw(init_optimizer)
    check_zero3_host_memory(
        init_optimizer, kwargs, replicas, options.compact, ds_config, options.cast, device_type
    )  # last


def warn_unused_offload_keys(offload_optimizer_config) -> None:
    """Warn, by name, about ``offload_optimizer`` keys set in the config that nothing here
    reads (NVMe settings such as ``buffer_count``): a warning, not a refusal, since configs
    copied from DeepSpeed's examples carry them and they change nothing with a CPU device."""
    unused = sorted(
        set(getattr(offload_optimizer_config, "model_fields_set", ())) - set(OFFLOAD_KEYS_ACTED_ON)
    )
    if unused:
        logger.warning(
            "hf_superoffload: offload_optimizer keys %s have no effect with super_offload (they "
            "configure NVMe offload); it acts on %s. Remove them from the DeepSpeed config.",
            unused,
            list(OFFLOAD_KEYS_ACTED_ON),
        )


def check_deepspeed_optimizer(engine, client_optimizer) -> None:
    """Refuse, before DeepSpeed builds anything, an optimizer this path does not step: the
    config's ``"optimizer"`` (DeepSpeed would build it first, e.g. Lamb's CUDA op) or the
    client's (accelerate would turn any of them into a CPU Adam), and ZenFlow."""
    if engine.zenflow_config() is not None:
        raise ValueError(
            'ZenFlow and super_offload cannot be combined: remove "zenflow" from '
            '"zero_optimization", or "super_offload" from "offload_optimizer".'
        )
    if client_optimizer is None:
        name = engine.optimizer_name()
        if name is not None and str(name).lower() not in ("adam", "adamw"):
            raise ValueError(
                f'super_offload steps AdamW on the CPU, and the DeepSpeed config\'s "optimizer" '
                f'is {name!r}: set its "type" to "AdamW" (or remove "super_offload" to run '
                f"{name} with DeepSpeed's own ZeRO-3)."
            )
    elif isinstance(client_optimizer, torch.optim.Optimizer):
        check_adamw(client_optimizer)


def check_adamw(optimizer) -> None:
    """The CPU kernel runs AdamW (decoupled weight decay), or Adam without weight decay, with
    bias correction and fp32 moments."""
    name = type(optimizer).__name__
    decoupled = bool(getattr(optimizer, "adam_w_mode", isinstance(optimizer, torch.optim.AdamW)))
    adam_like = name in ("HostAdamState", "DeepSpeedCPUAdam", "FusedAdam", "AdamW", "Adam")
    if not adam_like:
        raise ValueError(
            f"super_offload steps AdamW on the CPU; the optimizer is {name}. Use "
            f'"optimizer": {{"type": "AdamW"}} in the DeepSpeed config (or AdamW in the Trainer).'
        )
    if getattr(optimizer, "fp32_optimizer_states", True) is False:
        raise ValueError(
            "fp32_optimizer_states=False is not supported with super_offload (its moments are "
            'fp32): remove it from the DeepSpeed config\'s "optimizer" params.'
        )
    for index, group in enumerate(optimizer.param_groups):
        if group.get("amsgrad"):
            raise ValueError("amsgrad is not supported by super_offload; set amsgrad=False.")
        # maximize, capturable, differentiable: as the standalone engine refuses them
        switches = {key: group[key] for key in SWITCHES if key in group}
        check_switches(switches, f" in param group {index}", who="super_offload")
        if group.get("bias_correction", True) is False:
            raise ValueError(
                "bias_correction=False is not supported by super_offload (its kernel corrects "
                'the moments as AdamW does): remove it from the DeepSpeed config\'s "optimizer" '
                "params."
            )
        if not decoupled and group.get("weight_decay", 0.0):
            raise ValueError(
                f"{name} with weight_decay and adam_w_mode off is L2-regularised Adam, which "
                f"super_offload does not run; use AdamW (decoupled weight decay)."
            )
