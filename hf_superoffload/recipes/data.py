"""The training set of a recipe: a local file, a Hub dataset, or the bundled arithmetic rows."""

from __future__ import annotations

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
