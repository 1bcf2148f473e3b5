"""The training systems compared by the benchmarks, one class each, same model and recipe:
AdamW (lr 1e-5, no weight decay), clip ``--clip``, bf16 compute, activation checkpointing.

- no_offload: fp32 params, bf16 autocast, fused AdamW on the GPU, clip_grad_norm_ (what the
  HF Trainer does without offload; fp32 master and both moments on the GPU); DDP on N GPUs.
- superoffload: bf16 params on the GPU, fp32 master and moments on the CPU (this package); on N
  GPUs its replicas (every rank holds and steps all of the host state).
- deepspeed_zero_offload: DeepSpeed ZeRO-3 with offload_optimizer cpu (DeepSpeedCPUAdam).
- deepspeed_zero3: DeepSpeed ZeRO-3 without offload (torch's AdamW on the GPU, state sharded
  over the ranks): what ZeRO-3's own communication leaves of one GPU's speed on several.
- superoffload_zero3: the same with offload_optimizer.super_offload: true, built as this
  package's SuperOffloadZero3Optimizer (``import hf_superoffload`` rebinds DeepSpeed's class).
- superoffload_zero3_compact: superoffload_zero3 with compact moments
  (HF_SUPEROFFLOAD_MOMENTS=compact: both Adam moments in 8 bits a value).
- deepspeed_superoffload: the same config again, run with HF_SUPEROFFLOAD_DEEPSPEED=0, so
  DeepSpeed builds its own SuperOffloadOptimizer_Stage3.

The DeepSpeed systems share one config (bf16, clip, AdamW, DeepSpeed's default
sub_group_size; ``BENCH_ZERO_EXTRA``, a JSON object, adds or overrides ``zero_optimization``
keys, e.g. ``{"stage3_param_persistence_threshold": 1000000000}``), deepspeed_zero3 without
its offload_optimizer; each checks after deepspeed.initialize which ZeRO optimizer class the
engine built and refuses to run on another (``EXPECTED_OPTIMIZER``). ``run_environment`` is what
train_step.py sets in os.environ before anything imports hf_superoffload or DeepSpeed: the
system's ``environment`` and, for the systems that read it from there, ``--cast``.
- torchao_offload: torchao's CPUOffloadOptimizer over bf16 params (bf16 optimizer state on the
  CPU and no fp32 master: cheaper, but not the same numerics).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import ClassVar

import torch
import transformers

LR = 1e-5
OPT_OUT_ENV = "HF_SUPEROFFLOAD_DEEPSPEED"  # hf_superoffload/zero3/activation.py
DEEPSPEED_STAGE3 = "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3"
DEEPSPEED_SUPEROFFLOAD = (
    "deepspeed.runtime.superoffload.superoffload_stage3.SuperOffloadOptimizer_Stage3"
)
OURS_ZERO3 = "hf_superoffload.zero3.optimizer.SuperOffloadZero3Optimizer"
CAST_ENV = "HF_SUPEROFFLOAD_CAST"  # what the ZeRO-3 optimizer resolves its cast from
DEFAULT_CAST = "auto"
logger = logging.getLogger("benchmarks")


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _model(config: transformers.PretrainedConfig, dtype: torch.dtype) -> torch.nn.Module:
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model


class TrainingSystem:
    """One training step in three phases (benchmarks/phases.py times each)."""

    # SuperOffload's cast (--cast: where bf16 <-> fp32 casts run): whether the system has one,
    # and whether it reads it from HF_SUPEROFFLOAD_CAST rather than from args.cast.
    has_cast: ClassVar[bool] = False
    cast_from_environment: ClassVar[bool] = False

    def forward(self, batch) -> torch.Tensor:
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def optimizer_step(self) -> None:
        raise NotImplementedError

    def step(self, batch) -> None:
        self.backward(self.forward(batch))
        self.optimizer_step()

    def finish(self):
        return None

    def grad_norm(self) -> float:
        """The pre-clip global gradient norm of the last step."""
        raise NotImplementedError


class NoOffload(TrainingSystem):
    def __init__(self, config, args):
        self.model = _model(config, torch.float32)
        self.params = list(self.model.parameters())
        if torch.distributed.is_initialized():  # under torchrun: plain data parallelism
            self.model = torch.nn.parallel.DistributedDataParallel(self.model)
        self.optimizer = torch.optim.AdamW(self.params, lr=LR, weight_decay=0.0, fused=True)
        self.clip = args.clip

    def forward(self, batch):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return self.model(input_ids=batch, labels=batch).loss

    def optimizer_step(self):
        if self.clip:  # no extra norm pass when the recipe does not clip
            self.norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def grad_norm(self):
        return float(self.norm) if self.clip else float("nan")


class SuperOffload(TrainingSystem):
    has_cast = True

    def __init__(self, config, args):
        from hf_superoffload import SuperOffloadOptimizer

        self.model = _model(config, torch.bfloat16)
        buckets = args.gpu_buckets if args.gpu_buckets == "auto" else int(args.gpu_buckets)
        self.optimizer = SuperOffloadOptimizer(
            self.model.parameters(), lr=LR, weight_decay=0.0, max_grad_norm=args.clip,
            model=self.model, gpu_tail=buckets, bucket_size=args.bucket_size, cast=args.cast,
            gpu_tail_cap=getattr(args, "gpu_memory_cap", None),  # timeline.py has none
        )  # fmt: skip

    def forward(self, batch):
        return self.model(input_ids=batch, labels=batch).loss

    def optimizer_step(self):
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def grad_norm(self):
        return float(self.optimizer.global_grad_norm)

    def still_tuning(self) -> bool:
        """gpu_tail='auto' may still move buckets (each move synchronizes everything)."""
        return bool(self.optimizer.stats["tail_tuning"])

    def finish(self):
        self.optimizer.synchronize()
        stats = self.optimizer.stats
        self.optimizer.close()
        return stats


ZERO_EXTRA_ENV = "BENCH_ZERO_EXTRA"


def zero_extra() -> dict:
    """The ``zero_optimization`` keys ``BENCH_ZERO_EXTRA`` adds (a JSON object; none unset)."""
    text = os.environ.get(ZERO_EXTRA_ENV, "").strip()
    if not text:
        return {}
    try:
        extra = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{ZERO_EXTRA_ENV} is not JSON ({error}): {text!r}") from None
    if not isinstance(extra, dict):
        raise ValueError(
            f"{ZERO_EXTRA_ENV} must be a JSON object of zero_optimization keys, got {text!r}"
        )
    return extra


class DeepSpeedZeroOffload(TrainingSystem):
    super_offload = False
    offloads = True  # the optimizer state on the host (offload_optimizer cpu)
    environment: ClassVar[dict[str, str]] = {}
    expected_optimizer = DEEPSPEED_STAGE3

    def __init__(self, config, args):
        if self.expected_optimizer == OURS_ZERO3:
            import hf_superoffload  # noqa: F401  (before deepspeed.initialize: the rebinding)
        import deepspeed

        for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29511"), ("RANK", "0"),
                           ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):  # fmt: skip
            os.environ.setdefault(key, value)
        deepspeed.init_distributed()
        began = time.perf_counter()
        model = _model(config, torch.bfloat16)
        if int(os.environ["RANK"]) == 0:  # where a large model's start-up spends its time
            logger.info("model built on the GPU in %.1f s", time.perf_counter() - began)
        self.engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=self.deepspeed_config(args)
        )
        self.optimizer_name = qualified_name(type(self.engine.optimizer))
        if int(os.environ["RANK"]) == 0:
            logger.info(
                "deepspeed.initialize done %.1f s after the model began",
                time.perf_counter() - began,
            )
        logger.info(
            "%s=%s: the engine's ZeRO optimizer is %s (base optimizer %s)",
            OPT_OUT_ENV, os.environ.get(OPT_OUT_ENV), self.optimizer_name,
            qualified_name(type(getattr(self.engine.optimizer, "optimizer", None))),
        )  # fmt: skip
        if self.optimizer_name != self.expected_optimizer:
            raise RuntimeError(
                f"optimizer mismatch: {type(self).__name__} expects {self.expected_optimizer}, "
                f"DeepSpeed built {self.optimizer_name} ({OPT_OUT_ENV}="
                f"{os.environ.get(OPT_OUT_ENV)!r})"
            )

    def forward(self, batch):
        return self.engine(input_ids=batch, labels=batch).loss

    @classmethod
    def deepspeed_config(cls, args) -> dict:
        """The config deepspeed.initialize gets: the systems' shared one (module docstring)."""
        offload = {"device": "cpu", "pin_memory": True, "ratio": args.ratio}
        if cls.super_offload:
            offload["super_offload"] = True
        adamw = {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
        if not cls.offloads:  # torch's AdamW: DeepSpeed's FusedAdam would need a CUDA build
            adamw["torch_adam"] = True
        return {
            "train_micro_batch_size_per_gpu": args.batch,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": args.clip,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": adamw},
            "zero_optimization": {
                "stage": 3,
                **({"offload_optimizer": offload} if cls.offloads else {}),
                "overlap_comm": True,
                "contiguous_gradients": True,
                **zero_extra(),
            },
            "steps_per_print": 10**9,
        }

    def backward(self, loss):
        self.engine.backward(loss)

    def optimizer_step(self):
        self.engine.step()

    def grad_norm(self):
        return float(self.engine.get_global_grad_norm())


