"""The training set of a recipe: a local file, a Hub dataset, or the bundled arithmetic rows."""

from __future__ import annotations

import math
from pathlib import Path

from datasets import Dataset, load_dataset

from . import arithmetic

BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


def load_train_dataset(recipe, kind: str) -> Dataset:
    if recipe.dataset_path:
        path = Path(recipe.dataset_path)
        builder = BUILDERS.get(path.suffix)
        if builder is None:
            raise ValueError(
                f"--dataset_path {path}: cannot tell the format from {path.suffix!r}; pass a "
                f"file ending in {', '.join(BUILDERS)}, or a Hub id as --dataset_name"
            )
        if not path.is_file():
            raise ValueError(f"--dataset_path {path}: no such file")
        return load_dataset(builder, data_files=str(path), split="train")
    if recipe.dataset_name and not recipe.shrink_model:
        return load_dataset(recipe.dataset_name, split=recipe.dataset_split)
    if recipe.dataset_name:  # a shrunken model is a smoke test: no download
        print(
            f"--shrink_model: training on the bundled arithmetic data, not {recipe.dataset_name} "
            "(--dataset_path FILE trains on a file)"
        )
    rows = arithmetic.make_sft_rows() if kind == "sft" else arithmetic.make_dpo_rows()
    return Dataset.from_list(rows)


def fill_sequences(dataset: Dataset, recipe, args, tokenizer) -> Dataset:
    """For a run with random weights at full size (a throughput or memory check on the
    bundled rows), rows of text that each fill ``max_length`` tokens, one per sequence of the
    run: the bundled rows are a few tokens each, so packing them leaves part-filled sequences
    (each packing batch ends in one) and too few sequences for a multi-GPU step. Other runs
    (pretrained weights, ``--shrink_model`` smoke runs, other data) train on their data."""
    text_rows = {"prompt", "completion"} <= set(dataset.column_names)
    if not (recipe.random_init_from_config and not recipe.shrink_model and text_rows):
        return dataset
    if getattr(args, "packing", False):
        raise ValueError(
            "random weights on the bundled rows: each training row already fills --max_length "
            "tokens; drop --packing"
        )
    steps = args.max_steps if args.max_steps > 0 else 1
    count = args.per_device_train_batch_size * data_parallel_size(args)
    count *= args.gradient_accumulation_steps * steps
    lines = [row["prompt"] + row["completion"] + "\n" for row in dataset]
    per_line = sum(len(ids) for ids in tokenizer(lines[:200])["input_ids"]) / min(len(lines), 200)
    width = math.ceil(args.max_length * 1.25 / max(per_line, 1.0))  # lines a row needs, with room
    rows = []
    for i in range(count):
        start = (i * 7919) % len(lines)  # each row starts elsewhere in the data
        picked = [lines[(start + j) % len(lines)] for j in range(width)]
        rows.append({"text": "".join(picked)})
    print(f"random weights: {count} rows of at least {args.max_length} tokens from the bundled data, one per sequence of the run")  # fmt: skip
    return Dataset.from_list(rows)


def data_parallel_size(args) -> int:
    """The ranks that each train sequences of their own: Ulysses (``parallelism_config``'s
    ``sp_size``, recipes/sequence_parallel.py) has ``sp_size`` ranks share every sequence, so
    a step takes ``world_size / sp_size`` of them a micro-batch (the Trainer's total batch
    counts the same)."""
    config = getattr(args, "parallelism_config", None)
    sp_size = config.sp_size if config is not None else 1
    return args.world_size // sp_size
