"""``hf-superoffload plan MODEL --gpus N``: does full fine-tuning of MODEL fit, part by part?

It wraps ``zero3.memory_plan`` (the ZeRO-3 path's per-rank GPU and host bytes, from the model
built on the meta device) and checks them against a hardware preset, explicit sizes or this
machine. Exit code 0: fits; 1: does not fit (the output says why and what to change); 2: bad
input.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from ..zero3.activation_memory import uncounted
from ..zero3.loss_memory import LIGER_MODEL_TYPES
from ..zero3.memory_plan import MemoryPlan, Zero3Run, zero3_memory_plan
from ..zero3.model_shape import ModelShape
from . import capacity as capacity_options
from . import model_source, plan_output, ratio_auto
from .errors import EXIT_DOES_NOT_FIT, EXIT_FITS, UsageError
from .hardware import PRESETS
from .plan_arguments import DTYPE_BYTES, add_arguments
from .plan_output import LOSSES
from .plan_settings import planned_settings

_MORE_GPUS = (2, 4, 8, 16, 32, 64)  # GPU counts tried when a run does not fit
NO_SAVE = "a run that saves nothing: examples/sft.py --save_model false with --save_strategy no"
# A model's run, the paper's examples' settings; a recipe's run takes examples/sft.py's
# defaults where the recipe gives none (script_arguments.run_defaults).
DEFAULT_SEQ, DEFAULT_BATCH = 4096, 4


def add_parser(commands) -> None:
    shipped = ", ".join(model_source.shipped_configs())
    parser = commands.add_parser(
        "plan",
        help="whether a model's full fine-tuning fits, per GPU and per host",
        description="Per-rank GPU and host memory of full fine-tuning MODEL with SuperOffload "
        "on DeepSpeed ZeRO-3 (bf16 weights unless told otherwise, fp32 master and Adam moments on the host, "
        "activation checkpointing unless told otherwise), checked against a hardware preset, "
        "given sizes, or this machine. Exit code 0: fits, 1: does not fit, 2: bad input.",
        epilog=f"Shipped model configs: {shipped}. Presets (one node each; --gpus beyond a "
        "node's GPUs means more nodes): "
        + "; ".join(f"{h.name}: {h.summary}" for h in PRESETS.values()),
    )
    add_arguments(parser)
    parser.set_defaults(run=run)


@dataclasses.dataclass(frozen=True)
class Verdict:
    plan: MemoryPlan
    gpu_memory: int
    host_memory: int  # of one host, for the ranks that share it
    reasons: list[str]

    @property
    def fits(self) -> bool:
        return not self.reasons

    # The needs MemoryPlan.shortfalls compares, in whole bytes.
    @property
    def gpu_need(self) -> int:
        return int(self.plan.gpu_need)

    @property
    def host_need(self) -> int:
        return int(self.plan.host_need)


def _check(args) -> None:
    for option, value in (
        ("--gpus", args.gpus),
        ("--seq", args.seq),
        ("--batch", args.batch),
        ("--sub-group-size", args.sub_group_size),
    ):
        if value is not None and value < 1:
            raise UsageError(f"{option} must be at least 1, got {value}")
    if args.gradient_accumulation_steps is not None and args.gradient_accumulation_steps < 1:
        raise UsageError(
            f"--gradient-accumulation-steps must be at least 1, got "
            f"{args.gradient_accumulation_steps}"
        )
    ratio_auto.check_ratio(args.ratio, "--ratio")


def _given(option, setting):
    """An option where given (not None), else the run's setting."""
    return setting if option is None else option


def _run_setting(source, value: int | None, name: str, option: str, model_default: int) -> int:
    """A recipe's sequence length or batch (its own, else the script's default), or for a
    model the plan's default. UsageError for a recipe that sets it to null (no limit)."""
    if source.recipe is None:
        return model_default
    if value is None:
        raise UsageError(
            f"recipe {source.recipe_path}: {name} is null, which the plan cannot count: give "
            f"it a number in the recipe, or plan {option} N"
        )
    return value


