"""SuperOffloadTrainer's weights: the fp32 masters as the source of truth.

The optimizer's fp32 master weights are what the plain Trainer's fp32 params are: ``bf16=True``
casts the model to bf16 in place and starts the masters from the exact fp32 values
(``cast_to_bf16``, which also keeps host copies of the frozen params' and float buffers' fp32
values that bf16 does not hold), saving writes the masters and those copies
(``weights_to_save``, ``record_saved_dtype``), and resuming from a checkpoint in torch's
optimizer layout takes the masters from its fp32 weights (``masters_from_checkpoint``; the best
checkpoint at the end of training: best_model.py). A save interrupted half-way must not be
resumed from: ``last_complete_checkpoint``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from safetensors import safe_open
from transformers import PreTrainedModel
from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

from ..engine import SuperOffloadOptimizer
from ..engine.host_memory import check_host_memory
from .optimizer_file import masters_in_state, read_optimizer_state

logger = logging.getLogger("hf_superoffload")

BF16_CAST_WARNING = (
    "hf_superoffload: bf16=True casts the model's params to bf16 in place. The fp32 master "
    "weights (from the params' fp32 values) and the Adam moments stay on the host "
    "(SuperOffloadOptimizer), and the model runs forward and backward on bf16 params. The "
    "plain Trainer instead keeps fp32 params and runs them under bf16 autocast, so losses and "
    "updates differ from it by bf16 rounding (1e-5 to 3e-3 relative on the loss in our runs), "
    "and frozen params and buffers compute in bf16 here. save_model writes the fp32 masters, "
    "and the frozen params' and buffers' fp32 values, kept on the host where bf16 does not "
    "hold them (superoffload_save_dtype='bfloat16' for bf16 files)."
)
FP32_COPY_REMEDIES = (
    "The fp32 values that bf16 does not hold are kept on the host: the trained params' until "
    "their masters start from them, the frozen params' and float buffers' so that saves write "
    "them exactly: load the model in bf16 (from_pretrained(..., dtype=torch.bfloat16)) if its "
    "weights need not stay fp32, train without bf16=True, or free host memory."
)


@dataclasses.dataclass
class Fp32Values:
    """What ``cast_to_bf16`` kept of the model's fp32 values: the trainable params' (by
    ``id``), for their masters to start from, and the frozen params' and float buffers' (by
    state-dict name; tied names share one copy), for saves to write."""

    trainable: dict[int, torch.Tensor]
    frozen: dict[str, torch.Tensor]


def cast_to_bf16(model: torch.nn.Module) -> Fp32Values:
    """Cast ``model`` to bf16 in place. Returns host copies of the fp32 values that bf16 does
    not hold exactly (``Fp32Values``); a model loaded from a bf16 checkpoint has none. With
    several processes every rank first takes rank 0's trainable fp32 values, as the engine
    starts every rank from rank 0's params: so all masters start from rank 0's exact values,
    not from its rounded ones. Both kinds of copies are checked against the host's memory
    (``check_host_memory``) before any is made, and stay claimed while they live: the
    optimizer's own check, after them, counts them taken."""
    trainable = [p for p in model.parameters() if p.requires_grad and p.dtype == torch.float32]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        with torch.no_grad():
            for param in trainable:
                dist.broadcast(param.detach(), src=0)
    trainable = [p for p in trainable if not _bf16_holds(p)]
    frozen_names: dict[int, list[str]] = {}  # id(tensor) -> its names (tied: several)
    frozen_tensors: dict[int, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if tensor.requires_grad or tensor.dtype != torch.float32 or _bf16_holds(tensor):
            continue
        frozen_names.setdefault(id(tensor), []).append(name)
        frozen_tensors[id(tensor)] = tensor
    claim = check_host_memory(
        {"trainable_fp32_values": _nbytes(trainable), "frozen_fp32_values": _nbytes(
            frozen_tensors.values())},
        FP32_COPY_REMEDIES,
    )  # fmt: skip
    trainable_values = {id(p): p.detach().to("cpu", copy=True) for p in trainable}
    claim.take("trainable_fp32_values").held_by(*trainable_values.values())
    frozen = {}
    for key, tensor in frozen_tensors.items():
        copy = tensor.detach().to("cpu", copy=True)
        claim.held_by(copy)
        frozen.update(dict.fromkeys(frozen_names[key], copy))
    model.to(torch.bfloat16)
    return Fp32Values(trainable_values, frozen)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _bf16_holds(tensor: torch.Tensor) -> bool:
    value = tensor.detach()
    return torch.equal(value.to(torch.bfloat16).float(), value)


def weights_to_save(
    model: torch.nn.Module,
    optimizer: SuperOffloadOptimizer,
    dtype: torch.dtype,
    frozen_fp32: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every param the optimizer steps taken from its fp32 master
    (views, no copy) and every floating tensor in ``dtype``. A 16-bit param saved in its own
    dtype is written as the model holds it: the engine rounds the master into it each step.
    ``frozen_fp32``: fp32 values of other tensors by name (``Fp32Values.frozen``), written in
    their place while the model's tensor still is their rounding; one that changed since (a
    buffer that training updates, say) is written as the model holds it now."""
    optimizer.synchronize()
    frozen_fp32 = frozen_fp32 or {}
    weights = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if optimizer.manages(tensor) and (dtype == torch.float32 or tensor.dtype != dtype):
            value = optimizer.master_view(tensor).detach()
        elif (
            name in frozen_fp32 and tensor.dtype != dtype and _rounds_to(frozen_fp32[name], tensor)
        ):
            value = frozen_fp32[name]
        else:
            value = tensor.detach()
        if value.is_floating_point() and value.dtype != dtype:
            value = value.to(dtype)
        weights[name] = value
    return weights


def _rounds_to(fp32_value: torch.Tensor, tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` still holds ``fp32_value`` rounded to its dtype."""
    held = tensor.detach()
    return held.shape == fp32_value.shape and torch.equal(
        fp32_value.to(device=held.device, dtype=held.dtype), held
    )


def record_saved_dtype(model: torch.nn.Module, output_dir: str, dtype: torch.dtype) -> None:
    """``save_pretrained`` records the params' dtype in config.json (bf16 after bf16=True),
    which ``from_pretrained(dtype="auto")`` would load the fp32 file as: record the file's
    (``dtype``, or ``torch_dtype`` in older transformers)."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    path = os.path.join(output_dir, "config.json")
    if not isinstance(model, PreTrainedModel) or not os.path.isfile(path):
        return  # a plain module, or a PEFT adapter: no config.json of the model
    name = str(dtype).removeprefix("torch.")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    stale = [key for key in ("dtype", "torch_dtype") if config.get(key) not in (None, name)]
    if stale:
        config.update(dict.fromkeys(stale, name))
        with open(path, "w", encoding="utf-8") as f:
            f.write(json.dumps(config, indent=2, sort_keys=True) + "\n")


def load_optimizer_state(
    optimizer: SuperOffloadOptimizer, model: torch.nn.Module, checkpoint: str, optimizer_file: str
) -> None:
    """``checkpoint``'s optimizer state (``optimizer_file``) into ``optimizer``, mapped.
    NOTE: the Trainer reads the whole file into memory, onto each GPU when several processes
    run (map_location=args.device): 12 B/param there, or a second host copy of the state with
    one process. Mapped, the state pages in while it is copied to the optimizer's own buffers,
    on one process or many. A checkpoint in torch's layout (a plain Trainer's) has no masters:
    those params took the model's values, which a bf16 model has rounded; the fp32 weights
    saved beside it are the masters (found before anything is loaded, or refused)."""
    state = read_optimizer_state(optimizer, optimizer_file)
    without = {id(p) for p, master in masters_in_state(optimizer, state) if master is None}
    sources = fp32_weight_sources(model, optimizer, checkpoint, only=without) if without else []
    optimizer.load_state_dict(state)
    del state
    write_masters(optimizer, sources)


def masters_from_checkpoint(
    model: torch.nn.Module,
    optimizer: SuperOffloadOptimizer,
    checkpoint: str,
    only: set[int] | None = None,
) -> None:
    """The fp32 masters of the params the optimizer steps (``only``: the ids of those to
    restore, default all) from ``checkpoint``'s weights, which the Trainer has loaded into
    ``model``: see ``fp32_weight_sources``."""
    write_masters(optimizer, fp32_weight_sources(model, optimizer, checkpoint, only))


def fp32_weight_sources(
    model: torch.nn.Module,
    optimizer: SuperOffloadOptimizer,
    checkpoint: str,
    only: set[int] | None = None,
) -> list[tuple[torch.Tensor, Callable[[], torch.Tensor]]]:
    """Where each param the optimizer steps (``only``: those ids) finds its fp32 master in
    ``checkpoint``'s weights files, which the Trainer has loaded into ``model``: the file's
    tensor of the param's name (read when written, one at a time; a 16-bit one is what the
    model that saved it held, and widens to fp32 exactly), or, for an fp32 param the files do
    not name, the param as it is. A 16-bit param they do not name (saved under other names,
    such as fused MoE experts saved per expert, which the Trainer's load leaves unloaded too)
    would start from its own rounded value: refused here, before anything is written."""
    saved = _SavedWeights(checkpoint)
    by_param: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if not optimizer.manages(tensor) or (only is not None and id(tensor) not in only):
            continue
        by_param.setdefault(id(tensor), (tensor, []))[1].append(name)  # tied: several names
    sources, unnamed = [], []
    for param, names in by_param.values():
        name = next((n for n in names if n in saved), None)
        if name is not None:
            sources.append((param, functools.partial(saved.get, name)))
        elif param.dtype == torch.float32:
            sources.append((param, param.detach))
        else:
            unnamed.append((names[0], param.dtype))
    if unnamed:
        listed = ", ".join(name for name, _ in unnamed[:3]) + (", ..." if len(unnamed) > 3 else "")
        dtype = unnamed[0][1]
        raise ValueError(
            f"hf_superoffload: checkpoint {checkpoint} holds no fp32 masters in its optimizer "
            f"state (torch's layout, a plain Trainer's), and its safetensors weights do not name "
            f"{len(unnamed)} of the model's {dtype} params ({listed}; saved under other names, "
            f"such as MoE experts saved per expert). Their masters would start from the "
            f"model's {dtype} values, not the checkpoint's. Resume from a checkpoint that "
            f"SuperOffloadTrainer saved (its optimizer.pt holds the masters), or load the "
            f"checkpoint with from_pretrained and train without resume_from_checkpoint."
        )
    return sources


@torch.no_grad()
def write_masters(
    optimizer: SuperOffloadOptimizer,
    sources: list[tuple[torch.Tensor, Callable[[], torch.Tensor]]],
) -> None:
    """Each param's fp32 master from its source, and the param from the master (rounded to
    its dtype, as after a step)."""
    for param, value in sources:
        master = optimizer.master_view(param)
        master.copy_(value())
        param.detach().copy_(master)


class _SavedWeights:
    """A checkpoint's safetensors weights by name (``in``), read one tensor at a time."""

    def __init__(self, checkpoint: str):
        self._file_of: dict[str, str] = {}
        index = os.path.join(checkpoint, SAFE_WEIGHTS_INDEX_NAME)
        single = os.path.join(checkpoint, SAFE_WEIGHTS_NAME)
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            self._file_of = {n: os.path.join(checkpoint, f) for n, f in weight_map.items()}
        elif os.path.isfile(single):
            with safe_open(single, framework="pt") as f:
                self._file_of = dict.fromkeys(f.keys(), single)

    def __contains__(self, name: str) -> bool:
        return name in self._file_of

    def get(self, name: str) -> torch.Tensor:
        with safe_open(self._file_of[name], framework="pt") as f:
            return f.get_tensor(name)


