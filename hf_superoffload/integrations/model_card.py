"""The model card a SuperOffload trainer writes: the Trainer's (or TRL's) own card, plus card
data and a "Reproduce" section (versions, hardware, launch command, accelerate config and
recipe, the arguments that matter, and the measured tokens/s, MFU and rollbacks by cause).

``SuperOffloadTrainerMixin.create_model_card`` calls the parent's card function first and then
``add_superoffload_section`` on the README.md it wrote, so ``push_to_hub`` (which calls
``create_model_card``) uploads this card, and whatever the parent writes (the Trainer's
hyperparameters and results table, TRL's quick start and citations) is kept.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import statistics
import sys
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

import torch
from huggingface_hub import ModelCard

from .card_secrets import redact_argv, redact_yaml
from .metrics import sequence_parallel_size
from .optimizer_report import describe, optimizer_state_placement

BEGIN = "<!-- superoffload:reproduce -->"
END = "<!-- /superoffload:reproduce -->"
HEADING = "## Reproduce"
PACKAGES = ("hf_superoffload", "torch", "transformers", "accelerate", "trl", "deepspeed")
ARGUMENTS = (
    "learning_rate",
    "lr_scheduler_type",
    "warmup_steps",
    "warmup_ratio",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "max_grad_norm",
    "bf16",
    "max_steps",
    "num_train_epochs",
    "seed",
    "max_length",
    "beta",
)
# An id the Hub could hold ("name" or "owner/name"), not a local path.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_HF_DATASET_URL = re.compile(r"hf://datasets/([\w.-]+/[\w.-]+)")
_SECRET = re.compile(r"TOKEN|SECRET|KEY|PASSWORD|CREDENTIAL", re.IGNORECASE)


def base_model_of(model) -> str | None:
    """The model config's ``_name_or_path`` when it names a Hub model (not a local directory)."""
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    if not name or os.path.exists(name) or not _HUB_ID.match(name):
        return None
    return name


def dataset_names(dataset) -> list[str]:
    """Hub ids of the datasets ``dataset`` was loaded from, when its info records them (a
    ``load_dataset`` of a Hub repo); none for data built in memory."""
    info = getattr(dataset, "info", None)
    sources = list(getattr(info, "download_checksums", None) or ())
    found = {m.group(1) for url in sources if (m := _HF_DATASET_URL.search(str(url)))}
    return sorted(found)


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    if torch.version.cuda:
        versions["CUDA (torch build)"] = torch.version.cuda
    return versions


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def hardware(num_processes: int = 1) -> dict[str, str]:
    out = {}
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        memory = torch.cuda.get_device_properties(0).total_memory / 2**30
        out["GPU"] = f"{len(names)} x {names[0]} ({memory:.0f} GiB)"
    else:
        out["GPU"] = "none (CPU)"
    cpu = re.search(r"^model name\s*:\s*(.+)$", _read("/proc/cpuinfo"), re.MULTILINE)
    model = cpu.group(1).strip() if cpu else (platform.processor() or "unknown model")
    out["CPU"] = f"{model}, {platform.machine()}, {os.cpu_count()} logical cores"
    mem = re.search(r"^MemTotal:\s*(\d+) kB", _read("/proc/meminfo"), re.MULTILINE)
    out["host memory"] = f"{int(mem.group(1)) / 2**20:.0f} GiB" if mem else "unknown"
    out["processes"] = str(num_processes)
    return out


def _ancestor_cmdlines(levels: int = 4) -> Iterable[tuple[list[str], str]]:
    """(argv, cwd) of the parent processes, nearest first (Linux /proc; nothing elsewhere)."""
    pid = os.getppid()
    for _ in range(levels):
        if pid <= 1:
            return
        raw = _read(f"/proc/{pid}/cmdline")
        if not raw:
            return
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            cwd = ""
        yield [a for a in raw.split("\0") if a], cwd
        ppid = re.search(r"^PPid:\s*(\d+)", _read(f"/proc/{pid}/status"), re.MULTILINE)
        pid = int(ppid.group(1)) if ppid else 0


