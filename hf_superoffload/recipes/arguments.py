"""The recipe scripts' command line: TRL's parser over the script's own arguments and the
SuperOffload SFT/DPO config (every TrainingArguments, SFTConfig/DPOConfig and ``superoffload_*``
argument), read from ``--config recipe.yaml`` and then from the command line, which wins.

With no model named (neither ``--model_name_or_path`` nor ``--random_init_from_config``) the
script is the demo: a tiny Llama on the bundled arithmetic data, and ``DEMO_DEFAULTS`` replace
TRL's defaults, which suit pretrained models (a learning rate of 2e-5 teaches a random model
nothing in 50 steps). A recipe YAML or the command line still override each of them.
"""

from __future__ import annotations

import dataclasses

import torch
from trl import TrlParser

from .. import env
from ..integrations.arguments import SuperOffloadArgumentsMixin, _on_deepspeed
from ..integrations.trl import SuperOffloadDPOConfig, SuperOffloadSFTConfig

KINDS = {"sft": SuperOffloadSFTConfig, "dpo": SuperOffloadDPOConfig}


@dataclasses.dataclass
class RecipeArguments:
    """What the recipe trains and on what; the training arguments are TRL's."""

    model_name_or_path: str | None = dataclasses.field(
        default=None,
        metadata={"help": "Hub id or local directory of a pretrained model (from_pretrained; "
                  "offline, it must be cached or local)."},
    )  # fmt: skip
    random_init_from_config: str | None = dataclasses.field(
        default=None,
        metadata={"help": "Build the model with random weights from a config.json (or a model "
                  "directory holding one, or a shipped name such as qwen3-14b: "
                  "hf_superoffload/model_configs); nothing is downloaded. Takes the place of "
                  "--model_name_or_path's weights."},
    )  # fmt: skip
    tokenizer_name_or_path: str | None = dataclasses.field(
        default=None,
        metadata={"help": "Tokenizer to load. Default: the model's; with "
                  "--random_init_from_config or the demo, the download-free character "
                  "tokenizer of hf_superoffload.toy."},
    )  # fmt: skip
    shrink_model: bool = dataclasses.field(
        default=False,
        metadata={"help": "Shrink the config before building (hidden 64, 2 layers, at most 16 "
                  "experts, the tokenizer's vocabulary): the recipe's architecture, code path "
                  "and arguments in seconds on a CPU (with --bf16 false), for smoke tests. It "
                  "trains the bundled arithmetic data, not the recipe's Hub dataset, unless "
                  "--dataset_path is given."},
    )  # fmt: skip
    attn_implementation: str | None = dataclasses.field(
        default=None,
        metadata={"help": "transformers' attention implementation (eager, sdpa, "
                  "flash_attention_2, ...); default: transformers' choice for the model."},
    )  # fmt: skip
    sequence_parallel_size: int | None = dataclasses.field(
        default=None,
        metadata={"help": "Ulysses sequence parallelism (SFT, DeepSpeed ZeRO-3): split each "
                  "sequence over this many ranks, for sequences too long for one GPU; with N "
                  "ranks, --gradient_accumulation_steps N covers the sequences N data-parallel "
                  "ranks take a step. Default: an accelerate config's parallelism_config_sp_size "
                  "(accelerate_configs/*_sp2.yaml), else 1 (off)."},
    )  # fmt: skip
    activation_checkpoint_offload: bool = dataclasses.field(
        default=False,
        metadata={"help": "Keep the input each checkpointed decoder layer saves for backward "
                  "in pinned host memory, not on the GPU: frees layers x tokens per rank x "
                  "hidden x 2 bytes of GPU memory (the long-sequence limit), costs a copy of "
                  "them to the host and back each step. Needs activation checkpointing (the "
                  "recipes' default); any optimizer, with or without DeepSpeed and "
                  "--sequence_parallel_size. The same offload as transformers' own "
                  "--activation_checkpointing_kwargs '{\"offload\": true}' (transformers 5.17 "
                  "and later; --gradient_checkpointing_kwargs before its rename), which the "
                  "memory plan counts alike; not both at once. Not TRL's "
                  "--activation_offloading, which moves every saved activation."},
    )  # fmt: skip
    dataset_name: str | None = dataclasses.field(
        default=None, metadata={"help": "Hub dataset id (load_dataset); needs network or cache."}
    )
    dataset_path: str | None = dataclasses.field(
        default=None,
        metadata={"help": "A local data file (.jsonl/.json/.csv/.parquet) in TRL's format; it "
                  "takes the place of dataset_name, so a recipe's Hub dataset can be swapped "
                  "for a local file on the command line. With neither: the bundled arithmetic "
                  "data (examples/data/arithmetic_{sft,dpo}.jsonl's rows)."},
    )  # fmt: skip
    dataset_split: str = dataclasses.field(default="train", metadata={"help": "split to train on"})
    optimizer: str = dataclasses.field(
        default="superoffload",
        metadata={"help": "superoffload: fp32 master and Adam state on the CPU, stepped during "
                  "backward; adamw: TRL's trainer with the Trainer's own AdamW, to compare.",
                  "choices": ["superoffload", "adamw"]},
    )  # fmt: skip
    loss_plot: bool = dataclasses.field(
        default=True, metadata={"help": "save the training loss curve as output_dir/loss.png"}
    )
    save_model: bool = dataclasses.field(
        default=True,
        metadata={"help": "save the trained model to output_dir at the end; false for "
                  "throughput and memory runs (trainer_state.json and the summary are "
                  "written either way, checkpoints follow --save_strategy)"},
    )  # fmt: skip
    require_loss_decrease: bool = dataclasses.field(
        default=True,
        metadata={
            "help": "exit non-zero when the mean of the last quarter of the logged losses "
            "is not below the first"
        },
    )

    @property
    def demo(self) -> bool:
        return self.model_name_or_path is None and self.random_init_from_config is None


