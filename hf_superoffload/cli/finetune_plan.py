"""Whether a run of ``hf-superoffload finetune`` fits the machine: the GPUs its recipe runs on,
and for ``--ratio auto`` (RATIO=auto) the lowest ``offload_optimizer.ratio`` whose memory plan
fits (`hf-superoffload plan --ratio auto`), planned for the run the recipe and the script's
arguments describe (cli/script_arguments.py reads those)."""

from __future__ import annotations

import argparse
import dataclasses
import platform
import shlex
import sys
from pathlib import Path

from .errors import UsageError


class DoesNotFit(Exception):
    """The run does not fit the machine (exit code 1); the message says why."""


def planned_machine(args: argparse.Namespace) -> list[str]:
    """The plan's options naming the machine given (--hardware, --gpu-mem, --cpu-mem)."""
    options = []
    if args.hardware:
        options += ["--hardware", args.hardware]
    if args.gpu_mem is not None:
        options += ["--gpu-mem", str(args.gpu_mem)]
    if args.cpu_mem is not None:
        options += ["--cpu-mem", str(args.cpu_mem)]
    return options


def superoffload_arguments(settings: dict, script_args: list[str]):
    """The ``superoffload_*`` arguments of the launched script (SuperOffloadArgumentsMixin's
    fields, None where not given), from the recipe's ``settings`` and the script's arguments,
    parsed as the script parses them (script_arguments.read: the same parser, its refusals)."""
    import typing

    from ..integrations.arguments import SuperOffloadArgumentsMixin
    from .script_arguments import _Parser

    types = typing.get_type_hints(SuperOffloadArgumentsMixin)
    fields = [
        (f.name, types[f.name], dataclasses.field(default=None))
        for f in dataclasses.fields(SuperOffloadArgumentsMixin)
    ]
    given = dataclasses.make_dataclass("ScriptSuperOffloadArguments", fields)
    parser = _Parser(given, allow_abbrev=False, add_help=False)
    parser.set_defaults(**{k: v for k, v in settings.items() if k in types})
    return parser.parse_args_into_dataclasses(script_args, return_remaining_strings=True)[0]


def _suggested_hardware() -> str:
    """The preset a refusal's plan command names: this machine's kind of node."""
    return "gh200" if platform.machine() == "aarch64" else "h100-sxm-8"


def check_gpus(args: argparse.Namespace, gpus: int, recipe: Path) -> None:
    import torch

    found = torch.cuda.device_count()
    if found < gpus:
        raise DoesNotFit(
            f"{args.model} runs on {gpus} GPU(s); this machine has {found}. `hf-superoffload "
            f"plan {recipe} --gpus {gpus} --hardware {_suggested_hardware()}` shows what each "
            f"GPU and host needs; run on such a machine, or with --dry-run to write the run "
            "directory only."
        )


def script_batch(settings: dict, script_args: list[str]) -> int:
    """The batch per GPU examples/sft.py runs: the script's arguments over the recipe's."""
    from .script_arguments import read  # here: it loads transformers

    return read(settings, script_args).per_device_train_batch_size


def planned_run(settings: dict, script_args: list[str]):
    """The run examples/sft.py is launched for: the recipe's ``settings`` with the script's
    arguments over them, read by one parser (script_arguments.planned_run); UsageError for what
    the script would refuse, or what RATIO=auto cannot plan."""
    from . import script_arguments  # here: it loads transformers

    run = script_arguments.planned_run(settings, script_args)
    if run.optimizer != "superoffload":
        raise UsageError(
            f"RATIO=auto plans SuperOffload runs, and --optimizer {run.optimizer} trains with the "
            "Trainer's own AdamW: drop it (zerooffload mode runs that baseline, under DeepSpeed's "
            "CPU offload), or give --ratio (RATIO) a number in [0, 1]"
        )
    if run.sequence_parallel_size > 1:
        raise UsageError(
            f"RATIO=auto cannot plan --sequence_parallel_size {run.sequence_parallel_size}: "
            "Ulysses splits each sequence over that many ranks, and the memory plan counts "
            "whole sequences on every rank; give --ratio (RATIO) a number in [0, 1]"
        )
    if run.seq is None:
        raise UsageError(
            "RATIO=auto plans the run's sequence length, and max_length is null (no limit): "
            "give it a number in the recipe, or pass --max_length N after --"
        )
    return run


def plan_ratio(args: argparse.Namespace, recipe: Path, gpus: int, run) -> tuple[str, dict | None]:
    """(ratio, plan JSON or None) for ``--ratio auto`` of ``run`` (``planned_run``'s);
    UsageError or a refusal otherwise."""
    import torch

    from . import build_parser
    from . import plan as plan_command

    if args.dry_run and not planned_machine(args) and not torch.cuda.is_available():
        print(
            "RATIO=auto: no GPU here to plan for, so this dry run writes ratio 1.0; give "
            "--hardware NAME (PLAN_HARDWARE) or --ratio R (RATIO) to choose it",
            file=sys.stderr,
        )
        return "1.0", None

    model = str(recipe)
    if not args.random_init and args.model_path and Path(args.model_path).is_dir():
        model = args.model_path  # its config
    # Every setting of the run as an option, so the plan command named below plans this run
    # whatever the recipe says.
    argv = ["plan", model, "--gpus", str(gpus), "--seq", str(run.seq), "--batch", str(run.batch)]
    argv += ["--ratio", "auto", "--gradient-accumulation-steps", str(run.gradient_accumulation)]
    # The loss as the run computes it (script_arguments.PlannedRun.loss): TRL's fused LM head,
    # which never holds a batch's logits (--use_liger_kernel true leaves it in place: TRL refuses
    # Liger's fused cross-entropy beside it), or with label smoothing the batch's full logits.
    argv += ["--loss", run.loss, "--no-save" if run.never_saves else "--save"]
    argv.append(
        "--activation-checkpoint-offload"
        if run.activation_checkpoint_offload
        else "--no-activation-checkpoint-offload"
    )
    argv += ["--activation-checkpointing", "on" if run.checkpointing else "off"]
    dtype = next(k for k, v in plan_command.DTYPE_BYTES.items() if v == run.dtype_bytes)
    argv += ["--moments", run.moments, "--cast", run.cast, "--dtype", dtype]
    argv += planned_machine(args)
    where = "the machine given" if planned_machine(args) else "this machine"
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
