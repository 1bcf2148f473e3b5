"""Ulysses sequence parallelism for the SFT recipe: ``--sequence_parallel_size N`` splits each
sequence over N ranks, as transformers' Trainer does it for DeepSpeed (ALST/Ulysses):
accelerate's ``ParallelismConfig(sp_backend="deepspeed", sp_size=N)`` in the training
arguments' ``parallelism_config``. accelerate then registers DeepSpeed's Ulysses attention with
the model and hands its process groups to ``deepspeed.initialize``, the Trainer wraps the
DataLoader in ``UlyssesSPDataLoaderAdapter`` (each rank gets 1/N of every sequence) and
combines the ranks' losses by their valid tokens.

Each optimizer step then takes ``gradient_accumulation_steps`` batches of the whole SP group
(one rank's batch a micro step, every rank computing its share of it), so N ranks with
``gradient_accumulation_steps`` N see the sequences that N data-parallel ranks see in one step.

What cannot run is refused here, before the trainer is built, with what to change: a size that
does not divide the ranks or the model's attention heads, no DeepSpeed ZeRO-3, DPO, eager
attention, packed rows under sdpa, and a ``pad_to_multiple_of`` the sequence cannot be split by.
"""

from __future__ import annotations

import os
import re

# accelerate's launcher puts an accelerate config's ``parallelism_config`` in the environment.
LAUNCHER_SP_SIZE = "PARALLELISM_CONFIG_SP_SIZE"
# The first TRL whose SFT trainer has its collator give every batch the position_ids that
# DeepSpeed's Ulysses data loader shards by (TRL 1.10's leaves them out: a run stops at its
# first batch).
SP_MIN_TRL = (1, 11)
# What DeepSpeed's Ulysses attention wraps (it has no 4D mask, which eager needs).
SP_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3")


def requested_size(recipe) -> int:
    """The SP size asked for: the flag, else an accelerate config's ``parallelism_config``
    (``parallelism_config_sp_size``), else 1. The two must agree when both are given."""
    launcher = os.environ.get(LAUNCHER_SP_SIZE)
    launcher_size = int(launcher) if launcher not in (None, "", "None") else None
    flag = recipe.sequence_parallel_size
    if flag is not None and launcher_size is not None and flag != launcher_size:
        raise ValueError(
            f"--sequence_parallel_size {flag} disagrees with the accelerate config's "
            f"parallelism_config_sp_size {launcher_size}: drop the flag, or launch with a "
            f"config of sp size {flag}"
        )
    size = flag if flag is not None else (launcher_size or 1)
    if size < 1:
        raise ValueError(f"--sequence_parallel_size must be 1 or more, got {size}")
    return size


def check_arguments(size: int, kind: str, args) -> None:
    """Refuse, before the model is built, what the training arguments and the launch cannot
    run with ``size`` > 1."""
    if kind != "sft":
        raise ValueError(
            f"--sequence_parallel_size {size}: sequence parallelism runs SFT only (transformers "
            f"combines the ranks' language-model losses; {kind.upper()} computes its own loss); "
            f"drop the flag"
        )
    check_trl(size)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % size:
        raise ValueError(
            f"--sequence_parallel_size {size} does not divide the {world} launched rank(s) "
            f"(WORLD_SIZE): launch a multiple of {size} processes (--num_processes), or pick a "
            f"size that divides {world}"
        )
    plugin = getattr(args, "deepspeed_plugin", None)
    if plugin is None:
        raise ValueError(
            f"--sequence_parallel_size {size} needs DeepSpeed ZeRO-3 (Ulysses is DeepSpeed's): "
            f"launch with an accelerate config such as "
            f"accelerate_configs/x86x2_superoffload_sp2.yaml, or pass --deepspeed "
            f"accelerate_configs/deepspeed/zero3_superoffload.json"
        )
    if plugin.zero_stage != 3:
        raise ValueError(
            f"--sequence_parallel_size {size} runs on the ZeRO-3 path, but the DeepSpeed config "
            f"has ZeRO stage {plugin.zero_stage}: use accelerate_configs/deepspeed/"
            f"zero3_superoffload.json (stage 3, super_offload)"
        )
    multiple = args.pad_to_multiple_of
    if multiple is not None and multiple % size:
        raise ValueError(
            f"--pad_to_multiple_of {multiple} is not a multiple of --sequence_parallel_size "
            f"{size}: each padded sequence must split into {size} equal shards; pass a multiple "
            f"of {size}, or leave it unset (the recipe then pads to a multiple of {size})"
        )