# transformers 5.x renamed gradient_checkpointing to activation_checkpointing and warns on the
# old name, which TRL sets (to True) by default; versions before the rename (5.17 among them)
# lack the new name. Recipes say the new one; the parser reads either on any version.
CHECKPOINTING_NAMES = ("activation_checkpointing", "gradient_checkpointing")


def checkpointing_name(config_cls) -> str:
    """The name this transformers gives activation checkpointing in ``config_cls``."""
    names = {f.name for f in dataclasses.fields(config_cls)}
    return next(n for n in CHECKPOINTING_NAMES if n in names)


def _no_checkpointing(config_cls) -> dict:
    return {checkpointing_name(config_cls): False}


class RecipeParser(TrlParser):
    """TRL's parser that takes either checkpointing name from a recipe YAML, so one recipe runs
    on transformers before and after the rename."""

    def __init__(self, dataclass_types, config_cls, **kwargs):
        super().__init__(dataclass_types, **kwargs)
        self._checkpointing = checkpointing_name(config_cls)

    def set_defaults_with_config(self, **kwargs) -> list[str]:
        for name in CHECKPOINTING_NAMES:
            if name != self._checkpointing and name in kwargs:
                kwargs.setdefault(self._checkpointing, kwargs.pop(name))
        return super().set_defaults_with_config(**kwargs)


def demo_defaults(kind: str) -> dict:
    """Training arguments of the demo, chosen for a 0.1M-param random model on 2 CPU cores or
    one GPU (each can still be overridden)."""
    cuda = torch.cuda.is_available()
    defaults = {
        "output_dir": f"outputs/{kind}-tiny-llama",
        "max_steps": 50 if kind == "sft" else 30,
        "per_device_train_batch_size": 32 if kind == "sft" else 16,
        "learning_rate": 3e-3,
        "lr_scheduler_type": "cosine",
        "warmup_steps": 0.1,  # below 1: a fraction of max_steps
        "seed": 0,
        # TRL turns bf16 on everywhere; on a CPU that means slow bf16 autocast.
        "bf16": cuda and torch.cuda.is_bf16_supported(),
        "dataloader_pin_memory": cuda,  # pinning on a CPU only warns
        "max_length": 64,  # the longest arithmetic row is 14 tokens with <bos> and <eos>
        "logging_steps": 1,  # every step's loss, so the first one is the untrained model's
        "save_strategy": "no",  # the final model is saved by the script
        "report_to": "none",
        "dataloader_num_workers": 0,
        "optim": "adamw_torch",  # the --optimizer adamw comparison uses torch's own AdamW
        **_no_checkpointing(KINDS[kind]),  # a model this small needs no memory saving
    }
    return defaults