class DeepSpeedZero3(DeepSpeedZeroOffload):
    offloads = False


class SuperOffloadZero3(DeepSpeedZeroOffload):
    super_offload = True
    environment: ClassVar[dict[str, str]] = {OPT_OUT_ENV: "1"}
    expected_optimizer = OURS_ZERO3
    has_cast = cast_from_environment = True  # DeepSpeed builds the optimizer: no argument

    def finish(self):
        return self.engine.optimizer.stats

    def host_bytes(self):
        return self.engine.optimizer.host_bytes()


class SuperOffloadZero3Compact(SuperOffloadZero3):
    environment: ClassVar[dict[str, str]] = {OPT_OUT_ENV: "1", "HF_SUPEROFFLOAD_MOMENTS": "compact"}


class DeepSpeedSuperOffload(DeepSpeedZeroOffload):
    super_offload = True
    environment: ClassVar[dict[str, str]] = {OPT_OUT_ENV: "0"}
    expected_optimizer = DEEPSPEED_SUPEROFFLOAD


class TorchaoOffload(TrainingSystem):
    def __init__(self, config, args):
        from torchao.optim import CPUOffloadOptimizer

        self.model = _model(config, torch.bfloat16)
        self.params = list(self.model.parameters())
        self.optimizer = CPUOffloadOptimizer(
            self.params, torch.optim.AdamW, offload_gradients=False, fused=True, lr=LR,
            weight_decay=0.0,
        )  # fmt: skip
        self.clip = args.clip

    def forward(self, batch):
        return self.model(input_ids=batch, labels=batch).loss

    def optimizer_step(self):
        if self.clip:  # no extra norm pass when the recipe does not clip
            self.norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad()

    def grad_norm(self):
        return float(self.norm) if self.clip else float("nan")


