"""SuperOffloadOptions: the engine's own options, resolved like accelerate's plugin dataclasses.

Each field is resolved as explicit argument > ``HF_SUPEROFFLOAD_<FIELD>`` environment variable >
default, so a shell or a launcher's environment can set them without code changes. Learning
rate, betas, eps, weight decay, clipping and accumulation are not here: they come from the
training arguments (or the optimizer's own arguments), the single source of truth.

NOTE: these are options of ``SuperOffloadOptimizer``, not an Accelerate plugin. ``Accelerator``
builds no optimizer and has no extension point for one: it refuses unknown keywords, and a
``KwargsHandler`` subclass it does not know fails its ``kwargs_handlers`` lookup. So the options
go to the optimizer (``SuperOffloadOptimizer(..., **options.optimizer_kwargs())``) or to the
SuperOffload trainers. The environment variables are declared in ``hf_superoffload/env.py``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from .. import env
from ..engine.checks import CASTS, DEFAULT_BUCKET_SIZE, check_moments, check_speculation

ENV_PREFIX = env.PREFIX
_CASTS = CASTS  # the planner's too (cli/plan.py)
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclasses.dataclass
class SuperOffloadOptions:
    gpu_tail: int | str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "The GPU tail: buckets (the first layers) whose optimizer state stays on the "
            "GPU, an int, or 'auto' to size it from free GPU memory and the measured wait for "
            "the CPU. "
            "Env HF_SUPEROFFLOAD_GPU_TAIL; default 'auto'."
        },
    )
    bucket_size: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "Elements per gradient bucket (the unit of transfer and of speculation). "
            "Env HF_SUPEROFFLOAD_BUCKET_SIZE; default 2**25."
        },
    )
    cpu_threads: int | None = dataclasses.field(
        default=None,
        metadata={
            "help": "Threads of the CPU Adam. Env HF_SUPEROFFLOAD_CPU_THREADS; default: this rank's "
            "share of the host's cores, less one for the thread feeding the GPU."
        },
    )
    speculate: bool | None = dataclasses.field(
        default=None,
        metadata={
            "help": "Start each bucket's CPU Adam step during backward and validate it after "
            "(speculation-then-validation). Env HF_SUPEROFFLOAD_SPECULATE; default true."
        },
    )
    speculate_after_clip: bool | None = dataclasses.field(
        default=None,
        metadata={
            "help": "Also speculate right after a clipped step (with its clip coefficient); off "
            "by default since then a replay likely follows. Env HF_SUPEROFFLOAD_SPECULATE_AFTER_CLIP."
        },
    )
    cast: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "Where to cast between bf16 and fp32: 'auto' (16-bit gradients, fp32 "
            "params), 'gpu' (fp32 both ways) or 'cpu' (16-bit both ways; with its copy-out "
            "ring it measured 1.629 s/step against auto's 1.589 on one H100, 3.4B params, "
            "every step clipping, so auto keeps fp32 params). On ZeRO-3 it sets the params' "
            "direction only (docs/options.md). Env HF_SUPEROFFLOAD_CAST; default 'auto'."
        },
    )
    moments: str | None = dataclasses.field(
        default=None,
        metadata={
            "help": "Adam's two moments in 'fp32' (AdamW's, exact) or 'compact' (8 bits a value "
            "over per-block scales: 2 B a param in place of 8, host state 8 B a param with bf16 "
            "gradients). Env HF_SUPEROFFLOAD_MOMENTS; default 'fp32'."
        },
    )
    gpu_tail_cap: float | None = dataclasses.field(
        default=None,
        metadata={
            "help": "Most GPU memory (GiB) the optimizer's GPU tail may hold; 'auto' never "
            "grows past it and gives buckets back to stay under it. Env "
            "HF_SUPEROFFLOAD_GPU_TAIL_CAP; default: no cap."
        },
    )

    def __post_init__(self):
        env.check()
        if self.gpu_tail is None:
            self.gpu_tail = _env("GPU_TAIL", "auto")
        if isinstance(self.gpu_tail, str) and self.gpu_tail != "auto":
            self.gpu_tail = _int("gpu_tail", self.gpu_tail, minimum=0)
        elif isinstance(self.gpu_tail, int) and not isinstance(self.gpu_tail, bool):
            _int("gpu_tail", self.gpu_tail, minimum=0)
        elif self.gpu_tail != "auto":
            raise ValueError(
                f"gpu_tail must be a non-negative int or 'auto', got {self.gpu_tail!r}."
            )
        if self.bucket_size is None:
            self.bucket_size = _env("BUCKET_SIZE", DEFAULT_BUCKET_SIZE)
        self.bucket_size = _int("bucket_size", self.bucket_size, minimum=1)
        threads = self.cpu_threads if self.cpu_threads is not None else _env("CPU_THREADS", None)
        self.cpu_threads = None if threads is None else _int("cpu_threads", threads, minimum=1)
        self.speculate = _bool("speculate", self.speculate, True)
        self.speculate_after_clip = _bool("speculate_after_clip", self.speculate_after_clip, False)
        check_speculation(self.speculate, self.speculate_after_clip)
        if self.cast is None:
            self.cast = _env("CAST", "auto")
        if self.cast not in CASTS:
            raise ValueError(
                f"cast must be one of {CASTS}, got {self.cast!r} (env {ENV_PREFIX}CAST)."
            )
        if self.moments is None:
            self.moments = _env("MOMENTS", "fp32")
        check_moments(self.moments, f" (env {ENV_PREFIX}MOMENTS)")
        cap = self.gpu_tail_cap if self.gpu_tail_cap is not None else _env("GPU_TAIL_CAP", None)
        self.gpu_tail_cap = None if cap is None else _gib("gpu_tail_cap", cap)

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> SuperOffloadOptions:
        """Build from a mapping, refusing keys that are not fields (a typo must not be ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ValueError(
                f"unknown SuperOffload options {unknown}; valid ones are {sorted(names)}."
            )
        return cls(**options)

    def optimizer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``SuperOffloadOptimizer``, one per field."""
        return dataclasses.asdict(self)


def _env(name: str, default: Any) -> Any:
    value = env.read(ENV_PREFIX + name)
    return default if value is None else value


def _int(name: str, value: Any, minimum: int) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"{name} must be an int, got {value!r} (env {ENV_PREFIX}{name.upper()})."
        ) from None
    if isinstance(value, bool) or number < minimum or str(number) != str(value).strip():
        raise ValueError(
            f"{name} must be an int >= {minimum}, got {value!r} "
            f"(argument or env {ENV_PREFIX}{name.upper()})."
        )
    return number


def _gib(name: str, value: Any) -> float:
    """A size in GiB: a number >= 0 (0 keeps no optimizer state on the GPU)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = None
    if isinstance(value, bool) or number is None or not math.isfinite(number) or number < 0:
        raise ValueError(
            f"{name} must be a number of GiB >= 0 (e.g. 40 or 12.5), got {value!r} "
            f"(argument or env {ENV_PREFIX}{name.upper()}); leave it unset for no cap."
        )
    return number


def _bool(name: str, value: bool | None, default: bool) -> bool:
    if value is not None:
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}.")
        return value
    raw = env.read(ENV_PREFIX + name.upper())
    if raw is None:
        return default
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise ValueError(f"env {ENV_PREFIX}{name.upper()} must be true/false (or 1/0), got {raw!r}.")
