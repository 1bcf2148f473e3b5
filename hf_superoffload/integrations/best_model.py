"""``load_best_model_at_end`` on the standalone engine: the fp32 masters follow the best
checkpoint, exactly.

At the end of training the Trainer loads the best checkpoint's weights into the model; the
masters must follow, or the next save would write the last step's weights and the next step
would return the model to them. The weights are no source of the exact masters in general:
saved in bf16 (``superoffload_save_dtype="bfloat16"``) they are rounded, a bf16 model rounds
what it loads, and a model whose checkpoint layout transformers converts (fused MoE experts,
saved per expert) finds its params under other names there, which the Trainer's own load
leaves unloaded. The checkpoint's ``optimizer.pt`` holds the masters themselves, by the
param's place in the optimizer (the numbering resuming uses): ``restore_best_masters`` takes
them from there, mapped, one param at a time. Checkpoints written with
``save_only_model=True`` hold no optimizer state; where the weights could then not give the
exact masters, ``check_best_model_restorable`` refuses the run before its first step.
"""

from __future__ import annotations

import os

import torch
from transformers import PreTrainedModel
from transformers.core_model_loading import revert_weight_conversion
from transformers.trainer import OPTIMIZER_NAME
from transformers.trainer_utils import _is_peft_model

from ..engine import SuperOffloadOptimizer
from .optimizer_file import masters_in_state, read_optimizer_state
from .save import masters_from_checkpoint, write_masters


def restore_best_masters(
    model: torch.nn.Module, optimizer: SuperOffloadOptimizer, checkpoint: str
) -> None:
    """The Trainer has just loaded ``checkpoint``'s weights into ``model``: every param's
    fp32 master from the checkpoint's optimizer state, and the param from its master (so the
    params the Trainer could not load, under names the file does not hold, are the best's
    too). Without an optimizer state (``save_only_model=True``, which
    ``check_best_model_restorable`` admitted) the masters come from the fp32 weights."""
    path = os.path.join(checkpoint, OPTIMIZER_NAME)
    if not os.path.isfile(path):
        masters_from_checkpoint(model, optimizer, checkpoint)
        return
    sources, without = [], set()
    for param, master in masters_in_state(optimizer, read_optimizer_state(optimizer, path)):
        if master is None:  # torch's layout: a plain Trainer's checkpoint
            without.add(id(param))
            continue
        if master.shape != param.shape:
            raise ValueError(
                f"{path} holds a master of shape {tuple(master.shape)} for a param of "
                f"shape {tuple(param.shape)}: it is another model's optimizer state."
            )
        sources.append((param, lambda master=master: master))
    if without:  # found (or refused) before anything is written
        masters_from_checkpoint(model, optimizer, checkpoint, only=without)
    write_masters(optimizer, sources)


def check_best_model_restorable(
    model: torch.nn.Module, args, save_dtype: torch.dtype, trainable: list[torch.Tensor]
) -> None:
    """Refuse, before the model is cast or trained, ``load_best_model_at_end`` with
    ``save_only_model=True`` where the best checkpoint's weights could not give the exact
    masters: saved in another dtype than fp32, or a 16-bit param's under another name (a PEFT
    adapter's, or a converted checkpoint layout's, such as fused MoE experts). ``trainable``:
    the params the optimizer will step, before any cast; ``args.bf16`` casts fp32 ones."""
    if not (args.load_best_model_at_end and args.save_only_model):
        return
    remedy = (
        "Set save_only_model=False (the best checkpoint's optimizer.pt then holds the exact "
        "masters) or load_best_model_at_end=False"
    )
    if save_dtype != torch.float32:
        raise ValueError(
            f"load_best_model_at_end=True with save_only_model=True and superoffload_save_dtype="
            f"'{str(save_dtype).removeprefix('torch.')}': the checkpoints hold no optimizer "
            f"state, and their weights hold the fp32 master weights rounded, so the best "
            f"checkpoint's masters could not be restored exactly at the end. {remedy}, or save "
            f"float32 weights (superoffload_save_dtype='float32')."
        )
    if not (args.bf16 or any(p.dtype != torch.float32 for p in trainable)):
        return  # fp32 params: the Trainer loads the weights into them exactly
    by_id = {id(p) for p in trainable}
    names = {n: t for n, t in model.state_dict(keep_vars=True).items() if id(t) in by_id}
    if _is_peft_model(model) or getattr(model, "_hf_peft_config_loaded", False):
        missing = sorted(names)
    else:
        written = _names_saved(model)
        ids_found = {id(t) for n, t in names.items() if n in written}
        missing = sorted(n for n, t in names.items() if id(t) not in ids_found)
    if missing:
        listed = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise ValueError(
            f"load_best_model_at_end=True with save_only_model=True: the checkpoints hold no "
            f"optimizer state, and their weights hold {len(missing)} trained params ({listed}) "
            f"under other names than the model's (a PEFT adapter's, or a checkpoint layout "
            f"transformers converts, such as fused MoE experts saved per expert), so the best "
            f"checkpoint's fp32 masters of these bf16 params could not be found at the end. "
            f"{remedy}, or train without bf16=True."
        )


def _names_saved(model: torch.nn.Module) -> set[str]:
    """The names ``save_pretrained`` writes the model's state dict under (transformers
    reverts the conversions it loads a checkpoint layout with), found on meta tensors."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    state = {
        n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in model.state_dict().items()
    }
    if not isinstance(model, PreTrainedModel):
        return set(state)  # the Trainer writes a plain module's state dict as it is
    return set(revert_weight_conversion(model, state))