def _checkpointing(args, source, settings, offload: bool) -> bool:
    """Whether the planned run checkpoints activations: ``--activation-checkpointing``, else
    the recipe's, else on. UsageError for what the plan cannot count without it."""
    given = args.activation_checkpointing
    if _given(None if given is None else given == "on", settings.checkpointing):
        return True
    if offload:
        raise UsageError(
            "--activation-checkpoint-offload (or a recipe's activation_checkpoint_offload) moves "
            "the inputs activation checkpointing keeps, and the run does not checkpoint "
            "activations: plan --activation-checkpointing on, or drop the offload "
            "(--no-activation-checkpoint-offload)"
        )
    why = uncounted(source.config)
    if why:
        raise UsageError(
            f"cannot plan {source.name}: {why}. Train with activation checkpointing on (the "
            "Trainer's activation_checkpointing true) and plan --activation-checkpointing on"
        )
    return False


def _check_loss(loss: str, config) -> None:
    model_type = getattr(config, "model_type", None)
    if loss == "liger" and model_type not in LIGER_MODEL_TYPES:
        raise UsageError(
            f"--loss liger: Liger-Kernel has no fused cross-entropy for {model_type!r} models "
            f"(it patches {', '.join(sorted(LIGER_MODEL_TYPES))}); plan --loss full, or "
            "--loss trl for TRL's trainers"
        )


def _shape(config) -> ModelShape:
    try:
        return ModelShape.of(config)
    except (ValueError, TypeError, AttributeError) as error:
        raise UsageError(f"cannot plan this model from its config: {error}") from None


def _judge(config, shape: ModelShape, run: Zero3Run, capacity) -> Verdict:
    plan = zero3_memory_plan(config, run, shape)
    host_memory = capacity.host_memory_for(run.ranks_per_host)
    return Verdict(
        plan, capacity.gpu_memory, host_memory, plan.shortfalls(capacity.gpu_memory, host_memory)
    )


def _suggestions(config, shape: ModelShape, run: Zero3Run, capacity, verdict: Verdict) -> list[str]:
    """Changes that make a run fit, each checked with the plan: more GPUs; for a GPU
    shortfall also the params on the host, or a smaller micro-batch."""
    found = []
    for gpus in (g for g in _MORE_GPUS if g > run.ranks):
        per_host = capacity.ranks_per_host(gpus)
        trial = _judge(
            config, shape, dataclasses.replace(run, ranks=gpus, ranks_per_host=per_host), capacity
        )
        if trial.fits:
            found.append(f"--gpus {gpus} ({per_host} per host) fits: {plan_output.usage(trial)}")
            break
    host_short = verdict.host_need > verdict.host_memory
    if host_short and not run.compact_moments:

        def compact_at(ratio: float) -> Verdict:
            trial_run = dataclasses.replace(run, compact_moments=True, ratio=ratio)
            return _judge(config, shape, trial_run, capacity)

        ratio = ratio_auto.lowest_fitting_ratio(compact_at)
        if ratio is not None:
            found.append(
                f"--moments compact fits at --ratio {ratio}: {plan_output.usage(compact_at(ratio))} "
                "(HF_SUPEROFFLOAD_MOMENTS=compact, or --superoffload_moments compact: both Adam "
                "moments in 8 bits a value)"
            )
    if run.saves_model and host_short:
        trial = _judge(config, shape, dataclasses.replace(run, saves_model=False), capacity)
        if trial.fits:
            found.append(f"--no-save fits: {plan_output.usage(trial)} ({NO_SAVE})")
    gpu_short = verdict.gpu_need > verdict.gpu_memory
    # One change each, tried alone: (whether it applies, the change, its option, why it helps).
    single_changes = (
        (not run.offload_param, {"offload_param": True}, "--offload-param", ""),
        (
            not run.activation_checkpointing,
            {"activation_checkpointing": True},
            "--activation-checkpointing on",
            " (the Trainer's activation_checkpointing true: each layer keeps only its input)",
        ),
        (
            run.activation_checkpointing and not run.activation_checkpoint_offload,
            {"activation_checkpoint_offload": True},
            "--activation-checkpoint-offload",
            " (the recipes' --activation_checkpoint_offload true: the layer inputs wait on the "
            "host)",
        ),
        (run.ratio < 1.0, {"ratio": 1.0}, "--ratio 1.0", ""),
    )
    for applies, change, option, why in single_changes if gpu_short else ():
        if not applies:
            continue
        trial = _judge(config, shape, dataclasses.replace(run, **change), capacity)
        if trial.fits:
            found.append(f"{option} fits: {plan_output.usage(trial)}{why}")
    batch = run.batch // 2
    while gpu_short and batch >= 1:
        trial = _judge(config, shape, dataclasses.replace(run, batch=batch), capacity)
        if trial.fits:
            found.append(
                f"--batch {batch} fits: {plan_output.usage(trial)} (more gradient accumulation keeps the "
                "global batch)"
            )
            break
        batch //= 2
    return found