def run_environment(system: str, cast: str) -> dict[str, str]:
    """The variables to set before hf_superoffload or DeepSpeed is imported to run ``system``
    with ``cast`` (--cast): the system's own, and HF_SUPEROFFLOAD_CAST where the system reads
    its cast from there. Refused: a cast other than auto for a system that has none (it would
    change nothing), and HF_SUPEROFFLOAD_CAST already set to another cast than --cast."""
    cls = SYSTEMS[system]
    if cast != DEFAULT_CAST and not cls.has_cast:
        with_cast = sorted(name for name, other in SYSTEMS.items() if other.has_cast)
        raise ValueError(
            f"--cast {cast}: {system} has no cast to set (it is SuperOffload's choice of where "
            f"bf16 <-> fp32 casts run); run {system} without --cast, or choose one of "
            f"{with_cast}"
        )
    environment = dict(getattr(cls, "environment", {}))
    if not cls.has_cast:
        return environment
    given = os.environ.get(CAST_ENV)
    if given is not None and given != cast:
        raise ValueError(
            f"{CAST_ENV}={given} is set and --cast is {cast}: the benchmark takes the cast from "
            f"--cast (and sets {CAST_ENV} for the ZeRO-3 systems); unset {CAST_ENV} and pass "
            f"--cast {given}"
        )
    if cls.cast_from_environment:
        environment[CAST_ENV] = cast
    return environment


SYSTEMS = {
    "no_offload": NoOffload,
    "superoffload": SuperOffload,
    "deepspeed_zero_offload": DeepSpeedZeroOffload,
    "deepspeed_zero3": DeepSpeedZero3,
    "superoffload_zero3": SuperOffloadZero3,
    "superoffload_zero3_compact": SuperOffloadZero3Compact,
    "deepspeed_superoffload": DeepSpeedSuperOffload,
    "torchao_offload": TorchaoOffload,
}
