"""Make DeepSpeed's ``"super_offload": true`` run hf_superoffload's ZeRO-3 optimizer.

DeepSpeed's engine imports its SuperOffload class from
``deepspeed.runtime.superoffload.superoffload_stage3`` when it builds a stage-3 optimizer with
``super_offload`` set, at that moment and by name. Activation rebinds that name to
``SuperOffloadZero3Optimizer``: DeepSpeed (and everything above it: accelerate, the Trainer,
TRL) then builds ours with the arguments it would have given its own. ``import hf_superoffload``
activates; ``HF_SUPEROFFLOAD_DEEPSPEED=0`` keeps DeepSpeed's own SuperOffload.

DeepSpeed reads ``super_offload`` only when it builds a stage-3 optimizer; under stage 1 or 2
(or 0) the flag is dropped without a word and the run is plain ZeRO-Offload. Activation also
wraps the engine's ``_configure_optimizer`` so that such a config is refused, saying to use
stage 3 (``config.refuse_super_offload_below_stage3``), and changes how DeepSpeed reads ZeRO-3
checkpoints (``checkpoint_hooks.py``): ours are memory-mapped, and DeepSpeed's own optimizers
read a checkpoint of ours. That reader is installed under ``HF_SUPEROFFLOAD_DEEPSPEED=0`` too.
"""

from __future__ import annotations

import importlib.abc
import logging
import os
import sys

logger = logging.getLogger("hf_superoffload")

TARGET_MODULE = "deepspeed.runtime.superoffload.superoffload_stage3"
TARGET_NAME = "SuperOffloadOptimizer_Stage3"
ENGINE_MODULE = "deepspeed.runtime.engine"
STAGE3_MODULE = "deepspeed.runtime.zero.stage3"
OPT_OUT_ENV = "HF_SUPEROFFLOAD_DEEPSPEED"


def enabled() -> bool:
    raw = os.environ.get(OPT_OUT_ENV, "1").strip().lower()
    if raw not in ("0", "1", "false", "true", "no", "yes", "off", "on"):
        raise ValueError(f"{OPT_OUT_ENV} must be 1 or 0 (true/false), got {raw!r}.")
    return raw in ("1", "true", "yes", "on")


def activate() -> None:
    """Rebind DeepSpeed's SuperOffload class now if its module is loaded, else as soon as it
    is imported. Idempotent; does not import DeepSpeed itself (that takes seconds)."""
    if not enabled():
        logger.info("hf_superoffload: %s=0, DeepSpeed's own SuperOffload stays", OPT_OUT_ENV)
        _install(_READERS)  # it still resumes from our checkpoints (checkpoint_hooks.py)
        return
    _install(_PATCHES)


def _install(patches: dict) -> None:
    pending = False
    for name, patch in patches.items():
        module = sys.modules.get(name)
        if module is not None:
            patch(module)
        else:
            pending = True
    if pending and not any(
        isinstance(f, _RebindOnImport) and f.patches is patches for f in sys.meta_path
    ):
        sys.meta_path.insert(0, _RebindOnImport(patches))


def is_active() -> bool:
    module = sys.modules.get(TARGET_MODULE)
    return module is not None and getattr(module, TARGET_NAME).__module__.startswith(
        "hf_superoffload."
    )


def _rebind(module) -> None:
    from .optimizer import SuperOffloadZero3Optimizer

    setattr(module, TARGET_NAME, SuperOffloadZero3Optimizer)


def _guard_stage(module) -> None:
    engine_class = module.DeepSpeedEngine
    original = engine_class._configure_optimizer
    if getattr(original, "_hf_superoffload_guard", False):
        return  # already wrapped

    def configure_optimizer(self, client_optimizer, model_parameters):
        from .config import refuse_super_offload_below_stage3

        refuse_super_offload_below_stage3(self.zero_optimization_stage(), self.super_offload())
        return original(self, client_optimizer, model_parameters)

    configure_optimizer._hf_superoffload_guard = True
    engine_class._configure_optimizer = configure_optimizer


def _patch_engine(module) -> None:
    from .checkpoint_hooks import map_optimizer_files

    _guard_stage(module)
    map_optimizer_files(module)


def _read_our_cut(module) -> None:
    from .checkpoint_hooks import read_our_cut

    read_our_cut(module)


# What activation does to each DeepSpeed module, when it is (or has been) imported.
_PATCHES = {TARGET_MODULE: _rebind, ENGINE_MODULE: _patch_engine, STAGE3_MODULE: _read_our_cut}
_READERS = {STAGE3_MODULE: _read_our_cut}  # also with the opt-out


class _RebindOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for the modules of ``_PATCHES`` it wraps the real loader so that
    the patch follows the module's own execution."""

    def __init__(self, patches: dict):
        self.patches = patches

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.patches:
            return None
        for finder in sys.meta_path:  # the real finders, in their order
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _RebindingLoader(spec.loader, self.patches[fullname])
                return spec
        return None


class _RebindingLoader(importlib.abc.Loader):
    def __init__(self, loader, patch):
        self._loader = loader
        self._patch = patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._patch(module)
