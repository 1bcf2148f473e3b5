"""``hf-superoffload finetune MODEL superoffload|zerooffload``: run one of the paper's recipes
(``examples/recipes/MODEL.yaml`` of a repository checkout) under accelerate and DeepSpeed ZeRO-3,
keeping everything the run used in a run directory. ``bash examples/finetune_MODEL.sh MODE
[batch]`` calls this.

superoffload: DeepSpeed ZeRO-3 with ``"super_offload": "hf_superoffload"`` (this package's
engine), its ``offload_optimizer.ratio`` chosen by the memory plan (``--ratio auto``) or given.
zerooffload: the same ZeRO-3 settings with DeepSpeed's plain CPU offload and TRL's own trainer
(``accelerate_configs/deepspeed/zero3_offload.json``, ``--optimizer adamw``), the baseline.

A run directory ``RUNS/MODEL_MODE_bBATCH_DATE/`` holds recipe.yaml, deepspeed.json and
accelerate.yaml (the configs used), plan.json (``--ratio auto``), command.sh (the exact launch),
train.log and output/ (the model, its model card, loss.png, the summary).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import yaml

from .. import env
from .checkout import find_checkout
from .errors import EXIT_DOES_NOT_FIT, UsageError
from .ratio_auto import check_ratio

PASSES_THROUGH = True  # arguments it does not know go to examples/sft.py
MODES = ("superoffload", "zerooffload")
# The GPUs each recipe runs on: the SuperOffload paper's examples.
RECIPE_GPUS = {
    "gpt-oss-20b": 1,
    "llama-3.1-8b": 1,
    "phi-4": 1,
    "qwen3-14b": 1,
    "qwen3-30b-a3b": 2,
    "seed-oss-36b": 2,
    "llama-3.3-70b": 4,
}
DEEPSPEED_JSON = {"superoffload": "zero3_superoffload.json", "zerooffload": "zero3_offload.json"}
DEFAULT_BATCH = 4  # per GPU, the paper's; a recipe's per_device_train_batch_size wins
# The loss the plan counts (`plan --loss`): examples/sft.py trains under TRL's SFTTrainer, whose
# fused LM head never holds a batch's logits; --use_liger_kernel true leaves that loss in place
# (TRL refuses Liger's fused cross-entropy beside it) and adds Liger's layer kernels only.
RECIPE_LOSS = "trl"


class DoesNotFit(Exception):
    """The run does not fit the machine (exit code 1); the message says why."""


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "finetune",
        allow_abbrev=False,  # the script's options pass through whole
        help="run a recipe of examples/recipes/ under accelerate and DeepSpeed ZeRO-3",
        description="Full SFT of one of the paper's models with its recipe "
        "(examples/recipes/MODEL.yaml of a repository checkout) under accelerate and DeepSpeed "
        "ZeRO-3: superoffload (this package's engine) or zerooffload (DeepSpeed's plain CPU "
        "offload, the baseline). Writes a run directory with the configs used, the plan, "
        "command.sh, train.log and output/. Any other argument (or all after --) goes to "
        "examples/sft.py. Exit code 1: the run does not fit (the plan says why), 2: bad input.",
        epilog="bash examples/finetune_MODEL.sh MODE [batch] calls this command; its variables "
        "map to the options: RANDOM_INIT=1 --random-init, MODEL_PATH --model-path, RUNS_DIR "
        "--runs-dir, DRY_RUN=1 --dry-run, RATIO --ratio, PLAN_HARDWARE the plan's options "
        '(e.g. "--hardware gh200").',
    )
    parser.add_argument("model", metavar="MODEL", help=f"a recipe: {', '.join(RECIPE_GPUS)}")
    parser.add_argument("mode", choices=MODES, help="this package's engine, or the baseline")
    parser.add_argument(
        "--batch",
        type=_batch,
        help="micro-batch per GPU (default: the recipe's per_device_train_batch_size, else 4)",
    )
    parser.add_argument(
        "--ratio",
        help="superoffload only: DeepSpeed's offload_optimizer.ratio, written into the run's "
        "deepspeed.json. auto (the default): the lowest ratio down to 0.5 whose memory plan "
        "fits the machine (`hf-superoffload plan --ratio auto`, kept as plan.json); a number in "
        "[0, 1] fixes it (1.0: all optimizer state on the host)",
    )
    parser.add_argument("--gpus", type=int, help="GPUs (default: the recipe's, the paper's)")
    parser.add_argument(
        "--dry-run", action="store_true", help="write the run directory, print the command"
    )
    parser.add_argument(
        "--runs-dir", metavar="DIR", help="where run directories go (default examples/runs)"
    )
    parser.add_argument(
        "--random-init",
        action="store_true",
        help="random weights of the recipe's architecture and the bundled arithmetic data "
        "packed into max_length rows: nothing is downloaded (throughput and memory checks)",
    )
    parser.add_argument("--model-path", metavar="DIR", help="local weights, not the Hub id")
    planned = parser.add_argument_group(
        "the machine --ratio auto plans for (default: this one; PLAN_HARDWARE)"
    )
    planned.add_argument("--hardware", metavar="NAME", help="a preset of `plan`")
    planned.add_argument("--gpu-mem", type=float, metavar="GiB", help="memory per GPU, GiB")
    planned.add_argument("--cpu-mem", type=float, metavar="GiB", help="memory per host, GiB")
    parser.set_defaults(run=run, passes_through=PASSES_THROUGH)


def _batch(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"batch_size must be a positive integer, got {text!r}")
    return int(text)


def checkout() -> Path:
    """The repository checkout holding the recipes and the accelerate configs."""
    return find_checkout(Path("examples") / "recipes", Path("accelerate_configs"))


def _ratio(args: argparse.Namespace) -> str:
    """'auto' or the number as given; refuses what the run cannot use."""
    if args.mode == "zerooffload":
        if args.ratio is not None:
            raise UsageError(
                "--ratio / RATIO applies to superoffload mode; zerooffload is the baseline, "
                "DeepSpeed's plain CPU offload with all optimizer state on the host (ratio "
                "1.0). Drop it."
            )
        return "1.0"
    ratio = args.ratio or "auto"
    check_ratio(ratio, "--ratio / RATIO")
    return ratio


def _planned_machine(args: argparse.Namespace) -> list[str]:
    options = []
    if args.hardware:
        options += ["--hardware", args.hardware]
    if args.gpu_mem is not None:
        options += ["--gpu-mem", str(args.gpu_mem)]
    if args.cpu_mem is not None:
        options += ["--cpu-mem", str(args.cpu_mem)]
    return options


def _suggested_hardware() -> str:
    """The preset a refusal's plan command names: this machine's kind of node."""
    return "gh200" if platform.machine() == "aarch64" else "h100-sxm-8"


def _check_gpus(args, gpus: int, recipe: Path) -> None:
    import torch

    found = torch.cuda.device_count()
    if found < gpus:
        raise DoesNotFit(
            f"{args.model} runs on {gpus} GPU(s); this machine has {found}. `hf-superoffload "
            f"plan {recipe} --gpus {gpus} --hardware {_suggested_hardware()}` shows what each "
            f"GPU and host needs; run on such a machine, or with --dry-run to write the run "
            "directory only."
        )


def _script(settings: dict, script_args: list[str]):
    """The script's arguments the plan depends on (imported here: it loads transformers)."""
    from .script_arguments import read

    return read(settings, script_args)