def _option(argv: list[str], *names: str) -> str | None:
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def _accelerate_launch_args(argv: list[str]) -> list[str] | None:
    """The arguments after ``accelerate launch`` (or ``python -m accelerate.commands.launch``)
    in a process's command line; None when it is not that launcher."""
    for i, arg in enumerate(argv[:3]):
        if arg == "accelerate.commands.launch":
            return argv[i + 1 :]
        if Path(arg).name == "accelerate" and argv[i + 1 : i + 2] == ["launch"]:
            return argv[i + 2 :]
    return None


def launch() -> dict[str, str | None]:
    """The command that ran this process, and the accelerate config file when it can be found.

    NOTE: ``accelerate launch`` does not pass its ``--config_file`` on to the processes it
    starts (only settings, as ``ACCELERATE_*`` variables); the launcher's own command line is
    read from /proc, so the file is found on Linux when the launcher is a near ancestor.
    The command's secrets (``--hub_token``, ``--wandb_api_key=...``) are shown as ``***``."""
    argv = list(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])
    argv[0] = "python"
    out = {
        "command": shlex.join(redact_argv(argv)),
        "accelerate_config": None,
        "accelerate_note": None,
    }
    launched = "ACCELERATE_MIXED_PRECISION" in os.environ
    for parent, cwd in _ancestor_cmdlines():
        launcher = _accelerate_launch_args(parent)
        if launcher is not None:
            out["command"] = shlex.join(redact_argv(["accelerate", "launch", *launcher]))
            config = _option(launcher, "--config_file", "--config-file")
            if config is None:
                from accelerate.commands.config import default_config_file

                config = default_config_file if os.path.isfile(default_config_file) else None
            elif cwd:
                config = os.path.join(cwd, config)
            out["accelerate_config"] = config
            launched = True
            break
    if launched and out["accelerate_config"] is None:
        out["accelerate_note"] = (
            "launched by `accelerate launch`; its config file is not visible to this process "
            "(the settings it passed on are listed under environment)"
        )
    out["recipe"] = _option(sys.argv, "--config")  # TRL's parser: --config recipe.yaml
    return out


def environment() -> dict[str, str]:
    """The HF_SUPEROFFLOAD_* and ACCELERATE_* variables set (they change what the run does)."""
    names = sorted(
        k
        for k in os.environ
        if k.startswith(("HF_SUPEROFFLOAD_", "ACCELERATE_")) and not _SECRET.search(k)
    )
    return {k: os.environ[k] for k in names}


def trainer_kind_tags(trainer) -> list[str]:
    """ "superoffload" and the TRL trainer's kind ("sft", "dpo") from its ``_tag_names``."""
    return ["superoffload", *(t for t in getattr(trainer, "_tag_names", ()) if t != "trl")]


def training_arguments(args, sequence_parallel: int = 1) -> dict:
    """The arguments that matter, and the sequences one optimizer step trains on: as
    transformers' ``get_total_train_batch_size``, the ranks that share a sequence under Ulysses
    (``sequence_parallel``) count once."""
    out = {name: getattr(args, name) for name in ARGUMENTS if hasattr(args, name)}
    out = {k: getattr(v, "value", v) for k, v in out.items()}  # enums by their value
    if getattr(args, "max_steps", -1) > 0:
        out.pop("num_train_epochs", None)
    data_parallel = getattr(args, "world_size", 1) // sequence_parallel
    out["effective batch size (sequences)"] = (
        args.per_device_train_batch_size * args.gradient_accumulation_steps * data_parallel
    )
    if sequence_parallel > 1:
        out["sequence parallel (Ulysses) ranks"] = sequence_parallel
    return out