TRAINER_STATE_NAME = "trainer_state.json"  # the Trainer's checkpoint file, written last


# DeepSpeed's engine writes this file in a checkpoint folder once its state is saved, naming
# the tag folder (global_stepN) that holds it; universal checkpoints name theirs in the second.
DEEPSPEED_LATEST_NAMES = ("latest", "latest_universal")


def last_complete_checkpoint(run_dir: str, deepspeed: bool = False) -> str | None:
    """The newest ``checkpoint-N`` of ``run_dir`` that the Trainer finished writing, for
    ``resume_from_checkpoint=True``; None if there is none.

    The Trainer writes a checkpoint's ``trainer_state.json`` after its weights, optimizer,
    scheduler and RNG states, so a save interrupted half-way (a crash, a preempted machine, a
    full disk) leaves a ``checkpoint-N`` without a readable one. transformers'
    ``get_last_checkpoint`` would pick that folder, and resuming from it loses the step count
    (and, with ``optimizer.pt`` missing, the Adam moments) without an error. On DeepSpeed
    (``deepspeed=True``) a complete folder also holds DeepSpeed's ``latest`` file and the tag
    folder it names: the engine loads its state from there. Folders skipped are logged."""
    pattern = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
    found = sorted(
        (int(m.group(1)), os.path.join(run_dir, name))
        for name in os.listdir(run_dir)
        if (m := pattern.match(name)) and os.path.isdir(os.path.join(run_dir, name))
    )
    for _, folder in reversed(found):
        missing = _unfinished_part(folder, deepspeed)
        if missing is None:
            return folder
        logger.warning(
            "hf_superoffload: skipping %s: its save did not finish (%s); resuming from the "
            "checkpoint before it. Delete the folder once you no longer need it.",
            folder,
            missing,
        )
    return None


def _unfinished_part(folder: str, deepspeed: bool) -> str | None:
    """What a checkpoint folder lacks to be resumed from (None: nothing)."""
    try:
        TrainerState.load_from_json(os.path.join(folder, TRAINER_STATE_NAME))
    except (OSError, ValueError, TypeError) as error:
        return f"{TRAINER_STATE_NAME} is missing or unreadable: {error}"
    if not deepspeed:
        return None
    for name in DEEPSPEED_LATEST_NAMES:
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                tag = f.read().strip()
        except OSError:
            continue
        if tag and os.path.isdir(os.path.join(folder, tag)):
            return None
    return (
        f"DeepSpeed's {' or '.join(DEEPSPEED_LATEST_NAMES)} file, naming the folder of its "
        f"saved state, is missing or names no folder"
    )
