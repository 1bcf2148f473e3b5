"""Checks of what SuperOffloadOptimizer is given, with errors that say what to change. The
constructor runs them in this order: ``check_arguments`` (its keyword arguments), then
``resolve_options`` (the engine options left out, from HF_SUPEROFFLOAD_* variables or the
defaults), torch's Optimizer then takes the params into groups (of ``group_defaults``), and
``checked_trainable`` (the groups and what they hold); ``common_device_and_dtype`` once the
params are claimed.
"""

from __future__ import annotations

import difflib
import logging
import numbers
from collections.abc import Iterable, Mapping

import torch

from .adamw_switches import check_switches
from .core_split import choose_team

HYPER_KEYS = ("lr", "betas", "eps", "weight_decay")
DEFAULT_BUCKET_SIZE = 1 << 25  # 33.5M elements: ~7 ms of CPU Adam on 16 cores
CASTS = ("auto", "gpu", "cpu")

logger = logging.getLogger("hf_superoffload")

FP16_WARNING = (
    "hf_superoffload: the params are float16 and SuperOffloadOptimizer has no loss scaler: "
    "gradients above 65504 become inf and skip the step (counted and logged), and gradients "
    "below 6e-8 flush to zero without a word. Train in bf16 (model.to(torch.bfloat16)), or "
    "scale the loss yourself and divide the gradients back before step()."
)


def _is_number(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.is_complex()
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _require_number(name: str, value, example: str) -> None:
    if not _is_number(value):
        raise ValueError(
            f"{name} must be a number, got {value!r} ({type(value).__name__}); pass e.g. "
            f"{name}={example}."
        )


# Options renamed before 0.1.0 (the GPU tail's); refused, naming the new one, because
# difflib would point gpu_buckets at bucket_size.
RENAMED_OPTIONS = {"gpu_buckets": "gpu_tail", "gpu_memory_cap": "gpu_tail_cap"}


def refuse_unknown_kwargs(kwargs: Mapping, known_names: Iterable[str], owner: str) -> None:
    """A TypeError for the first keyword argument of ``kwargs`` not in ``known_names``, as
    Python's own for an unexpected keyword, with the closest known name when one is near
    (``gpu_tial=3`` -> ``gpu_tail``), the new name of a renamed option (``gpu_buckets``), and
    the known names otherwise."""
    known = sorted(known_names)
    for name in kwargs:
        if name in known:
            continue
        if RENAMED_OPTIONS.get(name) in known:
            raise TypeError(
                f"{owner}() got an unexpected keyword argument {name!r}; it is now "
                f"{RENAMED_OPTIONS[name]!r}."
            )
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}?" if close else f"it takes {', '.join(known)}."
        raise TypeError(f"{owner}() got an unexpected keyword argument {name!r}; {hint}")


def check_arguments(
    unknown: Mapping,
    keywords: Iterable[str],
    max_grad_norm,
    gradient_accumulation_steps,
    options: dict,
    switches: dict,
) -> None:
    """SuperOffloadOptimizer's keyword arguments, before torch's Optimizer takes the params: no
    unknown one (``keywords``: the known names; ``gpu_bucket=3`` is told the closest), the
    types of the engine ``options`` given (None: left out, ``resolve_options`` fills it in),
    and the values that need no params (the others are checked where they are used), the
    moments, and torch.optim.AdamW's ``switches`` (no-op values accepted, others refused:
    adamw_switches.py)."""
    refuse_unknown_kwargs(unknown, keywords, "SuperOffloadOptimizer")
    cpu_threads = options["cpu_threads"]
    if cpu_threads is not None and (
        isinstance(cpu_threads, bool) or not isinstance(cpu_threads, int) or cpu_threads < 1
    ):
        raise ValueError(
            f"cpu_threads (threads of the CPU Adam) must be a positive int, got {cpu_threads!r}; "
            f"pass e.g. cpu_threads=8, or None for this rank's share of the host's cores less one."
        )
    if max_grad_norm is not None:
        _require_number("max_grad_norm", max_grad_norm, "1.0 (0 or None: no clipping)")
    for name, value, example in (
        ("gradient_accumulation_steps", gradient_accumulation_steps, "4"),
        ("bucket_size", options["bucket_size"], "2**25"),
    ):
        if value is None and name == "bucket_size":
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(
                f"{name} must be an int, got {value!r} ({type(value).__name__}); pass e.g. "
                f"{name}={example}."
            )
    if options["bucket_size"] is not None and options["bucket_size"] < 1:
        raise ValueError(
            f"bucket_size must be a positive number of elements, got {options['bucket_size']}."
        )
    for name in ("speculate", "speculate_after_clip"):
        if options[name] is not None and not isinstance(options[name], bool):
            raise ValueError(f"{name} must be True or False, got {options[name]!r}.")
    _check_given_placement(options["gpu_tail"], options["gpu_tail_cap"], options["cast"])
    if options["moments"] is not None:
        check_moments(options["moments"])
    check_switches(switches)