def _never_saves(settings: dict, script_args: list[str]) -> bool:
    """Whether the run saves nothing (``--save_model false``, ``save_strategy`` no), so the plan
    leaves out the save's shard of the 16-bit model in rank 0's host memory."""
    script = _script(settings, script_args)
    return not script.save_model and str(script.save_strategy).lower() == "no"


MOMENTS_ENV = "HF_SUPEROFFLOAD_MOMENTS"


def _moments(settings: dict, script_args: list[str]) -> str:
    """The moments the run keeps: ``--superoffload_moments``, the recipe's, else
    HF_SUPEROFFLOAD_MOMENTS (the trainers' order), else fp32."""
    moments = _script(settings, script_args).superoffload_moments
    return str(moments or env.read(MOMENTS_ENV) or "fp32").lower()


def _checkpointing(settings: dict, script_args: list[str]) -> bool:
    """Whether the run checkpoints activations: ``--activation_checkpointing``, else
    ``--gradient_checkpointing``, the recipe's as defaults, else TRL's default (on). Without
    it the plan counts every layer's saved tensors, or refuses a model it cannot count."""
    return _script(settings, script_args).checkpointing


def _activation_checkpoint_offload(settings: dict, script_args: list[str]) -> bool:
    """Whether the run keeps the checkpointed layer inputs on the host, which the plan counts:
    ``--activation_checkpoint_offload``, or transformers' own (``--activation_checkpointing_kwargs
    '{"offload": true}'``, the same). UsageError for what the script would refuse, and for
    transformers' ``every_n_layers`` other than 1, which the plan does not count."""
    from ..integrations.activation_offload import offload_requested

    script = _script(settings, script_args)
    kwargs = script.checkpointing_kwargs
    if script.activation_checkpoint_offload and not script.checkpointing:
        raise UsageError(
            "examples/sft.py would refuse its arguments: --activation_checkpoint_offload moves "
            "the inputs activation checkpointing keeps, and --activation_checkpointing is off: "
            "pass --activation_checkpointing true, or drop the flag"
        )
    try:
        offload = offload_requested(
            script.activation_checkpoint_offload, kwargs, "activation_checkpointing"
        )
    except ValueError as error:
        raise UsageError(f"examples/sft.py would refuse its arguments: {error}") from None
    if not script.checkpointing:
        return False  # transformers' own offload has no checkpointed inputs to move
    every_n_layers = kwargs.get("every_n_layers", 1)
    if every_n_layers != 1:
        raise UsageError(
            f"RATIO=auto plans every layer checkpointed; every_n_layers {every_n_layers} leaves "
            "the others holding all their activations on the GPU, which the plan does not count: "
            "give --ratio (RATIO) a number in [0, 1], or drop every_n_layers"
        )
    return offload


