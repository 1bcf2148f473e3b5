"""GPU bytes the loss holds per rank: a batch's logits with their fp32 copies, or a fused loss's
chunks (Liger-Kernel's fused linear cross-entropy, TRL's fused LM head).

The full logits' figures follow the tensors each loss allocates (transformers 5.24, torch 2.13),
at the larger of its forward's and its backward's peaks; the logits come out of the LM head in
the weights' dtype (``Zero3Run.dtype_bytes``), the caller drops them before backward (the
Trainer's ``compute_loss`` returns the loss alone), and tests/test_loss_memory.py measures them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .memory_plan import Zero3Run
    from .model_shape import ModelShape

# The model's own loss (transformers' ForCausalLMLoss) holds at its backward's peak the fp32
# log-softmax that cross-entropy saves, the fp32 gradient nll_loss's backward makes and
# log_softmax's backward's fp32 gradient: 12 bytes a logit whatever the logits' dtype, as its
# forward holds less (bf16: the logits, their fp32 upcast and the log-softmax, 10 bytes; fp32:
# the upcast is the logits themselves, 8).
LOGIT_BYTES = 12

# Fused losses, which never hold a batch's logits (``Zero3Run.fused_cross_entropy``):
# - "liger": Liger-Kernel's fused linear cross-entropy (the Trainer's use_liger_kernel), for
#   the model types Liger 0.8.5 patches (MODEL_TYPE_TO_APPLY_LIGER_FN in its
#   transformers/monkey_patch.py; the architectures of hf_superoffload/model_configs among them).
# - "trl": TRL's fused LM head, which TRL's SFTTrainer and DPOTrainer (1.16) put on every model
#   (trl/trainer/utils.py add_fused_lm_head), refusing Liger's in its place.
FUSED_CROSS_ENTROPY = ("liger", "trl")
LIGER_MODEL_TYPES = frozenset(
    {"llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "phi3", "gpt_oss", "gemma",
     "gemma2", "gemma3_text", "glm4", "olmo2", "granite", "smollm3", "deepseek_v3"}
)  # fmt: skip
# liger_kernel/ops/fused_linear_cross_entropy.py (0.8.5): _CHUNK_MEM_CONST, the logits a chunk
# may hold in units of the hidden states (tokens x hidden).
LIGER_CHUNK_MEM_CONST = 1
# trl/kernels/chunked_logprob.py (1.16): TOKEN_CHUNK_SIZE rows by _CHUNKED_LOGPROB_CHUNK_SIZE
# (trl/trainer/utils.py) vocabulary columns a tile.
TRL_TOKEN_CHUNK, TRL_VOCAB_CHUNK = 4096, 32768


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def liger_loss_bytes(tokens: int, hidden: int, vocab: int, low: int) -> int:
    """GPU bytes of Liger 0.8.5's fused linear cross-entropy (fused_linear_cross_entropy_forward)
    over ``tokens`` hidden states: it cuts them into chunks whose logits hold about
    LIGER_CHUNK_MEM_CONST x tokens x hidden elements (chunk = the next power of 2 of
    tokens / ceil(vocab / (C x hidden)), at most tokens), computes the gradients in the forward
    and holds them until backward: the hidden states' and the head weight's, in the model's
    dtype, and an fp32 loss a token."""
    factor = math.ceil(vocab / (LIGER_CHUNK_MEM_CONST * hidden))
    chunk = min(tokens, _next_power_of_2(math.ceil(tokens / factor)))
    return low * (chunk * vocab + tokens * hidden + vocab * hidden) + 4 * tokens


def trl_loss_bytes(tokens: int, hidden: int, vocab: int, low: int) -> int:
    """GPU bytes of TRL 1.16's fused LM head (ChunkedLogProbFunction) at its backward's peak:
    fp32 gradients of the hidden states and of the head weight, their casts to the model's
    dtype beside them as it returns, and one TRL_TOKEN_CHUNK x TRL_VOCAB_CHUNK tile. It scores
    only tokens with a label; ``tokens`` counts all (the bound)."""
    tile = low * min(tokens, TRL_TOKEN_CHUNK) * min(vocab, TRL_VOCAB_CHUNK)
    return (4 + low) * (tokens + vocab) * hidden + tile


def model_loss_bytes(tokens: int, vocab: int) -> int:
    """GPU bytes of the model's own loss over ``tokens`` x ``vocab`` logits: its backward's
    peak (``LOGIT_BYTES``), above its forward's in either dtype."""
    return LOGIT_BYTES * tokens * vocab


def label_smoothing_bytes(tokens: int, rows: int, vocab: int, low: int) -> int:
    """GPU bytes of transformers' LabelSmoother (``shift_labels=True``, as TRL's SFTTrainer
    1.16 calls it with ``label_smoothing_factor``) over the logits of ``tokens`` tokens in
    ``rows`` rows, in ``low`` bytes a value, which it never upcasts. Its forward holds the
    logits, their shifted copy (one position fewer a row), its log-softmax and that negated;
    its backward the saved log-softmax, the negation (gather's backward keeps its input),
    gather's zero gradient and its scatter, and where the logits are not fp32 the gradient of
    the fp32 sum cast to their dtype."""
    logits, shifted = tokens * vocab, (tokens - rows) * vocab
    forward = low * logits + 3 * low * shifted
    backward = (4 + (1 if low < 4 else 0)) * low * shifted
    return max(forward, backward)


def loss_bytes(config, shape: ModelShape, run: Zero3Run, tokens: int) -> int:
    """GPU bytes the loss holds: the batch's logits and what the loss derives from them
    (the model's own loss, or label smoothing's), or a fused loss's."""
    fused = run.fused_cross_entropy
    if run.label_smoothing and fused is not None:
        raise ValueError(
            f"label_smoothing computes the loss from the batch's full logits, not through a "
            f"fused loss: plan it with fused_cross_entropy None, not {fused!r}"
        )
    if run.label_smoothing:
        return label_smoothing_bytes(tokens, run.batch, shape.vocab, run.dtype_bytes)
    if fused is None:
        return model_loss_bytes(tokens, shape.vocab)
    if fused not in FUSED_CROSS_ENTROPY:
        raise ValueError(
            f"fused_cross_entropy must be None (the model's own loss) or one of "
            f"{', '.join(FUSED_CROSS_ENTROPY)}, got {fused!r}"
        )
    if fused == "trl":
        return trl_loss_bytes(tokens, shape.hidden, shape.vocab, run.dtype_bytes)
    model_type = getattr(config, "model_type", None)
    if model_type not in LIGER_MODEL_TYPES:
        raise ValueError(
            f"fused_cross_entropy 'liger': Liger-Kernel 0.8.5 does not patch {model_type!r} "
            f"models ({', '.join(sorted(LIGER_MODEL_TYPES))} among those it does); plan with "
            f"the model's own loss (None), or with TRL's fused head ('trl') for TRL's trainers"
        )
    return liger_loss_bytes(tokens, shape.hidden, shape.vocab, run.dtype_bytes)
