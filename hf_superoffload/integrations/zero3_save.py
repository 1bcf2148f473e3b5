"""A Trainer's model save on DeepSpeed ZeRO-3, streamed (zero3/streaming_save.py): the files of
the Trainer's own save (weights, config, generation config, tokenizer, training arguments), with
the weights gathered a param at a time instead of the whole 16-bit model on rank 0
(``stage3_gather_16bit_weights_on_model_save``, which this save does not need).

SuperOffloadTrainerMixin saves this way under any ZeRO-3 engine; a plain Trainer (or TRL
trainer) does when the optimizer DeepSpeed built is hf_superoffload's (``zero3/patches.py``
wraps ``Trainer.save_model``). Checkpoints of ``save_strategy`` go through ``save_model`` too;
their optimizer state is DeepSpeed's ``save_checkpoint``, as before.
"""

from __future__ import annotations

from transformers import PreTrainedModel

from .zero3_callback import our_zero3_optimizer


def streamed_save_engine(trainer, only_ours: bool = False):
    """The DeepSpeed engine whose weights ``trainer.save_model`` streams, or None where the
    Trainer's own save runs: not on DeepSpeed (or before ``train()`` built the engine), not
    ZeRO-3, with DeepSpeed's AutoTP tensor parallelism, or a model ``streams_model`` leaves to
    the Trainer. ``only_ours``: also None unless the engine's optimizer is hf_superoffload's."""
    if not getattr(trainer, "is_deepspeed_enabled", False):
        return None
    engine = getattr(trainer, "deepspeed", None)
    if engine is None or not engine.zero_optimization_partition_weights():
        return None
    if engine.autotp_size() > 1:  # tensor-parallel shards: DeepSpeed's gather joins them
        return None
    # The engine's optimizer, as accelerate's wrapper (trainer.optimizer) holds it.
    if only_ours and our_zero3_optimizer(getattr(trainer, "optimizer", None)) is None:
        return None
    if not streams_model(trainer.accelerator.unwrap_model(trainer.model)):
        return None
    return engine


def streams_model(model) -> bool:
    """Whether the streamed save writes ``model``: a full transformers model, not a PEFT
    adapter (whose trainable weights alone the Trainer gathers) nor a quantized model (whose
    quantizer decides what its save writes); those two take the Trainer's own save."""
    return (
        isinstance(model, PreTrainedModel)
        and not getattr(model, "_hf_peft_config_loaded", False)
        and getattr(model, "hf_quantizer", None) is None
    )


def will_save_model(args, final_save: bool) -> bool:
    """Whether a run saves its model: at ``save_strategy``'s checkpoints, or after ``train()``
    (``final_save``: the code running the Trainer calls ``save_model``, as scripts do, and
    examples/sft.py unless ``--save_model false``)."""
    return final_save or args.save_strategy != "no"


def check_plain_trainer_model(model) -> None:
    """At the start of training by a Trainer that is not a SuperOffload trainer but trains
    through our ZeRO-3 optimizer: refuses a model whose save (``save_model``, checkpoints, or
    the script's final save, whatever ``save_strategy``) could not be streamed, before a step."""
    from ..zero3.streaming_save import TRAINER_REMEDY, _weight_conversions

    model = getattr(model, "module", model)  # the DeepSpeed engine's, were it handed that
    if streams_model(model):
        _weight_conversions(model, TRAINER_REMEDY)


def save_model_streamed(
    trainer, engine, output_dir: str | None, internal_call: bool, remedy: str | None = None
) -> None:
    """``Trainer.save_model`` under ZeRO-3 with the weights streamed; every rank calls it. The
    files replace a previous save's in ``output_dir`` only once all are written
    (zero3/save_staging.py), and a failure on rank 0 raises on every rank. ``remedy``: what
    a refusal tells to change (streaming_save's, for the caller's kind of Trainer)."""
    from ..zero3 import save_memory
    from ..zero3.streaming_save import RECIPE_REMEDY, check_streamable, write_streamed_weights

    output_dir = trainer.args.output_dir if output_dir is None else output_dir
    check_streamable(engine, remedy or RECIPE_REMEDY)  # before anything is written

    def write_the_rest(directory: str) -> None:
        # Config, generation config, tokenizer and training arguments as the Trainer writes
        # them (rank 0); with an empty state dict save_pretrained writes no weights file.
        trainer._save(directory, state_dict={})

    write_streamed_weights(
        engine,
        output_dir,
        is_main_process=trainer.args.should_save,
        max_shard_bytes=save_memory.STREAMED_SHARD_BYTES,
        prologue=write_the_rest,
    )
    if trainer.args.push_to_hub and not internal_call:  # as Trainer.save_model pushes
        revision = getattr(trainer.args, "hub_revision", None)
        extra = {} if revision is None else {"revision": revision}
        trainer.push_to_hub(commit_message="Model save", **extra)
