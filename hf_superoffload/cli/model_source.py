"""Turn ``plan``'s MODEL argument into a transformers config, without downloading anything.

MODEL is a local model directory (its ``config.json`` is read), a ``config.json`` path, the
short name of an architecture config shipped in ``hf_superoffload/model_configs``, or a recipe
YAML (``examples/recipes/``): its ``random_init_from_config`` or a local
``model_name_or_path``, else the shipped config named like the recipe, and the recipe's settings
(plan reads the run from them). A local path wins over a shipped name of the same spelling.
"""

from __future__ import annotations

import dataclasses
import json
from importlib import resources
from pathlib import Path

from .errors import UsageError

# Keys a config may carry that do not describe the architecture to train. Keys starting with
# "_" are the shipped files' comments.
_DROPPED = {
    "quantization_config": "its quantization_config is ignored: full fine-tuning trains the "
    "dequantized bf16 weights",
}


@dataclasses.dataclass(frozen=True)
class ModelSource:
    name: str  # what to call it in the output
    path: str  # the config.json read
    config: object  # a transformers PretrainedConfig
    notes: tuple[str, ...] = ()
    # A recipe's settings (its YAML mapping), which plan reads as examples/sft.py reads them
    # (script_arguments.planned_run); None: not a recipe.
    recipe: dict | None = None
    recipe_path: str | None = None


def shipped_configs() -> dict[str, Path]:
    """Short name -> path of each config.json shipped with the package."""
    folder = resources.files("hf_superoffload") / "model_configs"
    return {entry.name[: -len(".json")]: Path(str(entry)) for entry in _json_files(folder)}


def _json_files(folder) -> list:
    if not folder.is_dir():
        return []
    return sorted((e for e in folder.iterdir() if e.name.endswith(".json")), key=lambda e: e.name)


RECIPE_SUFFIXES = (".yaml", ".yml")


def resolve(spec: str) -> ModelSource:
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix in RECIPE_SUFFIXES:
        return _from_recipe(path)
    shipped = shipped_configs()
    if path.is_dir():
        config_file = path / "config.json"
        if not config_file.is_file():
            raise UsageError(
                f"{path} is a directory without a config.json; pass a model directory that "
                "holds one, a config.json path, or a shipped name"
            )
        name = str(path)
    elif path.is_file():
        config_file, name = path, str(path)
    else:
        key = spec.lower().removesuffix(".json")
        if key not in shipped:
            raise UsageError(
                f"{spec!r} is no model directory, config.json or shipped config; shipped: "
                f"{', '.join(shipped)}"
            )
        config_file, name = shipped[key], key
    values, notes = _read(config_file)
    return ModelSource(name, str(config_file), _to_config(values, config_file), notes)


def _read(config_file: Path) -> tuple[dict, tuple[str, ...]]:
    try:
        values = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UsageError(f"cannot read {config_file} as JSON: {error}") from None
    if not isinstance(values, dict) or "model_type" not in values:
        raise UsageError(
            f"{config_file} has no model_type; pass a transformers config.json (the one "
            "beside the model's weights)"
        )
    notes = tuple(note for key, note in _DROPPED.items() if key in values)
    kept = {k: v for k, v in values.items() if not k.startswith("_") and k not in _DROPPED}
    return kept, notes


def _to_config(values: dict, config_file: Path):
    import huggingface_hub.errors
    import transformers

    # transformers' configs check their fields' types through huggingface_hub's strict
    # dataclasses (where that version has them): a field of the wrong type fails there.
    bad_field = (TypeError, getattr(huggingface_hub.errors, "StrictDataclassError", TypeError))
    model_type = values.pop("model_type")
    try:
        return transformers.AutoConfig.for_model(model_type, **values)
    except bad_field as error:
        raise UsageError(f"{config_file}: a field has a value of the wrong type: {error}") from None
    except (ValueError, KeyError) as error:
        raise UsageError(
            f"transformers {transformers.__version__} cannot build model_type {model_type!r} "
            f"from {config_file} ({error}); upgrade transformers, or pass a config of an "
            "architecture it knows (models needing trust_remote_code are not supported)"
        ) from None


def _from_recipe(path: Path) -> ModelSource:
    """The model a recipe trains, and the recipe's settings."""
    import yaml

    try:
        recipe = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise UsageError(f"cannot read {path} as a YAML recipe: {error}") from None
    if not isinstance(recipe, dict):
        raise UsageError(f"{path} is no recipe: a YAML mapping of training arguments")
    model = recipe.get("random_init_from_config") or recipe.get("model_name_or_path")
    notes = [f"recipe {path}"]
    if model and (Path(model).expanduser().exists() or model in shipped_configs()):
        source = resolve(model)
    elif path.stem in shipped_configs():  # a Hub id: plan its architecture, shipped here
        source = resolve(path.stem)
        notes.append(f"{model!r} is not local: planned from the shipped config {path.stem!r}")
    else:
        raise UsageError(
            f"recipe {path} names the model {model!r}, which is neither a local path nor a "
            f"shipped config; pass the model's config.json as MODEL instead"
        )
    return dataclasses.replace(
        source, notes=(*notes, *source.notes), recipe=recipe, recipe_path=str(path)
    )