def check_trl(size: int, version: str | None = None) -> None:
    """Refuse a TRL older than ``SP_MIN_TRL`` (``version``: the installed one's, by default)."""
    if version is None:
        import trl

        version = trl.__version__
    release = re.match(r"(\d+)\.(\d+)", version)
    if release is None:
        raise ValueError(f"cannot read TRL's version {version!r}")
    if tuple(map(int, release.groups())) < SP_MIN_TRL:
        need = ".".join(map(str, SP_MIN_TRL))
        raise ValueError(
            f"--sequence_parallel_size {size} needs TRL >= {need}, whose SFT collator gives each "
            f"batch the position_ids Ulysses shards by; TRL {version} is installed: "
            f"pip install 'trl>={need}'"
        )


def check_model(size: int, config, packing: bool) -> str:
    """Refuse a model whose attention Ulysses cannot split ``size`` ways; return its attention
    implementation (the one Ulysses wraps)."""
    text = config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    # DeepSpeed's rule: query heads split evenly; key/value heads split, or replicate evenly.
    if heads % size or (kv_heads % size and size % kv_heads):
        raise ValueError(
            f"--sequence_parallel_size {size} cannot split this model's attention: "
            f"{heads} query heads and {kv_heads} key/value heads (the query heads must divide "
            f"by it; the key/value heads must divide by it or divide it); pick a size that "
            f"divides {heads}"
        )
    attention = config._attn_implementation
    if attention not in SP_ATTENTION:
        raise ValueError(
            f"--sequence_parallel_size {size} needs sdpa or flash attention (Ulysses passes "
            f"position ids, not a 4D mask), the model runs {attention!r}: pass "
            f"--attn_implementation sdpa (or flash_attention_2)"
        )
    if packing and attention == "sdpa":
        raise ValueError(
            "--packing true with --sequence_parallel_size: sdpa under Ulysses attends across "
            "the packed rows' boundaries (it sees no mask); pass --attn_implementation "
            "flash_attention_2, or drop --packing"
        )
    return attention


def configure(size: int, args, attention: str) -> None:
    """Put the ``ParallelismConfig`` transformers' Trainer hands accelerate into ``args``, and
    pad every batch to a multiple of ``size`` (Ulysses splits each sequence evenly)."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.pad_to_multiple_of is None:
        args.pad_to_multiple_of = size
    args.parallelism_config = ParallelismConfig(
        sp_backend="deepspeed",
        sp_size=size,
        # The rest of the ranks are data parallel: accelerate sizes DeepSpeed's batch by it.
        dp_shard_size=world // size,
        sp_handler=DeepSpeedSequenceParallelConfig(
            sp_seq_length_is_variable=True,  # the collator pads each batch to its longest row
            sp_attn_implementation=attention,
        ),
    )


def join_deepspeed_comm() -> None:
    """Start DeepSpeed's communication layer over the process group accelerate started, if it
    is not up yet: accelerate registers Ulysses (which asserts it is) before
    ``deepspeed.initialize`` would start it, and starts it itself only for GPU launches (on
    CPU processes it starts a plain gloo group)."""
    from deepspeed import comm

    if not comm.is_initialized():
        comm.init_distributed(auto_mpi_discovery=False)