def _plan_ratio(
    args,
    recipe: Path,
    settings: dict,
    gpus: int,
    batch: int,
    never_saves: bool,
    moments: str,
    activation_checkpoint_offload: bool = False,
    checkpointing: bool = True,
):
    """(ratio, plan JSON or None) for ``--ratio auto``; UsageError or a refusal otherwise."""
    import torch

    from . import build_parser
    from . import plan as plan_command

    if args.dry_run and not _planned_machine(args) and not torch.cuda.is_available():
        print(
            "RATIO=auto: no GPU here to plan for, so this dry run writes ratio 1.0; give "
            "--hardware NAME (PLAN_HARDWARE) or --ratio R (RATIO) to choose it",
            file=sys.stderr,
        )
        return "1.0", None

    model, options = str(recipe), []
    if not args.random_init and args.model_path and Path(args.model_path).is_dir():
        model = args.model_path  # its config, at the recipe's sequence length
        options += ["--seq", str(settings.get("max_length", 4096))]
    accumulation = settings.get("gradient_accumulation_steps", 1)
    argv = ["plan", model, "--gpus", str(gpus), "--batch", str(batch), "--ratio", "auto"]
    argv += ["--gradient-accumulation-steps", str(accumulation), "--loss", RECIPE_LOSS, *options]
    if never_saves:
        argv.append("--no-save")
    if activation_checkpoint_offload:
        argv.append("--activation-checkpoint-offload")
    argv += ["--activation-checkpointing", "on" if checkpointing else "off"]
    argv += ["--moments", moments, *_planned_machine(args)]
    where = "the machine given" if _planned_machine(args) else "this machine"
    try:
        found = plan_command.answer(build_parser().parse_args(argv))
    except UsageError as error:
        raise UsageError(
            f"{error}\nRATIO=auto could not plan {args.model} (above); give --ratio (RATIO) a "
            "number in [0, 1]"
        ) from None
    if not found.fits:
        plan = found.as_json
        lines = [*plan["reasons"], *("change: " + s for s in plan["suggestions"])]
        if any(s.startswith("--no-save") for s in plan["suggestions"]):
            lines.append(
                "(this command plans a run that saves nothing when given --save_model false)"
            )
        raise DoesNotFit(
            f"RATIO=auto: {args.model} fits {gpus} GPU(s) of {where} at no ratio from 1.0 to "
            f"0.5 with room on the GPU; the plan says:\n" + "\n".join(lines) + "\n"
            f"`hf-superoffload {shlex.join(argv)}` shows the whole plan"
        )
    ratio = str(found.as_json["run"]["ratio"])
    print(
        f"RATIO=auto: ratio {ratio}, the lowest the memory plan fits on {gpus} GPU(s) of "
        f"{where} (plan.json)"
    )
    return ratio, found.as_json


