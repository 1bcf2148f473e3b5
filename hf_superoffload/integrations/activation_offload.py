"""Activation checkpoint offload: the input each checkpointed decoder layer keeps for its
recompute waits in pinned host memory between forward and backward, not on the GPU.

With activation checkpointing a decoder layer keeps only its input for backward, but it keeps it
on the GPU for the whole step: layers x batch x tokens on the rank x hidden x 2 bytes, the
largest activation term at long sequences (``zero3/activation_memory.py``). Here each layer's
checkpoint function, the one transformers calls for every checkpointed layer
(``_gradient_checkpointing_func``), runs under torch's ``save_on_cpu(pin_memory=True)``.
Checkpointing (reentrant or not) saves the layer's tensor inputs through the saved-tensor hooks
active around it, and the ops inside the layer through its own, so exactly the inputs are
packed: copied into pinned host memory on the compute stream (no host wait), and copied back
when backward recomputes the layer. Nothing else changes: the gradients are bit-identical.

``ActivationOffloadCallback`` installs it when training begins, after the Trainer has turned
checkpointing on, on any Trainer (SuperOffload's, TRL's, the plain one; ZeRO-3 or not).

transformers 5.17 and later do the same themselves when the checkpointing kwargs say
``{"offload": true}``; this one is the path on older versions and reports what it moved. The
plan and the launcher count either (``offload_requested``), and a run asking for both is refused.
"""

from __future__ import annotations

import logging
import threading
import weakref

import torch
from torch.autograd.graph import save_on_cpu
from transformers import TrainerCallback

from ..zero3.activation_memory import pinned_block_bytes

logger = logging.getLogger("hf_superoffload")

FLAG = "--activation_checkpoint_offload true"


class OffloadTally:
    """What the offload moved: tensors packed, their bytes, how many landed in pinned memory,
    the devices they came from, the bytes of host copies alive now and at most, and the host
    bytes those copies held at most: a pinned copy holds its allocator block
    (``pinned_block_bytes``, the plan's count), another its own bytes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # backward releases copies on autograd's device threads
        self.packed = 0
        self.packed_bytes = 0
        self.pinned = 0
        self.sources: set[str] = set()
        self.live_bytes = 0
        self.peak_live_bytes = 0
        self._held = 0
        self.peak_held_bytes = 0

    def add(self, source: torch.Tensor, copy: torch.Tensor) -> None:
        nbytes = copy.numel() * copy.element_size()
        pinned = copy.is_pinned()
        held = pinned_block_bytes(nbytes) if pinned else nbytes
        with self._lock:
            self.packed += 1
            self.packed_bytes += nbytes
            self.pinned += int(pinned)
            self.sources.add(str(source.device))
            self.live_bytes += nbytes
            self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
            self._held += held
            self.peak_held_bytes = max(self.peak_held_bytes, self._held)
        weakref.finalize(copy, self._release, nbytes, held)

    def _release(self, nbytes: int, held: int) -> None:
        with self._lock:
            self.live_bytes -= nbytes
            self._held -= held


class _CountedSaveOnCpu(save_on_cpu):
    """torch's ``save_on_cpu`` (pinned where a GPU is visible), each pack told to a tally."""

    def __init__(self, tally: OffloadTally) -> None:
        super().__init__(pin_memory=True)
        pack = self.pack_hook

        def pack_and_count(tensor: torch.Tensor):
            packed = pack(tensor)
            tally.add(tensor, packed[1])
            return packed

        self.pack_hook = pack_and_count


class _OffloadedCheckpoint:
    """A layer's checkpoint function whose saved inputs go to the host."""

    def __init__(self, checkpoint, hooks: _CountedSaveOnCpu) -> None:
        self.checkpoint = checkpoint
        self.hooks = hooks

    def __call__(self, function, *args, **kwargs):
        with self.hooks:
            return self.checkpoint(function, *args, **kwargs)


class CheckpointInputOffload:
    """Offloads the checkpointed layers' inputs of the models it is installed on."""

    def __init__(self) -> None:
        self.tally = OffloadTally()
        self._hooks = _CountedSaveOnCpu(self.tally)
        self.layers = 0

    def install(self, model: torch.nn.Module) -> int:
        """Wrap the checkpoint function of every module transformers checkpoints (once: a
        wrapper installed before is replaced); return the checkpointed decoder layers.
        ValueError when none is checkpointed."""
        from transformers.modeling_layers import GradientCheckpointingLayer

        layers = 0
        for module in model.modules():
            function = getattr(module, "_gradient_checkpointing_func", None)
            if not getattr(module, "gradient_checkpointing", False) or function is None:
                continue
            if isinstance(function, _OffloadedCheckpoint):  # installed before: by us, or another
                function = function.checkpoint
            module._gradient_checkpointing_func = _OffloadedCheckpoint(function, self._hooks)
            layers += isinstance(module, GradientCheckpointingLayer)
        if not layers:
            raise ValueError(
                f"{FLAG}: no layer of {type(model).__name__} is checkpointed (it has no "
                "transformers GradientCheckpointingLayer with activation checkpointing on), so "
                "there is no layer input to offload: turn --activation_checkpointing on for a "
                "model that supports it, or drop the flag"
            )
        self.layers = layers
        return layers


