"""The model's 16-bit weights, saved from ZeRO-3 partitions one param at a time.

DeepSpeed's save (``stage3_gather_16bit_weights_on_model_save``, which the Trainer uses through
accelerate's ``get_state_dict``) gathers the whole model into rank 0's host memory before
``save_pretrained`` writes it: 2 bytes a param on one host, more than a big model leaves beside
its optimizer state. Here every rank gathers one param at a time; rank 0 copies it to host
memory and appends it to the shard it fills, and a shard that reaches ``max_shard_bytes`` is
written and dropped. Rank 0 never holds more than one shard and one param
(``save_memory.streamed_save_host_bytes``); the other ranks hold nothing beyond the gathered param.

What is written is what ``save_pretrained`` writes from DeepSpeed's gathered state dict: the same
params and persistent buffers, in the dtype ZeRO-3 holds them (the 16-bit params), under the same
names: ``_keys_to_ignore_on_save`` left out, a tied weight saved once under the name
``save_pretrained`` keeps (its own ``remove_tied_weights_from_state_dict``, on shapes only), and
the model's weight conversions reverted (MoE experts saved unfused, as a checkpoint holds them).
Only the cut into shard files differs: ``model.safetensors`` when everything fits one shard,
else ``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json``, whose
``total_parameters`` counts the whole model (``save_pretrained`` under ZeRO-3 counts only the
params a rank holds whole, as ``num_parameters`` sees the partitioned ones empty).

The files are written to a staging folder and replace a previous save's only once all are
written (``save_staging.py``); a failure on rank 0 stops its writing but not its part in the
gathers, and raises on every rank at the end (``save_errors.py``).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator

import torch
from safetensors.torch import save_file
from transformers.core_model_loading import PrefixChange, WeightConverter, revert_weight_conversion
from transformers.modeling_utils import remove_tied_weights_from_state_dict
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

from .save_errors import SaveErrors
from .save_memory import STREAMED_SHARD_BYTES
from .save_staging import publish, staging_dir, start_staging

_PARTIAL = ".streaming-{:05d}.safetensors.partial"  # a shard written before the count is known


class ShardWriter:
    """Fills safetensors shards in ``directory`` on the writing rank, one tensor at a time.

    ``held_bytes`` counts the host bytes of the model it holds (the open shard and a param
    staged for it); ``peak_held_bytes`` their largest sum, which tests check against
    ``streamed_save_host_bytes``."""

    def __init__(self, directory: str, max_shard_bytes: int):
        if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
            raise ValueError(
                f"max_shard_size must be a positive number of bytes, got {max_shard_bytes!r}"
            )
        self.directory = directory
        self.max_shard_bytes = max_shard_bytes
        self.held_bytes = 0
        self.peak_held_bytes = 0
        self.total_size = 0
        self._shard: dict[str, torch.Tensor] = {}
        self._shard_bytes = 0
        self._written: list[list[str]] = []  # the names of each shard written so far
        os.makedirs(directory, exist_ok=True)

    def _hold(self, nbytes: int) -> None:
        self.held_bytes += nbytes
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)

    def reserve(self, nbytes: int) -> None:
        """A param of ``nbytes`` is about to be copied to the host: close the open shard first
        if the param would not fit beside it (as save_pretrained's cut does, a param larger
        than a shard gets one of its own)."""
        if self._shard and self._shard_bytes + nbytes > self.max_shard_bytes:
            self._write_shard()
        self._hold(nbytes)

    def add(self, tensors: dict[str, torch.Tensor], reserved: int) -> None:
        """Append ``tensors`` (what a staged param of ``reserved`` bytes became: itself, or a
        conversion's views of it) to the shard."""
        packed = {}
        for name, tensor in tensors.items():
            if not tensor.is_contiguous():  # a conversion's slice: safetensors wants it packed
                tensor = tensor.contiguous()
                self._hold(tensor.nbytes)  # beside the staged copy, until that is dropped
            packed[name] = tensor
        self._shard.update(packed)
        added = sum(tensor.nbytes for tensor in packed.values())
        self._shard_bytes += added
        self.total_size += added
        self.held_bytes = self._shard_bytes  # the staged copy is now the shard's, or gone
        if self._shard_bytes >= self.max_shard_bytes:
            self._write_shard()

    def _write_shard(self) -> None:
        index = len(self._written)
        save_file(self._shard, self._partial(index), metadata={"format": "pt"})
        self._written.append(list(self._shard))
        self._shard, self._shard_bytes = {}, 0
        self.held_bytes = 0

    def _partial(self, index: int) -> str:
        return os.path.join(self.directory, _PARTIAL.format(index + 1))

    def finish(self, total_parameters: int) -> list[str]:
        """Write the last shard, give the shards their final names and write the index (when
        there are several). Returns the shards' names."""
        if self._shard or not self._written:
            self._write_shard()
        count = len(self._written)
        if count == 1:
            os.replace(self._partial(0), os.path.join(self.directory, SAFE_WEIGHTS_NAME))
            return [SAFE_WEIGHTS_NAME]
        stem, extension = os.path.splitext(SAFE_WEIGHTS_NAME)
        names = [f"{stem}-{i + 1:05d}-of-{count:05d}{extension}" for i in range(count)]
        weight_map = {}
        for i, (name, tensors) in enumerate(zip(names, self._written, strict=True)):
            os.replace(self._partial(i), os.path.join(self.directory, name))
            weight_map.update(dict.fromkeys(tensors, name))
        index = {
            "metadata": {"total_parameters": total_parameters, "total_size": self.total_size},
            "weight_map": weight_map,
        }
        with open(
            os.path.join(self.directory, SAFE_WEIGHTS_INDEX_NAME), "w", encoding="utf-8"
        ) as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return names


def _entries(module: torch.nn.Module, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every param and persistent buffer, in the order DeepSpeed's gathered
    state dict has them (a module's own params, its buffers, then its children); a tied param
    appears under each of its names."""
    for name, param in module.named_parameters(recurse=False):
        if param is not None:
            yield prefix + name, param
    for name, buffer in module.named_buffers(recurse=False):
        if buffer is not None and name not in module._non_persistent_buffers_set:
            yield prefix + name, buffer
    for name, child in module.named_children():
        if child is not None:
            yield from _entries(child, prefix + name + ".")


def _full_shape(tensor: torch.Tensor) -> torch.Size:
    return tensor.ds_shape if hasattr(tensor, "ds_id") else tensor.shape


def names_to_save(model) -> dict[str, torch.Tensor]:
    """The params and buffers ``save_pretrained`` would write from DeepSpeed's gathered state
    dict, by name: ``_keys_to_ignore_on_save`` dropped, and each tied weight kept once, under
    the name save_pretrained keeps (decided on shapes alone: nothing is gathered)."""
    entries = dict(_entries(model))
    shapes = {
        name: torch.empty(_full_shape(t), dtype=t.dtype, device="meta")
        for name, t in entries.items()
    }
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        shapes.pop(key, None)
    kept = remove_tied_weights_from_state_dict(shapes, model)
    return {name: entries[name] for name in entries if name in kept}


# What to change when a model cannot be streamed, for each way of training it on this path.
RECIPE_REMEDY = (
    "train it with --save_model false --save_strategy no (a SuperOffload trainer in a script: "
    'save_strategy="no", superoffload_final_save=False and no save_model call), or on the '
    "standalone engine"
)
TRAINER_REMEDY = (
    'train it without "super_offload" in the DeepSpeed config (the Trainer\'s own ZeRO-3 save, '
    "with stage3_gather_16bit_weights_on_model_save on, then writes it), or with "
    "hf_superoffload's SuperOffloadTrainer on its standalone engine (no DeepSpeed config)"
)


def _weight_conversions(model, remedy: str = RECIPE_REMEDY) -> list | None:
    """The conversions save_pretrained reverts (``revert_weight_conversion``'s choice: the
    ones the model was loaded with, else its architecture's, without prefix changes); refused
    when reverting one needs several params at once, which a param-at-a-time save lacks."""
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        from transformers.conversion_mapping import get_model_conversion_mapping

        conversions = get_model_conversion_mapping(model, add_legacy=False)
        conversions = [c for c in conversions if not isinstance(c, PrefixChange)]
    if not conversions:
        return None
    for conversion in conversions:
        reverse = conversion.reverse_transform()
        if isinstance(reverse, WeightConverter) and len(reverse.source_patterns) > 1:
            raise NotImplementedError(
                f"{type(model).__name__}'s checkpoint format makes {reverse.target_patterns} "
                f"from several params at once ({reverse.source_patterns}), and the streamed "
                f"ZeRO-3 save writes one param at a time: this model cannot be saved on the "
                f"ZeRO-3 path yet: {remedy}."
            )
    return conversions


def check_streamable(engine, remedy: str = RECIPE_REMEDY) -> list | None:
    """Refuses, before anything is written, what the streamed save cannot write (``remedy``:
    what to change instead, for the caller's entry point); returns the weight conversions it
    reverts (None: none)."""
    model = engine.module
    if not engine.zero_optimization_partition_weights():
        raise ValueError("the streamed save reads ZeRO-3 partitions; this engine is not ZeRO-3")
    if engine.autotp_size() > 1:
        raise NotImplementedError(
            "the streamed ZeRO-3 save gathers data-parallel partitions only; with DeepSpeed's "
            "AutoTP (tensor parallelism) set stage3_gather_16bit_weights_on_model_save and save "
            "through DeepSpeed."
        )
    # DeepSpeed's own refusal of expert-parallel (AutoEP) partitions, which a data-parallel
    # gather would leave incomplete.
    engine._raise_if_autoep_zero3_consolidated_export("the streamed ZeRO-3 save")
    if getattr(model, "_hf_peft_config_loaded", False) or getattr(model, "hf_quantizer", None):
        raise NotImplementedError(
            "the streamed ZeRO-3 save writes a full, unquantized model; save a PEFT adapter or "
            "a quantized model with Trainer.save_model, which leaves them to the Trainer's own "
            "save."
        )
    return _weight_conversions(model, remedy)


def _param_bytes(tensor: torch.Tensor) -> int:
    return _full_shape(tensor).numel() * tensor.element_size()


def largest_param_bytes(model) -> int:
    """Bytes of the largest param or buffer the streamed save writes (gathered in full)."""
    return max((_param_bytes(t) for t in names_to_save(model).values()), default=0)


@torch.no_grad()
def write_streamed_weights(
    engine,
    output_dir: str,
    is_main_process: bool,
    max_shard_bytes: int = STREAMED_SHARD_BYTES,
    prologue=None,
) -> ShardWriter | None:
    """Write ``engine``'s model weights (its ZeRO-3 16-bit params) to ``output_dir`` as
    safetensors shards of at most ``max_shard_bytes`` (a single param larger than that gets a
    shard of its own) with their index. Every rank must call it (each param is gathered from
    all of them); ``is_main_process`` writes. ``prologue(directory)``, called on every rank,
    writes the other files of the save (the Trainer's ``_save`` with an empty state dict:
    config, tokenizer, training arguments) into the same staging folder (save_staging.py), whose
    files replace the previous save's only once all are written. A failure on any rank raises on
    every rank, after the last gather (save_errors.py). Returns the writer on the writing rank
    (its byte counts), None on the others."""
    model = engine.module
    conversions = check_streamable(engine)
    errors = SaveErrors()
    staging = staging_dir(output_dir)
    if is_main_process:
        errors.attempt(start_staging, output_dir)
    if prologue is not None:
        errors.attempt(prologue, staging)
    writer = None
    if is_main_process:
        writer = errors.attempt(ShardWriter, staging, max_shard_bytes)
    _stream(engine, names_to_save(model), conversions, writer, errors)
    if is_main_process:
        total = sum(_full_shape(p).numel() for p in model.parameters())
        shards = errors.attempt(writer.finish, total) if writer is not None else None
        errors.attempt(publish, output_dir, shards)
        if errors.failed:  # the previous save stays; what this one wrote goes
            shutil.rmtree(staging, ignore_errors=True)  # the save's own error is raised below
    errors.raise_on_every_rank()
    return writer


def _stream(engine, to_save: dict, conversions, writer: ShardWriter | None, errors) -> None:
    """Gather each param on every rank; the writer (rank 0's) adds it to its shard. After a
    failure rank 0 writes no more but goes on joining the gathers."""
    import deepspeed

    synchronize = getattr(engine.optimizer, "synchronize", None)
    if synchronize is not None:  # hf_superoffload's updates in flight land in the partitions
        synchronize()
    # ZeRO-3's own save partitions every param before it gathers them (and gathers the
    # persistent ones again after): the same state around this one.
    if hasattr(engine.optimizer, "checkpoint_event_prologue"):
        engine.optimizer.checkpoint_event_prologue()
    for name, tensor in to_save.items():
        nbytes = _param_bytes(tensor)
        writing = writer is not None and not errors.failed
        if writing:
            errors.attempt(writer.reserve, nbytes)
        with deepspeed.zero.GatheredParameters([tensor]):  # a no-op for a buffer
            host = errors.attempt(_to_host, tensor) if writing else None
        if host is None:
            continue
        tensors = {name: host}
        if conversions is not None:
            tensors = errors.attempt(revert_weight_conversion, engine.module, tensors)
        del host
        if tensors is not None:
            errors.attempt(writer.add, tensors, reserved=nbytes)
    if hasattr(engine.optimizer, "checkpoint_event_epilogue"):
        engine.optimizer.checkpoint_event_epilogue()


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)