def _run_dir(runs: Path, name: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder, count = runs / f"{name}_{stamp}", 1
    while folder.exists():  # two runs started within one second
        count += 1
        folder = runs / f"{name}_{stamp}-{count}"
    folder.mkdir(parents=True)
    return folder


def prepare(args: argparse.Namespace) -> tuple[Path, list[str], dict[str, str]]:
    """Check the arguments, plan, and write the run directory; (its path, the launch command,
    the environment it runs under)."""
    root = checkout()
    recipe = root / "examples" / "recipes" / f"{args.model}.yaml"
    if not recipe.is_file():
        raise UsageError(f"no recipe {recipe}; the recipes are {', '.join(RECIPE_GPUS)}")
    ratio = _ratio(args)
    if args.mode == "zerooffload" and _planned_machine(args):
        raise UsageError("--hardware/--gpu-mem/--cpu-mem (PLAN_HARDWARE) plan superoffload runs")
    gpus = RECIPE_GPUS.get(args.model, 1) if args.gpus is None else args.gpus
    if gpus < 1:
        raise UsageError(f"--gpus must be at least 1, got {gpus}")
    settings = yaml.safe_load(recipe.read_text()) or {}
    batch = args.batch or settings.get("per_device_train_batch_size", DEFAULT_BATCH)
    if not args.dry_run:
        _check_gpus(args, gpus, recipe)
    # GH200 nodes are aarch64 (Grace); anything else gets the x86 configs. The shipped ones
    # (1, 2 and 4 GPUs) differ in num_processes only, which is set to --gpus below.
    machine = "gh200" if platform.machine() == "aarch64" else "x86"
    configs = root / "accelerate_configs"
    accelerate_base = configs / f"{machine}x{gpus}_superoffload.yaml"
    if gpus == 1 or not accelerate_base.is_file():
        accelerate_base = configs / f"{machine}_superoffload.yaml"
    deepspeed_base = root / "accelerate_configs" / "deepspeed" / DEEPSPEED_JSON[args.mode]
    extra = list(args.extra)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    plan = None
    if ratio == "auto":
        never_saves, moments = _never_saves(settings, extra), _moments(settings, extra)
        offload = _activation_checkpoint_offload(settings, extra)
        checkpointing = _checkpointing(settings, extra)
        ratio, plan = _plan_ratio(
            args, recipe, settings, gpus, batch, never_saves, moments, offload, checkpointing
        )
    elif _planned_machine(args):
        print(
            f"--hardware/--gpu-mem/--cpu-mem (PLAN_HARDWARE) are used by --ratio auto only; "
            f"ratio {ratio} is written as given",
            file=sys.stderr,
        )

    runs = Path(args.runs_dir) if args.runs_dir else root / "examples" / "runs"
    run_dir = _run_dir(runs.resolve(), f"{args.model}_{args.mode}_b{batch}")
    (run_dir / "recipe.yaml").write_text(recipe.read_text())
    deepspeed = json.loads(deepspeed_base.read_text())
    if args.mode == "superoffload":
        deepspeed["zero_optimization"]["offload_optimizer"]["ratio"] = float(ratio)
    (run_dir / "deepspeed.json").write_text(json.dumps(deepspeed, indent=2) + "\n")
    if plan is not None:
        (run_dir / "plan.json").write_text(json.dumps(plan, indent=2) + "\n")
    accelerate = yaml.safe_load(accelerate_base.read_text())
    accelerate["deepspeed_config"]["deepspeed_config_file"] = str(run_dir / "deepspeed.json")
    accelerate["num_processes"] = gpus
    with open(run_dir / "accelerate.yaml", "w") as f:
        f.write(f"# Resolved by hf-superoffload finetune from {accelerate_base}, {gpus} GPU(s)\n")
        yaml.safe_dump(accelerate, f, sort_keys=False)

    script_args = ["--config", str(run_dir / "recipe.yaml"), "--output_dir"]
    script_args += [str(run_dir / "output"), "--per_device_train_batch_size", str(batch)]
    if args.mode == "zerooffload":
        script_args += ["--optimizer", "adamw"]  # DeepSpeed's CPU Adam, not ours
    variables = {}
    if args.random_init:
        data = root / "examples" / "data" / "arithmetic_sft.jsonl"
        script_args += ["--random_init_from_config", args.model, "--dataset_path", str(data)]
        variables["HF_HUB_OFFLINE"] = "1"
    else:
        if args.model_path:
            script_args += ["--model_name_or_path", args.model_path]
        # The recipe's Hub model and dataset (examples/sft.py would default to offline).
        variables["HF_HUB_OFFLINE"] = os.environ.get("HF_HUB_OFFLINE", "0")
    command = ["accelerate", "launch", "--config_file", str(run_dir / "accelerate.yaml")]
    command += [str(root / "examples" / "sft.py"), *script_args, *extra]
    date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    lines = [f"# {args.model}, {args.mode}, batch {batch} per GPU, {gpus} GPU(s), {date}"]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in variables.items()]
    lines.append(shlex.join(command))
    (run_dir / "command.sh").write_text("\n".join(lines) + "\n")
    return run_dir, command, variables


def run(args: argparse.Namespace) -> int:
    try:
        run_dir, command, variables = prepare(args)
    except DoesNotFit as refusal:
        print(refusal, file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    print(f"run directory: {run_dir}")
    if args.dry_run:
        print((run_dir / "command.sh").read_text(), end="")
        return 0
    sys.stdout.flush()
    with open(run_dir / "train.log", "w") as log:
        process = subprocess.Popen(
            command,
            cwd=checkout(),
            env={**os.environ, **variables},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for line in process.stdout:  # as tee: the terminal and train.log
            sys.stdout.write(line)
            log.write(line)
        return process.wait()