def results(log_history: list[dict], stats: dict | None) -> dict[str, str]:
    """Measured figures: medians over the logging intervals (each interval's tokens/s counts
    from the previous log), and the STV counters at the end (cumulative)."""
    out = {}

    def median(key):
        values = [log[key] for log in log_history if key in log]
        return (statistics.median(values), len(values)) if values else (None, 0)

    tokens, n = median("tokens_per_second")
    out["tokens/s"] = f"{tokens:.1f} (median of {n} logging intervals)" if n else "not logged"
    tflops, n = median("tflops")
    if n:
        out["model TFLOP/s per GPU"] = f"{tflops:.3g}"
    mfu, n = median("mfu")
    out["MFU"] = (
        f"{mfu:.1%}"
        if n
        else "not logged (a CPU run, or a GPU without a known peak: HF_SUPEROFFLOAD_PEAK_TFLOPS)"
    )
    last = next((log for log in reversed(log_history) if "stv/rollbacks_clip" in log), {})
    counters = {k: stats[k] for k in stats} if stats else {k[4:]: v for k, v in last.items()}
    if counters:
        out["optimizer steps speculated"] = f"{counters.get('speculative_steps', 0):.0f}"
        out["rollbacks: gradient clipping"] = f"{counters.get('rollbacks_clip', 0):.0f}"
        out["rollbacks: non-finite gradients"] = f"{counters.get('rollbacks_nonfinite', 0):.0f}"
    losses = [log["loss"] for log in log_history if "loss" in log]
    if losses:
        out["last logged loss"] = f"{losses[-1]:.4g}"
    summary = next((log for log in reversed(log_history) if "train_runtime" in log), {})
    if "train_runtime" in summary:
        out["train runtime (s)"] = f"{summary['train_runtime']:.4g}"
    return out


def _table(rows: dict) -> str:
    lines = ["| | |", "|---|---|"]
    lines += [f"| {k} | `{v}` |" for k, v in rows.items()]
    return "\n".join(lines)


def _file_block(title: str, path: str | None, note: str | None = None) -> str:
    """The YAML file at ``path`` (a recipe, an accelerate config), its secrets shown as ``***``."""
    if path is None:
        return f"**{title}:** {note}" if note else ""
    text = redact_yaml(_read(path))
    if not text:
        return f"**{title}:** `{path}` (not readable when the card was written)"
    return f"**{title}** (`{path}`):\n\n```yaml\n{text.rstrip()}\n```"


def reproduce_section(trainer) -> str:
    run = launch()
    parallelism = getattr(trainer.accelerator, "parallelism_config", None)
    arguments = training_arguments(trainer.args, sequence_parallel_size(parallelism))
    # NOTE: the Trainer's own card names the ``optim`` argument; the optimizer that ran, and
    # where its fp32 master and moments lived, is this one.
    model = trainer.accelerator.unwrap_model(trainer.model)
    arguments["optimizer"] = describe(optimizer_state_placement(trainer, model))
    parts = [
        BEGIN,
        HEADING,
        f"{trained_with(trainer)}. To reproduce, install these versions and run the command "
        "below from the training run's directory.",
        "### Command\n\n```bash\n" + run["command"] + "\n```",
        _file_block("accelerate config", run["accelerate_config"], run["accelerate_note"]),
        _file_block("Recipe", run["recipe"]),
        "### Environment\n\n" + (_table(environment()) if environment() else "none set"),
        "### Versions\n\n" + _table(package_versions()),
        "### Hardware\n\n" + _table(hardware(trainer.accelerator.num_processes)),
        "### Training arguments\n\n" + _table(arguments),
        "### SuperOffload options\n\n" + _table(superoffload_options(trainer)),
        "### Results\n\n" + _table(_results(trainer)),
        END,
    ]
    return "\n\n".join(p for p in parts if p)


def trained_with(trainer) -> str:
    """What trained the model, for the section's first line: under ``HF_SUPEROFFLOAD_DEEPSPEED=0``
    on DeepSpeed, DeepSpeed's own SuperOffload (the trainer drove it; this package's engine did
    not run)."""
    if trainer._on_deepspeed:
        from ..zero3.activation import OPT_OUT_ENV, engine_on

        if not engine_on():
            return (
                "Trained with DeepSpeed's own SuperOffload optimizer on ZeRO-3, run by a "
                f"`hf_superoffload` trainer with `{OPT_OUT_ENV}=0` (`hf_superoffload`'s own "
                "engine did not run)"
            )
    return (
        "Trained with `hf_superoffload` (SuperOffload: speculation-then-validation "
        "CPU-offloaded Adam)"
    )