class ActivationOffloadCallback(TrainerCallback):
    """Installs ``CheckpointInputOffload`` on the Trainer's model when training begins (the
    Trainer turns checkpointing on at the start of ``train()``), and says what it held."""

    def __init__(self) -> None:
        self.offload = CheckpointInputOffload()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        layers = self.offload.install(model)
        logger.info(
            "activation checkpoint offload: the inputs of %d layers wait on the host", layers
        )

    def on_train_end(self, args, state, control, **kwargs):
        tally = self.offload.tally
        if tally.packed:
            logger.info(
                "activation checkpoint offload: %d layer inputs moved, at most %.2f GiB on the "
                "host at once (%d of them in pinned memory)",
                tally.packed,
                tally.peak_held_bytes / 2**30,
                tally.pinned,
            )


def checkpointing_name(args) -> str:
    """The name these training arguments give activation checkpointing: transformers 5.x
    renamed ``gradient_checkpointing`` to ``activation_checkpointing``, keeping the old one as
    an alias of the same value."""
    return (
        "activation_checkpointing"
        if hasattr(args, "activation_checkpointing")
        else ("gradient_checkpointing")
    )


# The transformers release whose activation checkpointing takes ``offload`` (its kwargs'
# ``{"offload": true}``): the same save_on_cpu(pin_memory=True) around each checkpointed layer.
UPSTREAM_OFFLOAD_SINCE = "5.17.0"


def upstream_offload_supported() -> bool:
    """Whether this transformers offloads the checkpointed inputs itself when its checkpointing
    kwargs say ``offload`` (else the key goes on to torch's checkpoint, which offloads nothing)."""
    import inspect

    from transformers import PreTrainedModel

    enable = getattr(PreTrainedModel, "activation_checkpointing_enable", None)
    enable = enable or PreTrainedModel.gradient_checkpointing_enable
    return "offload" in inspect.signature(enable).parameters


def offload_requested(flag: bool, kwargs: dict, name: str) -> bool:
    """Whether the run keeps the checkpointed layer inputs on the host: ``flag`` (ours) or
    transformers' ``kwargs`` (``--{name}_kwargs``) ``offload``, the same request. ValueError
    for both at once, for transformers' on a transformers without it, and for ours with
    ``every_n_layers`` other than 1 (the plan counts every layer checkpointed)."""
    upstream = bool(kwargs.get("offload", False))
    if flag and upstream:
        raise ValueError(
            f"{FLAG} and --{name}_kwargs' offload both move the checkpointed inputs to the host "
            "(transformers' own would take them first): drop one"
        )
    if upstream and not upstream_offload_supported():
        import transformers

        raise ValueError(
            f"--{name}_kwargs' offload needs transformers {UPSTREAM_OFFLOAD_SINCE} or later "
            f"(this is {transformers.__version__}, whose checkpointing passes the key on to "
            f"torch's checkpoint and offloads nothing): pass {FLAG} in its place (the same "
            "offload), or upgrade transformers"
        )
    every_n_layers = kwargs.get("every_n_layers", 1)
    if flag and every_n_layers != 1:
        raise ValueError(
            f"{FLAG} with --{name}_kwargs' every_n_layers {every_n_layers}: the layers left "
            "uncheckpointed would keep all their activations on the GPU, which neither the "
            "offload nor the memory plan counts. Drop every_n_layers (checkpoint every layer) "
            "or drop the flag"
        )
    return flag or upstream


def check_arguments(args, flag: bool = True) -> None:
    """Refuse, before the model is built, training arguments the offload cannot run with:
    ``flag`` is ours (``--activation_checkpoint_offload``); transformers' own (its checkpointing
    kwargs' ``offload``) is checked either way."""
    name = checkpointing_name(args)
    if flag and not getattr(args, name):
        raise ValueError(
            f"{FLAG} offloads the inputs activation checkpointing keeps, and --{name} is off: "
            f"pass --{name} true, or drop the flag"
        )
    kwargs = getattr(args, f"{name}_kwargs", None) or {}
    offload_requested(flag, kwargs if isinstance(kwargs, dict) else {}, name)
