"""Whether a recipe run needs the Hugging Face Hub, and the offline mode that follows from it.

The demo and the random-weight recipes on local data need nothing from the Hub: offline,
``datasets`` and the trainers skip their look-ups (and the waits on a machine without network).
A run that names a Hub model, tokenizer, dataset or chat template, pushes to the Hub, or logs to
a Hub Space (``--report_to trackio`` with ``--trackio_space_id`` or ``TRACKIO_SPACE_ID``) is left
online; ``--hub_model_id`` only names the repository a push goes to, and needs the Hub only
beside ``--push_to_hub``. ``choose_offline_mode`` decides from the command line before
``huggingface_hub`` is imported (it reads ``HF_HUB_OFFLINE`` once, at import); the user's own
``HF_HUB_OFFLINE`` always wins. ``check_hub_reachable`` runs on the parsed arguments before
anything is built and refuses a run that needs the Hub while offline mode is on, unless what it
needs is in the local cache.

This module imports nothing from the Hugging Face libraries.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from collections.abc import MutableMapping
from pathlib import Path

VARIABLE = "HF_HUB_OFFLINE"
_TRUE = ("1", "ON", "YES", "TRUE")  # huggingface_hub's reading of the variable
_BOOL_WORDS = {"yes": True, "true": True, "t": True, "y": True, "1": True,
               "no": False, "false": False, "f": False, "n": False, "0": False}  # fmt: skip

# Set when choose_offline_mode turned offline mode on, so a later check does not tell the user
# to unset a variable they never set.
_set_here = False


def is_offline(environ: MutableMapping[str, str]) -> bool:
    value = environ.get(VARIABLE) or environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in _TRUE


def _local(value: str) -> bool:
    return Path(value).expanduser().exists()


def _to_bool(value) -> bool:
    if isinstance(value, bool):
        return value
    return _BOOL_WORDS.get(str(value).lower(), bool(value))


def _reports_to_trackio(report_to) -> bool:
    """Whether transformers' ``report_to`` (a name, a list, ``all`` or ``none``) includes
    trackio: ``all`` means every integration installed."""
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    if "all" in names:
        return importlib.util.find_spec("trackio") is not None
    return "trackio" in names


def hub_uses(
    values: dict, environ: MutableMapping[str, str] = os.environ
) -> list[tuple[str, str, str]]:
    """What a run with these recipe values takes from or sends to the Hub, as
    ``(argument, value, kind)`` rows; kind is a repo type (``model``, ``dataset``), ``push``
    or ``space`` (trackio logging to a Hub Space). It follows what recipes/model.py and
    recipes/data.py load: a local path needs no Hub, and neither does ``model_name_or_path``
    under ``--random_init_from_config``, nor ``dataset_name`` beside ``--dataset_path`` or
    under ``--shrink_model``. A trackio Space id (the argument, else ``TRACKIO_SPACE_ID`` in
    ``environ``) is used only when the run reports to trackio."""
    uses = []
    random_init = values.get("random_init_from_config")
    model = values.get("model_name_or_path")
    tokenizer = values.get("tokenizer_name_or_path")
    if tokenizer and not _local(tokenizer):
        uses.append(("--tokenizer_name_or_path", tokenizer, "model"))
    if model and not random_init and not _local(model):
        uses.append(("--model_name_or_path", model, "model"))
    dataset = values.get("dataset_name")
    from_hub = not values.get("dataset_path") and not _to_bool(values.get("shrink_model", False))
    if dataset and from_hub and not _local(dataset):
        uses.append(("--dataset_name", dataset, "dataset"))
    template = values.get("chat_template_path")
    if template and not _local(template):
        uses.append(("--chat_template_path", template, "model"))
    if _to_bool(values.get("push_to_hub", False)):
        uses.append(("--push_to_hub", "", "push"))
    if _reports_to_trackio(values.get("report_to")):
        if values.get("trackio_space_id"):
            uses.append(("--trackio_space_id", values["trackio_space_id"], "space"))
        elif environ.get("TRACKIO_SPACE_ID"):
            uses.append(("TRACKIO_SPACE_ID", environ["TRACKIO_SPACE_ID"], "space"))
    return uses


_NAMES = ("model_name_or_path", "random_init_from_config", "tokenizer_name_or_path",
          "dataset_name", "dataset_path", "chat_template_path", "report_to",
          "trackio_space_id")  # fmt: skip
_FLAGS = ("shrink_model", "push_to_hub")


def values_from_argv(argv: list[str]) -> dict | None:
    """The values ``hub_uses`` reads, from ``--config recipe.yaml`` and the command line (which
    wins), read as TRL's parser reads them; None when they cannot be read (a missing or broken
    YAML), which the recipe's own parser then reports."""
    argv = list(argv)
    values: dict = {}
    if "--config" in argv:  # TRL's parser takes this spelling only
        index = argv.index("--config")
        if index + 1 >= len(argv):
            return None
        import yaml

        try:
            with open(argv[index + 1]) as file:
                config = yaml.safe_load(file)
        except (OSError, yaml.YAMLError):
            return None
        if not isinstance(config, dict):
            return None
        values.update({k: config[k] for k in (*_NAMES, *_FLAGS) if k in config})
        del argv[index : index + 2]
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for name in _NAMES:
        parser.add_argument(f"--{name}", default=argparse.SUPPRESS)
    for name in _FLAGS:  # transformers' booleans: the bare flag is true
        parser.add_argument(f"--{name}", nargs="?", const=True, default=argparse.SUPPRESS)
    given, _ = parser.parse_known_args(argv)
    values.update(vars(given))
    return values