# The demo's bucket on the standalone engine: one default bucket would hold the whole model;
# small ones exercise the pipeline. Under DeepSpeed (an accelerate config or --deepspeed) the
# partition is the config's sub_group_size, and the argument is refused there. It stands in for
# the engine's default only: --superoffload_bucket_size, then HF_SUPEROFFLOAD_BUCKET_SIZE, win.
DEMO_BUCKET_SIZE = 1 << 14
BUCKET_SIZE_ENV = "HF_SUPEROFFLOAD_BUCKET_SIZE"


def build_parser(kind: str, prog: str | None = None) -> TrlParser:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {sorted(KINDS)}, got {kind!r}")
    # No abbreviations: among hundreds of options a prefix is ambiguous, and the script's own
    # arguments are parsed alone first, where "--optim" would pass for "--optimizer".
    config_cls = KINDS[kind]
    return RecipeParser((RecipeArguments, config_cls), config_cls, allow_abbrev=False, prog=prog)


def parse(kind: str, argv: list[str] | None = None, prog: str | None = None):
    """(RecipeArguments, SuperOffloadSFTConfig or SuperOffloadDPOConfig) from ``argv``
    (``--config recipe.yaml`` and overrides); the demo's defaults when no model is named."""
    parser = build_parser(kind, prog)
    # The script's own arguments first: whether this is the demo decides the defaults (and a
    # config built with TRL's defaults fails on a CPU: bf16).
    script_only = TrlParser(RecipeArguments, allow_abbrev=False, add_help=False)  # --help: all
    recipe, _ = script_only.parse_args_and_config(argv, return_remaining_strings=True)
    if recipe.demo:
        parser.set_defaults_with_config(**demo_defaults(kind))
    recipe, args = parser.parse_args_and_config(argv)
    check_optimizer_arguments(recipe, args)
    ours = recipe.optimizer == "superoffload"
    unset = args.superoffload_bucket_size is None and env.read(BUCKET_SIZE_ENV) is None
    if ours and recipe.demo and unset and not _on_deepspeed(args):
        args.superoffload_bucket_size = DEMO_BUCKET_SIZE
    return recipe, args


def superoffload_arguments_given(args) -> list[str]:
    """The ``superoffload_*`` arguments set on the command line or in the recipe YAML (all of
    them default to None: unset, the environment or the engine's default decides)."""
    names = [f.name for f in dataclasses.fields(SuperOffloadArgumentsMixin)]
    return [name for name in names if getattr(args, name) is not None]


def check_optimizer_arguments(recipe: RecipeArguments, args) -> None:
    """``--optimizer adamw`` runs TRL's own trainer, which reads no ``superoffload_*``
    argument: given with it, they would be dropped without a word."""
    given = superoffload_arguments_given(args)
    if recipe.optimizer == "adamw" and given:
        flags = ", ".join(f"--{name}" for name in given)
        raise ValueError(
            f"--optimizer adamw runs TRL's own trainer with the Trainer's AdamW, which does not "
            f"read {flags}: drop them (from the command line or the recipe YAML), or use "
            f'--optimizer superoffload. (Under a DeepSpeed config with "super_offload" its '
            f"ZeRO-3 optimizer is hf_superoffload's either way; HF_SUPEROFFLOAD_* variables tune "
            f"it there.)"
        )
