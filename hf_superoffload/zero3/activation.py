"""Make DeepSpeed's ``"super_offload"`` run hf_superoffload's ZeRO-3 optimizer.

DeepSpeed's engine imports its SuperOffload class from
``deepspeed.runtime.superoffload.superoffload_stage3`` when it builds a stage-3 optimizer with
``super_offload`` set, at that moment and by name. Activation rebinds that name to
``SuperOffloadZero3Optimizer``: DeepSpeed (and everything above it: accelerate, the Trainer,
TRL) then builds ours with the arguments it would have given its own. ``import hf_superoffload``
activates; ``HF_SUPEROFFLOAD_DEEPSPEED=0`` keeps DeepSpeed's own SuperOffload, which reads none
of the engine's ``HF_SUPEROFFLOAD_*`` variables: a config asking for SuperOffload then refuses
those set when accelerate or DeepSpeed first reads it (``patches.py``). Under either switch a
config that asks for no SuperOffload builds an optimizer that reads none of them: those set are
refused when a Trainer (not ours) or DeepSpeed's engine is about to build it.

The shipped configs say ``"super_offload": "hf_superoffload"``, which DeepSpeed alone rejects:
a script that never imports this package stops when DeepSpeed reads its config, naming that
value, rather than running DeepSpeed's own engine. Activation reads it as ``true``.

The other changes (``patches.py`` lists them) refuse configs this path cannot run before
DeepSpeed builds anything, keep DeepSpeed and accelerate from compiling a CPU Adam that would
never step, and stop a DeepSpeed op build from waiting forever on a lock its builder left.
Activation also changes how DeepSpeed reads ZeRO-3 checkpoints (``checkpoint_hooks.py``): ours
are memory-mapped, and DeepSpeed's own optimizers read a checkpoint of ours; that reader is
installed under ``HF_SUPEROFFLOAD_DEEPSPEED=0`` too.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys

from .. import env
from . import patches

logger = logging.getLogger("hf_superoffload")

TARGET_MODULE = "deepspeed.runtime.superoffload.superoffload_stage3"
TARGET_NAME = "SuperOffloadOptimizer_Stage3"
ENGINE_MODULE = "deepspeed.runtime.engine"
CONFIG_MODULE = "deepspeed.runtime.config"
ZERO_UTILS_MODULE = "deepspeed.runtime.zero.utils"
BUILDER_MODULE = "deepspeed.ops.op_builder.builder"
ACCELERATE_MODULE = "accelerate.accelerator"
ACCELERATE_CONFIG_MODULE = "accelerate.utils.deepspeed"
COMM_MODULE = "deepspeed.comm.comm"
TRAINER_MODULE = "transformers.trainer"
STAGE3_MODULE = "deepspeed.runtime.zero.stage3"
OPT_OUT_ENV = "HF_SUPEROFFLOAD_DEEPSPEED"


def enabled(check_others: bool = True) -> bool:
    """The switch's value; ``check_others=False`` at import (``activate``): the other
    variables are checked when the package reads them, not when it is imported."""
    raw = (env.read(OPT_OUT_ENV, check_others=check_others) or "1").strip().lower()
    if raw not in ("0", "1", "false", "true", "no", "yes", "off", "on"):
        raise ValueError(f"{OPT_OUT_ENV} must be 1 or 0 (true/false), got {raw!r}.")
    return raw in ("1", "true", "yes", "on")


def engine_on() -> bool:
    """Whether DeepSpeed's ``"super_offload"`` builds hf_superoffload's optimizer in this
    process: activation ran with the switch on (``import hf_superoffload`` activates, and its
    patches, once armed, stay). False under ``HF_SUPEROFFLOAD_DEEPSPEED=0`` at import: DeepSpeed
    builds its own SuperOffload, which reads none of this package's engine options."""
    return TARGET_MODULE in _active


def activate() -> None:
    """Patch the modules of ``_patches()`` now if they are loaded, else as soon as each is
    imported. Idempotent; imports neither DeepSpeed nor accelerate itself (that takes
    seconds)."""
    on = enabled(check_others=False)
    if not on:
        logger.info("hf_superoffload: %s=0, DeepSpeed's own SuperOffload stays", OPT_OUT_ENV)
    current = _patches(on)
    # Added to, never taken from: a module an earlier call was waiting for is still patched.
    _active.update(current)
    pending = False
    for name, patch in current.items():
        module = sys.modules.get(name)
        if module is not None:
            patch(module)
        else:
            pending = True
    if pending and not any(isinstance(f, _RebindOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RebindOnImport())


def _patches(engine: bool) -> dict:
    """What activation does to each module, when it is (or has been) imported."""
    always = {
        CONFIG_MODULE: patches.read_super_offload_config,
        ACCELERATE_CONFIG_MODULE: patches.check_accelerate_deepspeed_config,
        # With the engine on, _patch_engine and _patch_trainer apply these too.
        ENGINE_MODULE: patches.check_engine_config,
        TRAINER_MODULE: patches.check_trainer_config,
        BUILDER_MODULE: patches.check_build_locks,
        COMM_MODULE: patches.one_process_without_launcher,
        STAGE3_MODULE: _read_our_cut,  # it resumes from our checkpoints (checkpoint_hooks.py)
    }
    if not engine:
        return always
    return {
        **always,
        TARGET_MODULE: patches.rebind_superoffload,
        ENGINE_MODULE: _patch_engine,
        ZERO_UTILS_MODULE: patches.accept_host_adam_state,
        ACCELERATE_MODULE: patches.map_client_optimizer,
        TRAINER_MODULE: _patch_trainer,
    }


_active: dict = {}


def _patch_trainer(module) -> None:
    patches.check_trainer_config(module)
    patches.log_zero3_metrics(module)
    patches.stream_zero3_saves(module)


def _patch_engine(module) -> None:
    from .checkpoint_hooks import map_optimizer_files

    patches.check_engine_config(module)
    patches.guard_engine(module)
    map_optimizer_files(module)


def _read_our_cut(module) -> None:
    from .checkpoint_hooks import read_our_cut

    read_our_cut(module)


def is_active() -> bool:
    module = sys.modules.get(TARGET_MODULE)
    return module is not None and getattr(module, TARGET_NAME).__module__.startswith(
        "hf_superoffload."
    )


class _RebindOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for the modules of ``_patches()`` it wraps the real loader so that
    the patch follows the module's own execution."""

    def __init__(self):
        self._resolving: set[str] = set()

    def find_spec(self, fullname, path, target=None):
        # Another finder that also asks the others (a sitecustomize's, a profiler's) calls us
        # back while we ask it: then we answer nothing, and the real finders are reached.
        if fullname not in _active or fullname in self._resolving:
            return None
        self._resolving.add(fullname)
        try:
            for finder in sys.meta_path:  # the real finders, in their order
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None and spec.loader is not None:
                    spec.loader = _RebindingLoader(spec.loader, _active[fullname])
                    return spec
            return None
        finally:
            self._resolving.discard(fullname)


class _RebindingLoader(importlib.abc.Loader):
    def __init__(self, loader, patch):
        self._loader = loader
        self._patch = patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._patch(module)
