"""SuperOffloadTrainer's weights: the fp32 masters as the source of truth.

The optimizer's fp32 master weights are what the plain Trainer's fp32 params are: ``bf16=True``
casts the model to bf16 in place and starts the masters from the exact fp32 values
(``cast_to_bf16``), saving writes the masters (``weights_to_save``, ``record_saved_dtype``), and
loading the best checkpoint at the end of training restores them (``masters_from_checkpoint``).
A save interrupted half-way must not be resumed from: ``last_complete_checkpoint``.
"""

from __future__ import annotations

import json
import logging
import os
import re

import torch
import torch.distributed as dist
from safetensors import safe_open
from transformers import PreTrainedModel
from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import (
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
)

from ..engine import SuperOffloadOptimizer

logger = logging.getLogger("hf_superoffload")

BF16_CAST_WARNING = (
    "hf_superoffload: bf16=True casts the model's params to bf16 in place. The fp32 master "
    "weights (from the params' fp32 values) and the Adam moments stay on the host "
    "(SuperOffloadOptimizer), and the model runs forward and backward on bf16 params. The "
    "plain Trainer instead keeps fp32 params and runs them under bf16 autocast, so losses and "
    "updates differ from it by bf16 rounding (1e-5 to 3e-3 relative on the loss in our runs), "
    "and frozen params and buffers are bf16 here. save_model writes the fp32 master "
    "(superoffload_save_dtype='bfloat16' for bf16 files)."
)


def cast_to_bf16(model: torch.nn.Module) -> dict[int, torch.Tensor]:
    """Cast ``model`` to bf16 in place. Returns host copies of the trainable fp32 params that
    bf16 does not hold exactly (by ``id``), for their masters to start from; a model loaded
    from a bf16 checkpoint has none. With several processes every rank first takes rank 0's
    fp32 values, as the engine starts every rank from rank 0's params: so all masters start
    from rank 0's exact values, not from its rounded ones."""
    trainable = [p for p in model.parameters() if p.requires_grad and p.dtype == torch.float32]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        with torch.no_grad():
            for param in trainable:
                dist.broadcast(param.detach(), src=0)
    fp32_values = {}
    for param in trainable:
        value = param.detach()
        if not torch.equal(value.to(torch.bfloat16).float(), value):
            fp32_values[id(param)] = value.to("cpu", copy=True)
    model.to(torch.bfloat16)
    return fp32_values


