"""Training metrics for the logs: tokens/s, model TFLOPS, MFU and the STV counters.

Model FLOPs per token follow the PaLM appendix: 6 N for the weight matmuls forward and backward
(N = matmul params, all but the input embedding, whose lookup does no matmul) plus
12 x layers x hidden x sequence length for the attention scores and values, the sequence being
the token's own: a padded row's real tokens, a packed (padding-free) batch's document
(``sequence_lengths``), under Ulysses sequence parallelism too (``sharded_attention``: each
rank counts a share, and the shares add up to the unsharded count). DPO's reference forward adds 2 N_ref plus a third of its attention term
per token. Work the loss does not need is not model FLOPs and is not counted: recomputation by
activation checkpointing, and the second forward without gradients that TRL's SFTTrainer (1.16)
runs through its fused LM head beside a loss from the full logits (label smoothing,
``compute_loss_func``), whose outputs feed only its entropy and token-accuracy logs; both show
as a lower ``mfu``. MFU divides achieved model
FLOP/s per GPU by the GPU's dense bf16 peak: ``HF_SUPEROFFLOAD_PEAK_TFLOPS`` when set (any GPU,
or a CPU), else the table below (GH200, H100 SXM/PCIe/NVL, H200 SXM/NVL, B200, GB200, A100).
Without either, ``mfu`` is left out of the logs and a message says once how to set the peak.

``tflops`` and ``mfu`` are left out of the logs, and why is logged once at INFO, where the count
would not be exact: models the formula does not describe (no ``config`` with
``num_hidden_layers`` and ``hidden_size``: a plain ``nn.Module``, say), models with frozen
matmul weights (LoRA, partial fine-tuning: their forward and input-gradient FLOPs depend on where
the trainable weights sit), padding-free batches (position ids without an attention mask) under
sequence parallelism, whose shards do not show the documents' lengths, and a plain Trainer's run
(``zero3_callback.py``) with a live reference model, whose forward it does not see.
``tokens_per_second`` is logged in every case.
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


def matmul_params(model: torch.nn.Module, trainable_only: bool = True) -> int:
    """Params that take part in a token's matmuls (the trainable ones, or all with
    ``trainable_only=False``): all but the input embedding's lookup table (a tied lm_head shares
    that weight and does a matmul, so then it counts), and of a mixture of experts' expert params
    (``.experts.`` in their names, as transformers names them) only the share a token is routed
    to, ``num_experts_per_tok`` of the experts. A model without ``get_input_embeddings`` counts
    all its params; a ZeRO-3 partitioned param counts its full size (``ds_numel``)."""
    active = _active_expert_share(model)
    total = 0.0
    for name, p in _matmul_named_params(model):
        if p.requires_grad or not trainable_only:
            share = active if ".experts." in f".{name}." else 1.0
            total += share * getattr(p, "ds_numel", p.numel())
    return round(total)


def _matmul_named_params(model: torch.nn.Module):
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        embeddings = None
    skip = {id(p) for p in embeddings.parameters()} if embeddings is not None else set()
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        skip = set()
    return [(name, p) for name, p in model.named_parameters() if id(p) not in skip]


def frozen_matmul_params(model: torch.nn.Module) -> list[str]:
    """Names of the matmul params (``matmul_params``) that do not train."""
    return [name for name, p in _matmul_named_params(model) if not p.requires_grad]


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
    """Training FLOPs of one token that attends over ``seq_len`` tokens."""
    return 6.0 * n_matmul_params + attention_flops(config, seq_len)


def attention_flops(config, seq_len: float) -> float:
    """Attention scores and values, forward and backward, of one token that attends over
    ``seq_len`` tokens (the forward is a third: 4 x layers x hidden x seq_len)."""
    return 12.0 * config.num_hidden_layers * config.hidden_size * seq_len


def sequence_lengths(inputs: Mapping, ids: torch.Tensor) -> torch.Tensor:
    """Lengths of the sequences attention runs over in a batch, as the model reads it: the
    documents of a flash-attention varlen batch (``cu_seq_lens_q``); else each row's tokens
    under a 2D ``attention_mask``; else the runs of consecutive ``position_ids`` (a padding-free
    batch: a new document starts where the positions do not go up by one, as transformers' sdpa
    and flex masks split it); else each row whole."""
    cu = inputs.get("cu_seq_lens_q")
    if isinstance(cu, torch.Tensor):
        return cu.reshape(-1).diff()
    rows = ids.reshape(-1, ids.shape[-1])
    mask = inputs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return mask.sum(dim=-1)
    positions = inputs.get("position_ids")
    if isinstance(positions, torch.Tensor) and positions.shape[-1] == rows.shape[-1]:
        positions = positions.reshape(-1, rows.shape[-1]).expand(rows.shape[0], -1)
        starts = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1) != 1
        starts[:, 0] = True  # a row starts a document
        first = starts.reshape(-1).nonzero().reshape(-1)
        return torch.diff(first, append=first.new_tensor([rows.numel()]))
    return torch.full((rows.shape[0],), rows.shape[-1])


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


def sharded_attention(inputs: Mapping, ids: torch.Tensor, sequence_parallel: int):
    """Under Ulysses sequence parallelism, where ``inputs`` is this rank's shard of each row:
    ``(attended, None)``, this rank's share of the batch's attention term, or ``(None, why)``.
    The shares of the ranks add up to what the unsharded batch counts (``sequence_lengths``):
    L x L for a sequence of L real tokens. A real token at (global) position p counts 2p + 1,
    and positions 0 .. L-1, wherever they lie, add up to L x L; the ranks' shares differ, their
    sum does not. This reads the rows of a 2D ``attention_mask`` as one sequence each, their
    real tokens at positions 0 .. L-1, as TRL's collator gives them and Ulysses's attention
    reads them. Rows with neither a mask nor positions are whole sequences, every token real."""
    mask, positions = inputs.get("attention_mask"), inputs.get("position_ids")
    has_positions = isinstance(positions, torch.Tensor) and positions.shape[-1] == ids.shape[-1]
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        if not has_positions:
            return None, (
                "a padded batch under sequence parallelism without position_ids: a rank's "
                "shard does not show where in its row its tokens are"
            )
        rows = mask.reshape(-1, ids.shape[-1])
        positions = positions.reshape(-1, ids.shape[-1]).expand(rows.shape[0], -1)
        spans = 2 * positions.double() + 1
        return float((spans * (rows != 0)).sum()), None
    if has_positions or isinstance(inputs.get("cu_seq_lens_q"), torch.Tensor):
        return None, (
            "a batch under sequence parallelism whose rows may pack several documents "
            "(position_ids without an attention_mask): each rank holds a shard of a row and "
            "does not see how long its documents are"
        )
    return float(ids.numel() * ids.shape[-1] * sequence_parallel), None


class ThroughputMeter:
    """Tokens and the FLOPs they took since the last log, and the time they took."""

    def __init__(self):
        self._n_params: int | None = None  # counted once: a walk over every param
        self._config = None
        self._reference: tuple | None = None  # (config, matmul params) of a reference model
        self._no_flops: str | None = None  # why FLOPs are not counted, once known
        self._told_no_peak = False  # the "mfu is not reported" message is logged once
        self.reset()

    def reset(self) -> None:
        self.tokens = 0
        self.flops = 0.0
        self.since = time.perf_counter()

    def add_batch(
        self,
        inputs,
        model: torch.nn.Module,
        sequence_parallel: int = 1,
        reference_model: torch.nn.Module | None = None,
    ) -> None:
        """Count a micro batch: each token's weight matmuls and its attention over its own
        sequence (``sequence_lengths``). ``reference_model`` runs a forward over the same batch
        (DPO's reference; 2 FLOPs per param and token, a third of the attention). Under Ulysses
        sequence parallelism (``sequence_parallel`` ranks share each sequence) ``inputs`` is this
        rank's shard: its tokens are this rank's, and its share of the attention term is one
        that adds up over the ranks to the unsharded batch's (``sharded_attention``)."""
        ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else None
        if not isinstance(ids, torch.Tensor):
            return
        mask = inputs.get("attention_mask")
        tokens = int(mask.sum()) if isinstance(mask, torch.Tensor) else ids.numel()
        self.tokens += tokens
        if self._n_params is None and self._no_flops is None:
            self.refuse(self._read_models(model, reference_model))
        if self._no_flops is not None:
            return
        if sequence_parallel == 1:
            lengths = sequence_lengths(inputs, ids).double()
            attended = float((lengths**2).sum())  # each token, over its own sequence
        else:
            attended, why = sharded_attention(inputs, ids, sequence_parallel)
            if why is not None:
                self.refuse(why)
                return
        self.flops += 6.0 * tokens * self._n_params + attention_flops(self._config, attended)
        if self._reference is not None:
            config, n_params = self._reference
            self.flops += 2.0 * tokens * n_params + attention_flops(config, attended) / 3

    def _read_models(self, model, reference_model) -> str | None:
        """Read what the count needs of the models; why the FLOPs are unknown if they are."""
        config, why = flops_config(model)
        if why is not None:
            return why
        frozen = frozen_matmul_params(model)
        if frozen:
            return (
                f"{len(frozen)} of its matmul weights do not train ({frozen[0]}, ...): frozen "
                f"weights still run their forward, and their input-gradient matmuls where a "
                f"trainable weight lies before them, which this count does not place"
            )
        if reference_model is not None:
            ref_config, why = flops_config(reference_model)
            if why is not None:
                return f"the reference model: {why}"
            self._reference = (ref_config, matmul_params(reference_model, trainable_only=False))
        self._config, self._n_params = config, matmul_params(model)
        return None

    def refuse(self, why: str | None) -> None:
        """Leave tflops and mfu out from now on (``why`` is not None), saying why once."""
        if why is None or self._no_flops is not None:
            return
        self._no_flops = why
        logger.info(
            "hf_superoffload: logging tokens_per_second without tflops and mfu: %s, so its "
            "FLOPs per token are unknown.",
            why,
        )

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


def reference_forward_model(trainer) -> torch.nn.Module | None:
    """The model a trainer runs a forward of beside each training forward: DPO's
    ``ref_model``, unless its log-probs were computed before training
    (``precompute_ref_log_probs``)."""
    reference = getattr(trainer, "ref_model", None)
    if reference is None or getattr(trainer.args, "precompute_ref_log_probs", False):
        return None
    return trainer.accelerator.unwrap_model(reference)


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