def choose_offline_mode(argv: list[str], environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set ``HF_HUB_OFFLINE=1`` in ``environ`` when the run needs nothing from the Hub and the
    user has not set the variable; return whether it was set. Call before ``huggingface_hub``
    is imported."""
    global _set_here
    if VARIABLE in environ:  # the user's setting wins, either way
        return False
    values = values_from_argv(argv)
    if values is None or hub_uses(values, environ):
        return False
    environ[VARIABLE] = "1"
    _set_here = environ is os.environ
    return True


def _hub_cache(environ: MutableMapping[str, str]) -> Path:
    """huggingface_hub's cache folder, as it finds it."""
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if environ.get(key):
            return Path(environ[key]).expanduser()
    return _hf_home(environ) / "hub"


def _hf_home(environ: MutableMapping[str, str]) -> Path:
    if environ.get("HF_HOME"):
        return Path(environ["HF_HOME"]).expanduser()
    xdg = environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(xdg) / "huggingface"


def is_cached(repo_id: str, repo_type: str, environ: MutableMapping[str, str]) -> bool:
    """Whether ``repo_id`` has a snapshot in the Hub cache (or, for a dataset, a prepared copy
    in ``datasets``' cache), which offline mode can load."""
    folder = f"{repo_type}s--{repo_id.replace('/', '--')}"
    if (_hub_cache(environ) / folder / "snapshots").is_dir():
        return True
    if repo_type != "dataset":
        return False
    datasets_cache = environ.get("HF_DATASETS_CACHE")
    root = Path(datasets_cache).expanduser() if datasets_cache else _hf_home(environ) / "datasets"
    prepared = repo_id.replace("/", "___")
    return (root / prepared).is_dir() or (root / prepared.lower()).is_dir()


def check_hub_reachable(
    values: dict, offline: bool, environ: MutableMapping[str, str] = os.environ
) -> None:
    """Refuse, before anything is built, a run that needs the Hub while offline mode is on:
    a push, trackio logging to a Hub Space, or a model, tokenizer or dataset missing from the
    local cache (a cached one loads offline). ``offline`` is huggingface_hub's own reading of
    ``HF_HUB_OFFLINE``."""
    if not offline:
        return
    missing, kinds = [], {}
    for argument, value, kind in hub_uses(values, environ):
        if kind == "push":
            missing.append(f"{argument} (uploads to the Hub)")
        elif kind == "space":
            given = f"{argument} {value}" if argument.startswith("--") else f"{argument}={value}"
            missing.append(f"{given} (trackio logs to this Hub Space)")
        elif not is_cached(value, kind, environ):
            missing.append(f"{argument} {value} (a Hub {kind}, not in the local cache)")
            kind = "load"
        else:
            continue
        kinds[kind] = argument
    if not missing:
        return
    if _set_here:  # our reading of the command line disagreed with the parser's
        cause = "this script set HF_HUB_OFFLINE=1, having found nothing that needs the Hub"
        remedy = "Set HF_HUB_OFFLINE=0"
    else:
        transformers_only = not environ.get(VARIABLE) and environ.get("TRANSFORMERS_OFFLINE")
        name = "TRANSFORMERS_OFFLINE" if transformers_only else VARIABLE
        cause = f"{name}={environ.get(name, '1')} in your environment"
        remedy = f"Unset {name} (or set it to 0)"
    instead = []
    if "load" in kinds:
        instead.append("pass local paths (--model_name_or_path DIR, --dataset_path FILE)")
    if "push" in kinds:
        instead.append("drop --push_to_hub")
    if "space" in kinds:
        space = kinds["space"]
        drop = f"drop {space}" if space.startswith("--") else f"unset {space}"
        instead.append(f"{drop} (trackio then logs locally)")
    raise ValueError(
        f"this run needs the Hugging Face Hub for {'; '.join(missing)}, but offline mode is "
        f"on: {cause}. {remedy} to reach the Hub, or {' and '.join(instead)}."
    )
