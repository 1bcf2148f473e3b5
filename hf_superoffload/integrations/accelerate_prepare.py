"""How the SuperOffload trainers have accelerate prepare their optimizer and trained model:
in place (no state round trip through the device) and without DistributedDataParallel."""

from __future__ import annotations

import weakref

import torch

from ..engine import SuperOffloadOptimizer


def prepare_in_place(accelerator, ours: SuperOffloadOptimizer) -> None:
    """NOTE: bends accelerate's contract on purpose, for ``ours`` only. With device
    placement, AcceleratedOptimizer copies the optimizer's state_dict to the accelerator's
    device and loads it back: 12 B/param on the GPU for a moment (an out-of-memory error for the
    models this package is for) and a round trip of the whole state for nothing, since
    SuperOffloadOptimizer keeps its state where it belongs."""
    _prepare_one_object_with(accelerator, "prepare_optimizer", ours, device_placement=False)


def prepare_without_ddp(accelerator, trained: torch.nn.Module) -> None:
    """NOTE: bends accelerate's contract on purpose, for ``trained`` only. ``prepare_model``
    wraps a trainable model in DistributedDataParallel when several processes run; DDP's
    reducer would average the gradients after our hooks have already taken them (local,
    un-reduced) and would then re-fill ``.grad``. SuperOffloadOptimizer averages each bucket
    itself, so this model is prepared as accelerate prepares one for evaluation (autocast and
    compilation, no wrapper) and is not placed again: the Trainer placed it before the
    optimizer took views of its params, and a multi-process CPU run's "cpu:0" would copy them.
    Accelerate's ``no_sync`` then finds nothing to disable, which is what we want. Any other
    model (a reference model, say) is prepared as usual."""
    _prepare_one_object_with(
        accelerator, "prepare_model", trained, device_placement=False, evaluation_mode=True
    )


def _prepare_one_object_with(accelerator, method: str, target, **options) -> None:
    """Make ``accelerator.<method>`` prepare ``target`` with ``options`` (every option that
    method takes), and anything else as it was asked to. It replaces an earlier such patch
    (one target per method: a model_init rebuild's new model and optimizer) and holds the
    target weakly, so that a dropped model or optimizer can be freed."""
    prepare = getattr(accelerator, method)
    prepare = getattr(prepare, "_superoffload_unpatched", prepare)
    target_ref = weakref.ref(target)

    def prepare_target_with_options(obj, *args, **kwargs):
        if obj is target_ref():
            return prepare(obj, **options)
        return prepare(obj, *args, **kwargs)

    prepare_target_with_options._superoffload_unpatched = prepare
    setattr(accelerator, method, prepare_target_with_options)
