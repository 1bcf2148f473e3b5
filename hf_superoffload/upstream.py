"""The upstream surface: every name of DeepSpeed, transformers, accelerate, TRL and torch
outside their documented API that hf_superoffload reads, calls, wraps or overrides, and the
versions of each library it was tested with.

These names can change in any release. So each use is listed here, ``check(library)`` verifies
them before the package relies on them (the DeepSpeed patches when DeepSpeed builds a
SuperOffload engine, the Trainer mixin and the TRL trainers when they are defined, torch's
clipping helpers when the first standalone optimizer routes them), and
``tests/test_upstream_surface.py`` fails when one disappears. A failing check names the missing
name and the tested versions, instead of an AttributeError deep inside a training step.

``TESTED`` holds the oldest and newest versions CI runs (``.ci/run``: the newest in the main
environment, the oldest in a pinned one); setup.cfg's bounds are these (``>=`` the oldest, ``<``
the minor after the newest), which ``tests/test_packaging.py`` checks.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import re
from importlib import metadata

from .extras import is_installed

# library -> (oldest, newest) version tested.
TESTED = {
    "torch": ("2.13.0", "2.13.0"),
    "transformers": ("5.12.1", "5.24.0"),
    "accelerate": ("1.12.0", "1.15.0"),
    "deepspeed": ("0.19.8", "0.19.8"),
    "trl": ("1.10.0", "1.16.0"),
}


@dataclasses.dataclass(frozen=True)
class Name:
    """One upstream name: ``owner`` is ``module`` or ``module:Class``.

    ``kind``: "member" is found by ``getattr`` on the owner (a method, a class attribute, a
    module-level name); "attribute" is an instance attribute, found as an assignment
    ``self.<name> = ...`` in the source of the owner or of a base class of the same library
    (a name-mangled one as ``self.__<name>``).
    """

    owner: str
    name: str
    use: str  # what hf_superoffload does with it, for the error message
    kind: str = "member"
    needs: str | None = None  # a library without which the owner does not define the name

    @property
    def library(self) -> str:
        return self.owner.split(".", 1)[0]

    def __str__(self) -> str:
        return f"{self.owner.replace(':', '.')}.{self.name}"


_STAGE3 = "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3"
_ENGINE = "deepspeed.runtime.engine:DeepSpeedEngine"
_TRAINER = "transformers.trainer:Trainer"


def _stage3(use: str, *names: str, kind: str = "member") -> tuple[Name, ...]:
    return tuple(Name(_STAGE3, name, use, kind) for name in names)


SURFACE: tuple[Name, ...] = (
    # DeepSpeed: the patch points of the switch (zero3/patches.py, zero3/checkpoint_hooks.py).
    Name(
        "deepspeed.runtime.superoffload.superoffload_stage3",
        "SuperOffloadOptimizer_Stage3",
        "rebinds to its ZeRO-3 optimizer",
    ),
    Name(_ENGINE, "_configure_optimizer", "wraps (refusals before DeepSpeed builds)"),
    Name(_ENGINE, "get_optimizer_configuration", "wraps (no CPU Adam build)"),
    Name(_ENGINE, "_get_all_zero_checkpoint_state_dicts", "wraps (memory-mapped checkpoints)"),
    Name(_ENGINE, "_config", "reads", kind="attribute"),
    Name(_ENGINE, "__init__", "wraps (reads its config_class: engine variables unread)"),
    Name("deepspeed.runtime.config:DeepSpeedConfig", "_param_dict", "reads", kind="attribute"),
    Name(_ENGINE, "_autoep_folding_spec", "reads (checkpoint layout)", kind="attribute"),
    Name(_ENGINE, "_raise_if_autoep_zero3_consolidated_export", "calls (the streamed save)"),
    Name(
        "deepspeed.runtime.config:DeepSpeedConfig",
        "zero_force_ds_cpu_optimizer",
        "sets while it builds the optimizer",
        kind="attribute",
    ),
    Name("deepspeed.runtime.config", "get_zero_config", "wraps (reads its config value)"),
    Name("deepspeed.runtime.zero.utils", "ZERO_SUPPORTED_OPTIMIZERS", "adds HostAdamState to"),
    Name("deepspeed.ops.op_builder.builder:OpBuilder", "jit_load", "wraps (stale build locks)"),
    Name("deepspeed.comm.comm", "mpi_discovery", "wraps (one process without a launcher)"),
    Name(_STAGE3, "_rigid_load_state_dict", "wraps (reads its checkpoints' cut)"),
    # DeepSpeed ZeRO-3: what SuperOffloadZero3Optimizer (a subclass) overrides.
    *_stage3(
        "overrides",
        "_configure_offloading",
        "_create_fp16_sub_groups",
        "_get_fp32_grad_state_partition",
        "_get_fp32_opt_state_partition",
        "_get_norm_groups",
        "_offload_grad_partition_at_boundary",
        # Hides fp16_groups from it without accumulation: it sizes its host accumulation
        # buffer from them and reads them for nothing else on this path (zero3/host_state.py).
        "_setup_for_real_optimizer",
    ),
    # ... and calls.
    *_stage3(
        "calls",
        "_assert_same_partition_group",
        "_autoep_expert_parallel_group",
        "_constant_buffered_norm2",
        "complete_grad_norm_calculation_for_cpu_offload",
        "_get_param_partition_group",
        "_get_param_partition_rank",
        "_grad_norm_counts_every_rank",
        "_loss_scale_update_and_overflow_cleanup",
        "_partition_all_parameters",
        "_post_step",
        "_pre_step",
        "_unflatten_partitioned_parameters",
        "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads",
    ),
    # ... and the state it reads or writes (instance attributes of DeepSpeed's optimizer).
    *_stage3(
        "reads or writes",
        "_global_grad_norm",
        "_offload_boundary_param_ids",
        "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition",
        "clip_grad",
        "dp_process_group",
        "fp16_groups",
        "fp16_partitioned_groups_flat",
        "fp32_partitioned_groups_flat",
        "grad_partitions_flat_buffer",
        "grad_position",
        "gradient_accumulation_dtype",
        "micro_step_id",
        "model_parallel_group",
        "norm_for_param_grads",
        "offload_optimizer_pin_memory",
        "persistent_parameters",
        "reduce_and_partition_stream",
        "sub_group_size",
        "sub_group_to_group_id",
        "trainable_param_groups",
        kind="attribute",
    ),
    # transformers: the Trainer methods SuperOffloadTrainerMixin overrides.
    *(
        Name(_TRAINER, name, "overrides in SuperOffloadTrainerMixin")
        for name in (
            "_clip_grad_norm",
            "_get_grad_norm",
            "_load_best_model",
            "_load_optimizer_and_scheduler",
            "_push_from_checkpoint",
            "_save",
            "_save_checkpoint",
            "_save_optimizer_and_scheduler",
        )
    ),
    Name("transformers.trainer", "DEFAULT_CALLBACKS", "adds Zero3MetricsCallback to"),
    Name(_TRAINER, "__init__", "wraps (engine variables its DeepSpeed config leaves unread)"),
    # transformers: what save_pretrained does to a state dict, which the streamed ZeRO-3 save
    # (zero3/streaming_save.py) does too.
    Name("transformers.modeling_utils", "remove_tied_weights_from_state_dict", "calls"),
    Name("transformers.core_model_loading", "revert_weight_conversion", "calls"),
    Name("transformers.core_model_loading", "PrefixChange", "reads"),
    Name("transformers.core_model_loading", "WeightConverter", "reads"),
    Name("transformers.conversion_mapping", "get_model_conversion_mapping", "calls"),
    Name("transformers.trainer", "OPTIMIZER_NAME", "reads"),
    Name("transformers.trainer_utils", "_is_peft_model", "calls"),
    Name("transformers.trainer", "SCHEDULER_NAME", "reads"),
    Name("transformers.trainer", "OPTIMIZER_NAME_BIN", "reads"),
    Name("transformers.trainer_pt_utils", "reissue_pt_warnings", "calls"),
    Name(
        "transformers.configuration_utils:PreTrainedConfig",
        "_name_or_path",
        "reads (the model card)",
        kind="attribute",
    ),
    # accelerate
    Name("accelerate.accelerator", "map_pytorch_optim_to_deepspeed", "wraps", needs="deepspeed"),
    Name("accelerate.optimizer:AcceleratedOptimizer", "_is_overflow", "writes", kind="attribute"),
    Name("accelerate.utils.deepspeed:HfDeepSpeedConfig", "__init__", "wraps (config refusals)"),
    Name("accelerate.utils.deepspeed:HfDeepSpeedConfig", "config", "reads", kind="attribute"),
    # torch: its clipping functions are no-grad wrappers; routing rebinds the function each
    # calls (its closure cell), so that one bound by name before the first
    # SuperOffloadOptimizer existed reaches the routing too (engine/clip_routing.py).
    *(
        Name("torch.nn.utils.clip_grad", name, "rebinds the function its wrapper calls")
        for name in ("clip_grad_norm_", "clip_grad_value_", "_clip_grads_with_norm_")
    ),
    # TRL
    Name("trl:SFTTrainer", "_tag_names", "reads (the model card)"),
    Name("trl:DPOTrainer", "_tag_names", "reads (the model card)"),
    # The records an out-of-memory retry rolls back (integrations/trl.py).
    *(
        Name(f"trl:{cls}", name, "reads and restores (OOM retry)", kind="attribute")
        for cls in ("SFTTrainer", "DPOTrainer")
        for name in ("_metrics", "_total_train_tokens")
    ),
)

LIBRARIES = ("deepspeed", "transformers", "accelerate", "trl")


class UpstreamChangedError(RuntimeError):
    """A name hf_superoffload relies on is missing from the installed library."""


def installed_version(library: str) -> str:
    return metadata.version(library)


def supported_range(library: str) -> str:
    """The pip specifier of the tested versions: ``>=oldest,<next minor of newest``."""
    oldest, newest = TESTED[library]
    major, minor = newest.split(".")[:2]
    return f">={oldest},<{major}.{int(minor) + 1}"


def _owner(owner: str):
    module_name, _, class_name = owner.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, class_name) if class_name else module


@functools.cache
def _assigned_in(cls: type, library: str) -> frozenset[str]:
    """Instance attributes the classes of ``library`` in ``cls``'s MRO assign in their source;
    ``self.__x`` in class C is recorded as ``_C__x``, as Python mangles it."""
    found = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith(library):
            continue
        source = inspect.getsource(klass)
        for name in re.findall(r"self\.(\w+)\s*(?::[^=\n]*)?=(?!=)", source):
            mangled = name.startswith("__") and not name.endswith("__")
            found.add(f"_{klass.__name__.lstrip('_')}{name}" if mangled else name)
    return frozenset(found)


def exists(entry: Name) -> bool:
    try:
        owner = _owner(entry.owner)
    except (ImportError, AttributeError):
        return False
    if entry.kind == "attribute":
        return isinstance(owner, type) and entry.name in _assigned_in(owner, entry.library)
    return hasattr(owner, entry.name)


def missing(library: str) -> list[Name]:
    return [
        entry
        for entry in SURFACE
        if entry.library == library
        and (entry.needs is None or is_installed(entry.needs))
        and not exists(entry)
    ]


def error(library: str, names: list[Name] | list[str]) -> UpstreamChangedError:
    oldest, newest = TESTED[library]
    try:
        have = f"{library} {installed_version(library)}"
    except metadata.PackageNotFoundError:
        have = f"the installed {library}"
    listed = ", ".join(str(name) for name in names)
    return UpstreamChangedError(
        f"{have} has no {listed}, which hf_superoffload relies on; it is tested with "
        f'{library} {oldest} to {newest}: pip install "{library}{supported_range(library)}"'
    )


@functools.cache
def _checked(library: str, version: str) -> None:
    absent = missing(library)
    if absent:
        raise error(library, absent)


def check(library: str) -> None:
    """Raise UpstreamChangedError naming every listed name ``library`` lacks (once per version:
    later calls cost a dictionary look-up)."""
    _checked(library, installed_version(library))


def require_member(owner, name: str, library: str) -> None:
    """For a patch about to wrap ``owner.name``: the same error as ``check`` if it is gone."""
    if not hasattr(owner, name):
        if isinstance(owner, type):
            label = f"{owner.__module__}.{owner.__qualname__}"
        else:
            label = getattr(owner, "__name__", repr(owner))
        raise error(library, [f"{label}.{name}"])