@dataclasses.dataclass(frozen=True)
class Answer:
    """What ``plan`` prints, as JSON and as text, and whether the run fits."""

    fits: bool
    as_json: dict
    as_text: str


def run(args: argparse.Namespace) -> int:
    found = answer(args)
    print(json.dumps(found.as_json, indent=2) if args.json else found.as_text, file=args.out)
    return EXIT_FITS if found.fits else EXIT_DOES_NOT_FIT


def answer(args: argparse.Namespace) -> Answer:
    """The plan for ``args`` (plan's options); UsageError on bad input."""
    _check(args)
    source = model_source.resolve(args.model)
    # An option wins, then the run's setting: a recipe's, else the default or variable.
    settings = planned_settings(source)
    loss = args.loss or settings.loss  # a recipe's as TRL computes it; a model's own
    _check_loss(loss, source.config)
    capacity = capacity_options.resolve(args)
    offload = _given(args.activation_checkpoint_offload, settings.activation_checkpoint_offload)
    seq = args.seq or _run_setting(source, settings.seq, "max_length", "--seq", DEFAULT_SEQ)
    batch = args.batch or _run_setting(
        source, settings.batch, "per_device_train_batch_size", "--batch", DEFAULT_BATCH
    )
    zero3_run = Zero3Run(
        seq=seq,
        batch=batch,
        ranks=args.gpus,
        ranks_per_host=capacity.ranks_per_host(args.gpus),
        ratio=1.0 if args.ratio == "auto" else float(args.ratio),
        offload_param=args.offload_param,
        gradient_accumulation=_given(
            args.gradient_accumulation_steps, settings.gradient_accumulation
        ),
        sub_group_size=args.sub_group_size,
        saves_model=_given(args.save, not settings.never_saves),
        fused_cross_entropy=LOSSES[loss][0],
        label_smoothing=LOSSES[loss][1],
        compact_moments=_given(args.moments, settings.moments) == "compact",
        activation_checkpoint_offload=offload,
        activation_checkpointing=_checkpointing(args, source, settings, offload),
        cast=_given(args.cast, settings.cast),
        dtype_bytes=DTYPE_BYTES[args.dtype] if args.dtype else settings.dtype_bytes,
        grad_accum_dtype=args.grad_accum_dtype,
    )
    shape = _shape(source.config)
    auto_notes, auto_suggestions = [], []
    if args.ratio == "auto":

        def judge(ratio: float) -> Verdict:
            run_at = dataclasses.replace(zero3_run, ratio=ratio)
            return _judge(source.config, shape, run_at, capacity)

        chosen = ratio_auto.lowest_fitting_ratio(judge)
        zero3_run = dataclasses.replace(zero3_run, ratio=1.0 if chosen is None else chosen)
        auto_notes.append(ratio_auto.explain(chosen))
        if chosen is None:
            auto_suggestions = ratio_auto.tight_fit_suggestion(judge)
        if chosen is None and zero3_run.saves_model:

            def judge_without_save(ratio: float) -> Verdict:
                run_at = dataclasses.replace(zero3_run, ratio=ratio, saves_model=False)
                return _judge(source.config, shape, run_at, capacity)

            unsaved = ratio_auto.lowest_fitting_ratio(judge_without_save)
            if unsaved is not None:
                auto_suggestions.append(f"--no-save: --ratio auto chooses {unsaved} ({NO_SAVE})")
    verdict = _judge(source.config, shape, zero3_run, capacity)
    suggestions = (
        [] if verdict.fits else _suggestions(source.config, shape, zero3_run, capacity, verdict)
    )
    suggestions += auto_suggestions
    notes = [*source.notes, *auto_notes, *plan_output.model_notes(source.config, verdict.plan)]
    if args.loss is None and settings.label_smoothing_factor:
        notes.append(
            f"label_smoothing_factor {settings.label_smoothing_factor}: TRL's SFTTrainer "
            "computes the loss from the batch's full logits (transformers' LabelSmoother), "
            "counted as --loss smoothed, and runs one more forward without gradients for its "
            "metrics"
        )
    notes += plan_output.bound_notes(verdict.plan)
    return Answer(
        verdict.fits,
        plan_output.as_json(source, capacity, verdict, suggestions, notes),
        plan_output.as_text(source, capacity, verdict, suggestions, notes),
    )