def _check_given_placement(gpu_tail, gpu_tail_cap, cast) -> None:
    """The keywords' types only: a string that reads as a number is a variable's form (and
    ``resolve_options`` takes it there), not a keyword's."""
    if gpu_tail is not None and (
        isinstance(gpu_tail, bool) or not (gpu_tail == "auto" or isinstance(gpu_tail, int))
    ):
        raise ValueError(f"gpu_tail must be a non-negative int or 'auto', got {gpu_tail!r}.")
    if gpu_tail_cap is not None and (
        isinstance(gpu_tail_cap, bool) or not isinstance(gpu_tail_cap, numbers.Real)
    ):
        raise ValueError(
            f"gpu_tail_cap must be a number of GiB >= 0 or None (no cap), got {gpu_tail_cap!r}."
        )
    if cast is not None and cast not in CASTS:
        raise ValueError(f"cast must be 'auto', 'gpu' or 'cpu', got {cast!r}.")


def resolve_options(given: dict):
    """The engine options of a SuperOffloadOptimizer built directly, as the trainers resolve
    theirs (SuperOffloadOptions, integrations/plugin.py): a keyword given, else its
    ``HF_SUPEROFFLOAD_<OPTION>`` variable, else the default; a bad variable, or a pair of
    options that would do nothing together, is refused with the trainers' error. Keywords
    passed by ``check_arguments`` stay as given."""
    # Imported here: plugin.py imports this module (check_moments, check_speculation).
    from ..integrations.plugin import SuperOffloadOptions

    return SuperOffloadOptions(**given)


def check_speculation(speculate: bool, speculate_after_clip: bool) -> None:
    """``speculate_after_clip`` turns speculation on for the step after a clipped one; with
    ``speculate`` off no step speculates, so the pair would be accepted and do nothing."""
    if speculate_after_clip and not speculate:
        raise ValueError(
            "speculate_after_clip=True has no effect with speculate=False: no step speculates, "
            "after a clipped step or any other. Drop speculate_after_clip (or unset "
            "HF_SUPEROFFLOAD_SPECULATE_AFTER_CLIP), or leave speculate on."
        )


def group_defaults(lr, betas, eps, weight_decay) -> dict:
    """The param groups' defaults; betas that are no pair (``betas=0.9``, say) are kept as
    given, for ``check_group`` to refuse with what to pass."""
    pair = tuple(betas) if isinstance(betas, (tuple, list)) else betas
    return {"lr": lr, "betas": pair, "eps": eps, "weight_decay": weight_decay}


def checked_trainable(
    groups: list[dict], max_grad_norm, gradient_accumulation_steps
) -> list[torch.nn.Parameter]:
    """Once torch's Optimizer has built the param groups: the option values, no param listed
    twice, each group's keys and hyperparameters. Returns the params that require grad (the
    ones the optimizer steps), refusing a run with none."""
    check_option_values(max_grad_norm, gradient_accumulation_steps)
    check_no_duplicates(groups)
    for group in groups:
        check_group(group)
    trainable = [p for g in groups for p in g["params"] if p.requires_grad]
    if not trainable:
        raise ValueError("SuperOffloadOptimizer got no parameters that require grad.")
    return trainable


def check_option_values(max_grad_norm, gradient_accumulation_steps) -> None:
    """Values the constructor's types (check_arguments) allow but the engine cannot use."""
    if max_grad_norm is not None and max_grad_norm < 0:
        raise ValueError(
            f"max_grad_norm must be >= 0 (0 or None: no clipping), got {max_grad_norm}."
        )
    if gradient_accumulation_steps < 1:
        raise ValueError(
            f"gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}."
        )


MOMENTS = ("fp32", "compact")


def check_moments(moments, where: str = "") -> bool:
    """Whether the moments are compact (``moments="compact"``); anything but the two names is
    refused (``where``: where the value came from, for the message)."""
    if moments not in MOMENTS:
        raise ValueError(
            f"moments must be 'fp32' (AdamW's moments, exact; the default) or 'compact' (both "
            f"moments in 8 bits a value: 2 B a param instead of 8), got {moments!r}{where}."
        )
    return moments == "compact"


