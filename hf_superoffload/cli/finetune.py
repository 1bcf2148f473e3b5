"""``hf-superoffload finetune MODEL superoffload|zerooffload``: run one of the paper's recipes
(``examples/recipes/MODEL.yaml`` of a repository checkout) under accelerate and DeepSpeed ZeRO-3,
keeping everything the run used in a run directory. ``bash examples/finetune_MODEL.sh MODE
[batch]`` calls this.

superoffload: DeepSpeed ZeRO-3 with ``"super_offload": "hf_superoffload"`` (this package's
engine), its ``offload_optimizer.ratio`` chosen by the memory plan (``--ratio auto``) or given.
zerooffload: the same ZeRO-3 settings with DeepSpeed's plain CPU offload and TRL's own trainer
(``accelerate_configs/deepspeed/zero3_offload.json``, ``--optimizer adamw``), the baseline.

A run directory ``RUNS/MODEL_MODE_bBATCH_DATE/`` (the batch the run uses) holds recipe.yaml, deepspeed.json and
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

from .checkout import find_checkout
from .errors import EXIT_DOES_NOT_FIT, UsageError
from .finetune_plan import (
    DoesNotFit,
    check_gpus,
    plan_ratio,
    planned_machine,
    planned_run,
    script_batch,
    superoffload_arguments,
)
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
        help="micro-batch per GPU (default: the recipe's per_device_train_batch_size, else 4); "
        "a --per_device_train_batch_size for examples/sft.py comes after it and wins",
    )
    parser.add_argument(
        "--ratio",
        help="superoffload only: DeepSpeed's offload_optimizer.ratio, written into the run's "
        "deepspeed.json. auto (the default): the lowest ratio down to 0.5 whose memory plan "
        "fits the machine (`hf-superoffload plan --ratio auto`, kept as plan.json), for the run "
        "launched: the recipe with examples/sft.py's arguments over it (--max_length, "
        "--gradient_accumulation_steps, ...); a number in [0, 1] fixes it (1.0: all optimizer "
        "state on the host)",
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


def refuse_superoffload_arguments(settings: dict, script_args: list[str]) -> None:
    """zerooffload launches the recipe with ``--optimizer adamw``, whose parser refuses
    ``superoffload_*`` arguments (the script's or the recipe's) once the launched script starts:
    the same check (recipes/arguments.py), here, before the run directory is written."""
    from ..recipes.arguments import RecipeArguments, check_optimizer_arguments

    given = superoffload_arguments(settings, script_args)
    try:
        check_optimizer_arguments(RecipeArguments(optimizer="adamw"), given)
    except ValueError as error:
        raise UsageError(
            f"zerooffload (the baseline, DeepSpeed's plain CPU offload) launches examples/sft.py "
            f"with --optimizer adamw, which refuses them: {error} Here: drop them, or run "
            "superoffload mode."
        ) from None


def refuse_engine_variables() -> None:
    """zerooffload's DeepSpeed config asks for no SuperOffload, so the launched run refuses the
    engine's HF_SUPEROFFLOAD_* variables set (nothing would read them): here, before the run
    directory is written and the model is loaded."""
    from ..zero3.config import engine_variables_set

    variables = engine_variables_set()
    if variables:
        raise UsageError(
            f'zerooffload (the baseline, DeepSpeed\'s plain CPU offload: no "super_offload" in '
            f"its DeepSpeed config) builds DeepSpeed's optimizer, which reads none of "
            f"{', '.join(variables)} (hf_superoffload's engine options). Unset them for this "
            f"run (env -u NAME ...), or run superoffload mode."
        )


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
    if args.mode == "zerooffload" and planned_machine(args):
        raise UsageError("--hardware/--gpu-mem/--cpu-mem (PLAN_HARDWARE) plan superoffload runs")
    gpus = RECIPE_GPUS.get(args.model, 1) if args.gpus is None else args.gpus
    if gpus < 1:
        raise UsageError(f"--gpus must be at least 1, got {gpus}")
    settings = yaml.safe_load(recipe.read_text()) or {}
    extra = list(args.extra)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    if args.mode == "zerooffload":
        refuse_superoffload_arguments(settings, extra)
        refuse_engine_variables()
    given_batch = args.batch or settings.get("per_device_train_batch_size", DEFAULT_BATCH)
    passed = ["--per_device_train_batch_size", str(given_batch)]  # before the script's own
    # examples/sft.py reads the recipe, then these arguments, the last one given winning (a
    # batch, sequence length or accumulation after --): the run directory's name, command.sh
    # and the plan take the run's values as it reads them.
    batch = script_batch(settings, [*passed, *extra])
    run_settings = planned_run(settings, [*passed, *extra]) if ratio == "auto" else None
    if not args.dry_run:
        check_gpus(args, gpus, recipe)
    # GH200 nodes are aarch64 (Grace); anything else gets the x86 configs. The shipped ones
    # (1, 2 and 4 GPUs) differ in num_processes only, which is set to --gpus below.
    machine = "gh200" if platform.machine() == "aarch64" else "x86"
    configs = root / "accelerate_configs"
    accelerate_base = configs / f"{machine}x{gpus}_superoffload.yaml"
    if gpus == 1 or not accelerate_base.is_file():
        accelerate_base = configs / f"{machine}_superoffload.yaml"
    deepspeed_base = root / "accelerate_configs" / "deepspeed" / DEEPSPEED_JSON[args.mode]
    plan = None
    if ratio == "auto":
        ratio, plan = plan_ratio(args, recipe, gpus, run_settings)
    elif planned_machine(args):
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
    script_args += [str(run_dir / "output"), *passed]
    if args.mode == "zerooffload":
        script_args += ["--optimizer", "adamw"]  # DeepSpeed's CPU Adam, not ours
    # No HF_HUB_OFFLINE here: examples/sft.py goes offline by itself when the run needs nothing
    # from the Hub (recipes/hub_access.py), and the user's own setting wins there.
    variables: dict[str, str] = {}
    if args.random_init:
        data = root / "examples" / "data" / "arithmetic_sft.jsonl"
        script_args += ["--random_init_from_config", args.model, "--dataset_path", str(data)]
    elif args.model_path:
        script_args += ["--model_name_or_path", args.model_path]
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
