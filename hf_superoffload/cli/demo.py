"""``hf-superoffload demo [--dpo] [ARGS...]``: the main job (``examples/sft.py``, or
``examples/dpo.py`` with ``--dpo``) from the installed package.

Every other argument goes to the job's own parser (TRL's: ``--max_steps 100``,
``--output_dir DIR``, ``--config recipe.yaml``, ``--superoffload_*``); ``--recipe-help`` lists
them.
"""

from __future__ import annotations

import argparse

PASSES_THROUGH = True  # the job's own arguments follow; cli.main hands them over


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "demo",
        allow_abbrev=False,  # "--d..." of the job must not become --dpo
        help="run the main job: a tiny model, bundled data, SuperOffload through TRL",
        description="Train a tiny random Llama on the bundled arithmetic data through TRL's "
        "SFTTrainer (or DPOTrainer with --dpo) and SuperOffload, with no download: a progress "
        "bar, the loss curve (loss.png), a model card (README.md) and the model in "
        "--output_dir, then a summary (tokens/s, rollbacks by cause, where the optimizer "
        "state lived). Exit code 1 when the loss did not go down. Any other argument goes to "
        "the job (TRL's parser: every SFTConfig/DPOConfig and superoffload_* field, --config "
        "recipe.yaml); --recipe-help lists them.",
    )
    parser.add_argument(
        "--dpo", action="store_true", help="the DPO demo (bundled preference pairs)"
    )
    parser.add_argument(
        "--recipe-help", action="store_true", help="list the job's own arguments and exit"
    )
    parser.set_defaults(run=run, passes_through=PASSES_THROUGH)


def run(args: argparse.Namespace) -> int:
    kind = "dpo" if args.dpo else "sft"
    job_args = list(args.extra)
    if args.recipe_help:
        job_args = ["--help"]
    # Offline mode unless the job names something of the Hub (a model, a dataset, a push),
    # decided before `huggingface_hub` loads below; a user's setting wins.
    from ..recipes import hub_access

    hub_access.choose_offline_mode(job_args)
    from ..recipes import run as recipe_run

    return recipe_run.main(
        kind, job_args, prog="hf-superoffload demo" + (" --dpo" if args.dpo else "")
    )