def check_no_duplicates(groups: list[dict]) -> None:
    """A param listed twice in one group (torch warns, and will raise; across groups it raises)
    would get two master copies here, each stepped with half of its gradients."""
    for g, group in enumerate(groups):
        seen: set[int] = set()
        for param in group["params"]:
            if id(param) in seen:
                raise ValueError(
                    f"param group {g} lists a param (shape {tuple(param.shape)}) twice; list each "
                    f"param once (e.g. pass model.parameters(), which yields tied weights once)."
                )
            seen.add(id(param))


def check_dense_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    if grad.is_sparse or grad.layout != torch.strided:
        raise RuntimeError(
            f"SuperOffloadOptimizer got a sparse gradient (layout {grad.layout}) for a param of "
            f"shape {tuple(param.shape)}: it steps dense gradients only, like torch's AdamW. Build "
            f"the embedding with sparse=False (nn.Embedding's default), or train that param with "
            f"torch.optim.SparseAdam and leave it out of this optimizer (freeze it here)."
        )


def check_group(group: dict) -> None:
    # param_names: torch 2.x's names of the group's params (given as named_parameters() or
    # as the key itself); kept, and carried in state_dict(), as torch's optimizers do.
    unknown = set(group) - {"params", *HYPER_KEYS, "initial_lr", "name", "param_names"}
    if unknown:
        raise ValueError(
            f"unknown param-group keys {sorted(unknown)}; SuperOffloadOptimizer groups take "
            f"{list(HYPER_KEYS)}."
        )
    examples = {"lr": "1e-3", "eps": "1e-8", "weight_decay": "0.01"}
    for key in ("lr", "eps", "weight_decay"):
        _require_number(key, group[key], examples[key])
        if float(group[key]) < 0:
            raise ValueError(f"{key} must be >= 0, got {float(group[key])}.")
    betas = group["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(map(_is_number, betas))):
        raise ValueError(
            f"betas must be a pair of numbers, got {betas!r}; pass e.g. betas=(0.9, 0.999)."
        )
    beta1, beta2 = betas
    if not (0 < beta1 < 1 and 0 < beta2 < 1):
        raise ValueError(
            f"betas must be in (0, 1) (a zero beta cannot be rolled back), got {group['betas']}."
        )
    if group["lr"] * group["weight_decay"] >= 1:
        raise ValueError(
            f"lr * weight_decay must be < 1 (got {group['lr']} * {group['weight_decay']}): the "
            f"decay factor 1 - lr * weight_decay must stay positive for a speculated step to be "
            f"undone. Lower lr or weight_decay."
        )


def common_device_and_dtype(params: list[torch.nn.Parameter]) -> tuple[torch.device, torch.dtype]:
    device, dtype = params[0].device, params[0].dtype
    for param in params:
        if param.device != device:
            raise ValueError(
                f"all trainable params must be on one device; found {device} and {param.device}. "
                f"Move the model with model.to(device) before building the optimizer."
            )
        if param.dtype != dtype:
            raise ValueError(
                f"all trainable params must share one dtype; found {dtype} and {param.dtype}. "
                f"Cast the model (e.g. model.to(torch.bfloat16)) first."
            )
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"params must be float32, bfloat16 or float16, got {dtype}. Cast the model (e.g. "
            f"model.to(torch.float32)); complex params are not supported: train those with "
            f"torch.optim.AdamW."
        )
    if device.type not in ("cuda", "cpu"):
        raise ValueError(
            f"params must be on a CUDA device or the CPU, got {device}. Move the model there "
            f"(model.to('cuda')); meta params must be materialised first (load the weights)."
        )
    if dtype == torch.float16:
        logger.warning(FP16_WARNING)
    return device, dtype


def check_params_attached(buckets: list) -> None:
    """The model's params still view the buckets' flat buffers (``Bucket.first_param_ptr``)."""
    moved = [b for b in buckets if b.plan.params[0].data_ptr() != b.first_param_ptr]
    if moved:
        raise RuntimeError(
            f"the model's parameters no longer live in SuperOffloadOptimizer's buffers "
            f"({len(moved)} of {len(buckets)} buckets): something copied them after "
            f"the optimizer was built (model.to(...), a wrapper); the updates would never "
            f"reach the model. Move or wrap the model first, then build the optimizer."
        )


def cores_of_this_rank() -> int:
    """The CPUs this rank counts as its own: its share of the host (core_split.py), or, where
    the host is not split (``HF_SUPEROFFLOAD_CPU_CORES=off``, no local rank known), this
    process's CPUs divided by the ranks of the host."""
    return choose_team(torch.device("cpu")).share


def default_cpu_threads(device: torch.device) -> int:
    """The CPU Adam's threads when none are asked for: the rank's share of the host less the
    training thread's core (on the CPU device, less torch's intra-op threads instead)."""
    return choose_team(device).threads