def weights_to_save(
    model: torch.nn.Module, optimizer: SuperOffloadOptimizer, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every param the optimizer steps taken from its fp32 master
    (views, no copy) and every floating tensor in ``dtype``. A 16-bit param saved in its own
    dtype is written as the model holds it: the engine rounds the master into it each step."""
    optimizer.synchronize()
    weights = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if optimizer.manages(tensor) and (dtype == torch.float32 or tensor.dtype != dtype):
            value = optimizer.master_view(tensor).detach()
        else:
            value = tensor.detach()
        if value.is_floating_point() and value.dtype != dtype:
            value = value.to(dtype)
        weights[name] = value
    return weights


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
    saved beside it are the masters."""
    state = torch.load(optimizer_file, map_location="cpu", weights_only=True, mmap=True)
    optimizer.load_state_dict(with_empty_groups_of(optimizer, state))
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved = state["state"]
    without = {id(p) for i, p in enumerate(params) if saved.get(i, {}).get("master") is None}
    del state, saved
    if without:
        masters_from_checkpoint(model, optimizer, checkpoint, only=without)


@torch.no_grad()
def masters_from_checkpoint(
    model: torch.nn.Module,
    optimizer: SuperOffloadOptimizer,
    checkpoint: str,
    only: set[int] | None = None,
) -> None:
    """The Trainer has just loaded ``checkpoint``'s weights into ``model``
    (``load_best_model_at_end``): make them the fp32 masters, or the next save would write the
    last step's masters and the next step would return the model to them. A checkpoint holds
    the masters themselves (fp32, the default save dtype): they are taken from its files
    exactly; a param found there in another dtype, or not at all, from the model as loaded.
    ``only``: the ids of the params to restore (default all)."""
    names = [os.path.join(checkpoint, n) for n in (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME)]
    others = [os.path.join(checkpoint, n) for n in (WEIGHTS_NAME, WEIGHTS_INDEX_NAME)]
    if not any(os.path.isfile(path) for path in names + others):
        return  # the Trainer found nothing to load either (it warned)
    saved = _SavedFp32Weights(checkpoint)
    by_param: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if not optimizer.manages(tensor) or (only is not None and id(tensor) not in only):
            continue
        by_param.setdefault(id(tensor), (tensor, []))[1].append(name)  # tied: several names
    rounded = 0
    for param, param_names in by_param.values():
        value = next((v for v in map(saved.get, param_names) if v is not None), None)
        if value is None:
            value = param.detach()
            rounded += param.dtype != torch.float32
        master = optimizer.master_view(param)
        master.copy_(value)
        param.detach().copy_(master)  # the model holds the master, rounded, as after a step
    if rounded:
        logger.warning(
            "hf_superoffload: %d params of checkpoint %s are not stored in fp32 there (saved "
            "with superoffload_save_dtype='bfloat16', or by a bf16 model): their fp32 masters "
            "restart from the %s values.",
            rounded,
            checkpoint,
            next(model.parameters()).dtype,
        )


class _SavedFp32Weights:
    """A checkpoint's safetensors weights by name, read one tensor at a time; ``get`` gives
    None for a name it does not hold, or holds in another dtype than fp32."""

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

    def get(self, name: str) -> torch.Tensor | None:
        path = self._file_of.get(name)
        if path is None:
            return None
        with safe_open(path, framework="pt") as f:
            if f.get_slice(name).get_dtype() != "F32":
                return None
            return f.get_tensor(name)


TRAINER_STATE_NAME = "trainer_state.json"  # the Trainer's checkpoint file, written last


def last_complete_checkpoint(run_dir: str) -> str | None:
    """The newest ``checkpoint-N`` of ``run_dir`` that the Trainer finished writing, for
    ``resume_from_checkpoint=True``; None if there is none.

    The Trainer writes a checkpoint's ``trainer_state.json`` after its weights, optimizer,
    scheduler and RNG states, so a save interrupted half-way (a crash, a preempted machine, a
    full disk) leaves a ``checkpoint-N`` without a readable one. transformers'
    ``get_last_checkpoint`` would pick that folder, and resuming from it loses the step count
    (and, with ``optimizer.pt`` missing, the Adam moments) without an error. Folders skipped
    for that reason are logged."""
    pattern = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
    found = sorted(
        (int(m.group(1)), os.path.join(run_dir, name))
        for name in os.listdir(run_dir)
        if (m := pattern.match(name)) and os.path.isdir(os.path.join(run_dir, name))
    )
    for _, folder in reversed(found):
        state_file = os.path.join(folder, TRAINER_STATE_NAME)
        try:
            TrainerState.load_from_json(state_file)
        except (OSError, ValueError, TypeError) as error:
            logger.warning(
                "hf_superoffload: skipping %s: its save did not finish (%s is missing or "
                "unreadable: %s); resuming from the checkpoint before it. Delete the folder "
                "once you no longer need it.",
                folder,
                TRAINER_STATE_NAME,
                error,
            )
            continue
        return folder
    return None


def with_empty_groups_of(optimizer, state_dict: dict) -> dict:
    """``state_dict`` with the empty param groups laid out as ``optimizer`` has them. The
    Trainer builds [decay, no-decay] groups and keeps one that is empty (a model whose no-decay
    params are all frozen); checkpoints written before this trainer kept it too lack it. Empty
    groups hold no state, so only their place changes; any other difference is left for
    ``load_state_dict`` to refuse."""
    ours = optimizer.param_groups
    theirs = state_dict.get("param_groups")
    if not isinstance(theirs, list) or len(theirs) == len(ours):
        return state_dict
    filled = [group for group in theirs if group.get("params")]
    if len(filled) != sum(1 for group in ours if group["params"]):
        return state_dict
    remaining = iter(filled)
    groups = [
        next(remaining) if group["params"] else {**_hypers(group), "params": []} for group in ours
    ]
    return {**state_dict, "param_groups": groups}


def _hypers(group: dict) -> dict:
    return {key: value for key, value in group.items() if key != "params"}
