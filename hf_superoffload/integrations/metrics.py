"""Training metrics for the logs: tokens/s, model TFLOPS, MFU and the STV counters.

Model FLOPs per token follow the PaLM appendix: 6 N for the weight matmuls forward and backward
(N = trainable params less the input embedding, whose lookup does no matmul) plus
12 x layers x hidden x sequence length for the attention scores and values; recomputation by
activation checkpointing is not counted. MFU divides achieved model FLOP/s per GPU by the GPU's
dense bf16 peak: ``HF_SUPEROFFLOAD_PEAK_TFLOPS`` when set (any GPU, or a CPU), else the table below
(GH200, H100 SXM/PCIe/NVL, H200 SXM/NVL, B200, GB200, A100). Without either, ``mfu`` is left
out of the logs and a message says once how to set the peak.

Models the formula does not describe (no ``config`` with ``num_hidden_layers`` and
``hidden_size``: a plain ``nn.Module``, say) still get ``tokens_per_second``; ``tflops`` and
``mfu`` are then left out of the logs, and why is logged once at INFO.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import torch

from .. import env

logger = logging.getLogger("hf_superoffload")

# Dense (no sparsity) bf16 tensor-core peaks per GPU, TFLOP/s, from NVIDIA's datasheets, which
# list BF16 "with sparsity" (twice the dense rate); halved here:
# - H100 datasheet (nvidia.com/en-us/data-center/h100): SXM 1,979 -> 989; PCIe 1,513 -> 756;
#   NVL 1,671 -> 835.
# - H200 datasheet (nvidia.com/en-us/data-center/h200): SXM 1,979 -> 989; NVL 1,671 -> 835.
# - GH200 Grace Hopper Superchip datasheet: the Hopper GPU's 1,979 -> 989.
# - HGX B200: 36 PFLOPS (sparse) FP16/BF16 for 8 GPUs -> 2,250 dense per GPU.
# - GB200 NVL72: 360 PFLOPS (sparse) FP16/BF16 for 72 GPUs -> 2,500 dense per GPU.
# - A100 datasheet: 312 dense (624 sparse).
# The names are matched as substrings of torch.cuda.get_device_name() in this order, so the
# more specific ones come first ("GH200" holds "H200", "GB200" holds "B200").
PEAK_BF16_TFLOPS = {
    "GH200": 989.0,
    "GB200": 2500.0,
    "B200": 2250.0,
    "H200 NVL": 835.0,
    "H200": 989.0,  # SXM
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.0,  # SXM / HBM3 ("NVIDIA H100 80GB HBM3")
    "A100": 312.0,
}
PEAK_ENV = "HF_SUPEROFFLOAD_PEAK_TFLOPS"
STV_KEYS = (
    "speculative_steps",
    "rollbacks_clip",
    "rollbacks_nonfinite",
    "speculations_applied",
    "speculations_withheld",
    "replays",
    "exposed_cpu_seconds",
    "replay_seconds",
)


def peak_tflops(device_name: str | None = None) -> float | None:
    """The bf16 dense peak of the GPU (or the override); None when unknown (e.g. on CPU)."""
    override = env.read(PEAK_ENV)
    if override:
        try:
            value = float(override)
        except ValueError:
            raise ValueError(f"{PEAK_ENV} must be a number of TFLOP/s, got {override!r}.") from None
        if value <= 0:
            raise ValueError(f"{PEAK_ENV} must be > 0, got {value}.")
        return value
    if device_name is None:
        if not torch.cuda.is_available():
            return None
        device_name = torch.cuda.get_device_name()
    for key, value in PEAK_BF16_TFLOPS.items():  # most specific names first
        if key in device_name:
            return value
    return None


def log_missing_peak(device_name: str | None = None) -> None:
    """Say why ``mfu`` is missing from the logs and how to get it: at WARNING for a GPU the
    table does not know, at INFO without a GPU (MFU is a GPU figure)."""
    if device_name is None and torch.cuda.is_available():
        device_name = torch.cuda.get_device_name()
    if device_name is None:
        logger.info(
            "hf_superoffload: mfu is not reported: no GPU, so no peak to divide by. Set %s to "
            "a peak in TFLOP/s to log mfu against it.",
            PEAK_ENV,
        )
        return
    logger.warning(
        "hf_superoffload: mfu is not reported: the dense bf16 peak of %r is not in the table "
        "(%s). Set %s to that GPU's dense bf16 TFLOP/s (its datasheet's 'with sparsity' figure "
        "halved) to log mfu.",
        device_name,
        ", ".join(PEAK_BF16_TFLOPS),
        PEAK_ENV,
    )


def matmul_params(model: torch.nn.Module) -> int:
    """Trainable params that take part in a token's matmuls: all but the input embedding's
    lookup table (a tied lm_head shares that weight and does a matmul, so then it counts), and
    of a mixture of experts' expert params (``.experts.`` in their names, as transformers names
    them) only the share a token is routed to, ``num_experts_per_tok`` of the experts. A model
    without ``get_input_embeddings`` counts all its trainable params; a ZeRO-3 partitioned
    param counts its full size (``ds_numel``)."""
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        embeddings = None
    skip = {id(p) for p in embeddings.parameters()} if embeddings is not None else set()
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        skip = set()
    active = _active_expert_share(model)
    total = 0.0
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in skip:
            share = active if ".experts." in f".{name}." else 1.0
            total += share * getattr(p, "ds_numel", p.numel())
    return round(total)


def _active_expert_share(model: torch.nn.Module) -> float:
    """The share of a mixture of experts' expert params one token passes through (1.0 for a
    dense model)."""
    config, _ = flops_config(model)
    experts = getattr(config, "num_local_experts", 0) or getattr(config, "num_experts", 0) or 0
    top_k = getattr(config, "num_experts_per_tok", 0) or 0
    return top_k / experts if experts and top_k else 1.0


def sequence_parallel_size(parallelism_config) -> int:
    """Ranks that share each sequence under DeepSpeed's Ulysses, from accelerate's
    ``ParallelismConfig`` (1 without one, or without sequence parallelism)."""
    pc = parallelism_config
    if pc is not None and pc.sp_backend == "deepspeed" and pc.sp_enabled:
        return pc.sp_size
    return 1


def model_flops_per_token(config, n_matmul_params: int, seq_len: int) -> float:
    return 6.0 * n_matmul_params + 12.0 * config.num_hidden_layers * config.hidden_size * seq_len


def flops_config(model: torch.nn.Module):
    """``(config, None)`` with the config the FLOPs formula reads (a multimodal model's text
    config), or ``(None, reason)`` when the model does not describe its layers."""
    config = getattr(model, "config", None)
    if config is None:
        return None, f"{type(model).__name__} has no `config`"
    get_text_config = getattr(config, "get_text_config", None)
    if callable(get_text_config):
        config = get_text_config()
    missing = [
        name
        for name in ("num_hidden_layers", "hidden_size")
        if not isinstance(getattr(config, name, None), int)
    ]
    if missing:
        return None, f"its config ({type(config).__name__}) has no {' or '.join(missing)}"
    return config, None


class ThroughputMeter:
    """Tokens and sequence lengths seen since the last log, and the time they took."""

    def __init__(self):
        self._n_params: int | None = None  # counted once: a walk over every param
        self._config = None
        self._no_flops: str | None = None  # why FLOPs are not counted, once known
        self._told_no_peak = False  # the "mfu is not reported" message is logged once
        self.reset()

    def reset(self) -> None:
        self.tokens = 0
        self.flops = 0.0
        self.since = time.perf_counter()

    def add_batch(self, inputs, model: torch.nn.Module, sequence_parallel: int = 1) -> None:
        """Count a micro batch. Under Ulysses sequence parallelism (``sequence_parallel`` ranks
        share each sequence) ``inputs`` is this rank's shard: its tokens are this rank's, but
        each of them attends to the whole sequence, ``sequence_parallel`` shards long."""
        ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else None
        if not isinstance(ids, torch.Tensor):
            return
        mask = inputs.get("attention_mask")
        tokens = int(mask.sum()) if isinstance(mask, torch.Tensor) else ids.numel()
        self.tokens += tokens
        if self._n_params is None and self._no_flops is None:
            self._config, self._no_flops = flops_config(model)
            if self._no_flops is None:
                self._n_params = matmul_params(model)
            else:
                logger.info(
                    "hf_superoffload: logging tokens_per_second without tflops and mfu: "
                    "%s, so its FLOPs per token are unknown.",
                    self._no_flops,
                )
        if self._n_params is not None:
            seq_len = ids.shape[-1] * sequence_parallel
            self.flops += tokens * model_flops_per_token(self._config, self._n_params, seq_len)

    def metrics(self, accelerator, peak: float | None) -> dict[str, float]:
        """Reduce over ranks (tokens and FLOPs summed; per-GPU figures divide by the ranks).
        ``tflops`` and ``mfu`` only when the model's FLOPs per token are known."""
        elapsed = max(time.perf_counter() - self.since, 1e-9)
        totals = torch.tensor([float(self.tokens), self.flops], device=accelerator.device)
        totals = accelerator.reduce(totals, reduction="sum")
        tokens, flops = totals.tolist()
        out = {"tokens_per_second": tokens / elapsed}
        if self._no_flops is None:  # the same on every rank: one model
            tflops = flops / elapsed / accelerator.num_processes / 1e12
            out["tflops"] = tflops
            if peak is not None:
                out["mfu"] = tflops / peak
            elif not self._told_no_peak:
                log_missing_peak()
                self._told_no_peak = True
        self.reset()
        return out


def all_ranks_stats(stats: dict[str, float], accelerator) -> dict[str, float]:
    """``stats`` with the ``STV_KEYS`` counters as the logs report them (``stv_metrics``): each
    the largest over the ranks. A rank's own counts differ from another's where a partition
    speculated on one rank and was withheld on another."""
    reduced = stv_metrics(stats, accelerator)
    return {**stats, **{key: reduced[f"stv/{key}"] for key in STV_KEYS}}


def stv_metrics(stats: dict[str, float], accelerator) -> dict[str, float]:
    """The optimizer's counters under ``stv/``; ranks agree on the step verdicts, the timings
    are the slowest rank's."""
    values = torch.tensor([float(stats[k]) for k in STV_KEYS], device=accelerator.device)
    if accelerator.num_processes > 1:
        values = accelerator.gather(values[None]).amax(dim=0)
    return {f"stv/{key}": value for key, value in zip(STV_KEYS, values.tolist(), strict=True)}