def _results(trainer) -> dict[str, str]:
    """``results`` with the STV counters as the logs report them: the snapshot kept at the end
    of train() (each counter the largest over the ranks) while the optimizer has taken no step
    since; else the optimizer's own now, said to be this process's where there are others (a
    card written during training, at a checkpoint, is written by the main process alone and
    cannot gather theirs)."""
    optimizer = trainer._stv_optimizer
    snapshot = getattr(trainer, "superoffload_stats", None)
    if optimizer is None or (snapshot and snapshot.get("steps") == optimizer.stats.get("steps")):
        return results(trainer.state.log_history, snapshot)
    out = results(trainer.state.log_history, optimizer.stats)
    processes = trainer.accelerator.num_processes
    if processes > 1:
        out["STV counters"] = (
            f"the main process's, during training (the logs give the largest of {processes})"
        )
    return out


def superoffload_options(trainer) -> dict:
    """The options that acted, and where the optimizer ran."""
    if trainer._on_deepspeed:
        from ..zero3.activation import OPT_OUT_ENV, engine_on
        from ..zero3.config import REPLACED_BY_DEEPSPEED

        if engine_on():  # the DeepSpeed config's keys stand for those it replaces
            options = {
                name: value
                for name, value in trainer._explicit_options().items()
                if name not in REPLACED_BY_DEEPSPEED and value is not None
            }
            options["path"] = "DeepSpeed ZeRO-3 (super_offload: true)"
        else:  # DeepSpeed's own optimizer read none of ours (export_zero3_options refuses them)
            options = {"path": f"DeepSpeed's own SuperOffload on ZeRO-3 ({OPT_OUT_ENV}=0)"}
        optimizer = trainer._stv_optimizer  # what ran (options may come from the environment)
        if optimizer is not None:
            options["moments"] = optimizer.moments
        ds_config = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
        if ds_config:
            options["DeepSpeed config"] = ds_config
        return options
    options = {
        name: "default" if value is None else value
        for name, value in trainer._resolved_options().optimizer_kwargs().items()
    }
    options["save_dtype"] = str(trainer._superoffload_save_dtype()).replace("torch.", "")
    return options


def add_superoffload_section(trainer, path: str, tags: list[str], datasets: list[str]) -> None:
    """Merge our card data into the card at ``path`` (written by the parent's card function, or
    a new one) and put the Reproduce section in, replacing an earlier one."""
    card = ModelCard.load(path) if os.path.isfile(path) else ModelCard("---\n---\n")
    data = card.data
    model = trainer.accelerator.unwrap_model(trainer.model)
    base_model = base_model_of(model)
    if base_model and not data.get("base_model"):
        data.base_model = base_model
    known = data.get("datasets") or []
    known = [known] if isinstance(known, str) else list(known)
    if datasets:
        data.datasets = known + [d for d in datasets if d not in known]
    if not data.get("library_name"):
        data.library_name = "transformers"
    old_tags = list(data.get("tags") or [])
    data.tags = old_tags + [t for t in tags if t not in old_tags]
    section = reproduce_section(trainer)
    text = _without_empty_names(card.text, trainer.args.output_dir)
    pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.DOTALL)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else f"{text}\n\n{section}"
    card.text = text.strip() + "\n"
    card.save(path)


# TRL's card template names the base model and the Hub id whether or not they are known.
_FINETUNED_FROM_NONE = "This model is a fine-tuned version of [None](https://huggingface.co/None)"
_PIPELINE_OF_NONE = 'model="None"'


def _without_empty_names(text: str, output_dir: str) -> str:
    """TRL's card with no base model and no Hub id says "a fine-tuned version of [None]" and
    loads ``model="None"`` in its quick start: say what is known instead (the model was
    trained; it loads from the output directory)."""
    text = text.replace(_FINETUNED_FROM_NONE, "This model was trained")
    return text.replace(_PIPELINE_OF_NONE, f"model={json.dumps(str(output_dir))}")
