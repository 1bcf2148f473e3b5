"""What a decoder keeps between forward and backward, and where it keeps it.

With activation checkpointing each layer keeps its input, the hidden states of this rank's
tokens (under Ulysses, 1/N of each sequence).

Without activation checkpoint offload every layer's input stays on the GPU until its backward.
With it (``integrations/activation_offload.py``) each input moves to pinned host memory in the
forward and comes back for its layer's recompute, so the GPU holds one at a time. Pinned memory
comes from torch's caching host allocator, which rounds every block up to a power of two and
keeps the blocks for the next step: the host holds one such block per layer.

Without checkpointing each layer keeps every tensor autograd saves for its backward
(``decoder_saved_bytes``): counted for the decoder layers whose saved tensors are derived here
and checked against what torch saves (tests/test_activation_memory.py), refused for any other.

The plan (``memory_plan.py``) and the offload's own tally of what it moved take their sizes
from here.
"""

from __future__ import annotations

import dataclasses


def layer_input_bytes(tokens: int, hidden: int, dtype_bytes: int) -> int:
    """One layer's input: ``tokens`` (batch x this rank's share of the sequence) x ``hidden``
    in the activations' dtype."""
    return tokens * hidden * dtype_bytes


def pinned_block_bytes(nbytes: int) -> int:
    """Host bytes torch's pinned allocator holds for a tensor of ``nbytes``: the next power of
    two (``CachingHostAllocator`` rounds each request so that blocks are reused by size)."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def layer_inputs_gpu_bytes(
    layers: int, tokens: int, hidden: int, dtype_bytes: int, offload: bool
) -> int:
    """GPU bytes of the layers' inputs at the start of backward: all of them, or with offload
    the one brought back for the layer being recomputed."""
    each = layer_input_bytes(tokens, hidden, dtype_bytes)
    return each if offload else layers * each


def layer_inputs_host_bytes(
    layers: int, tokens: int, hidden: int, dtype_bytes: int, offload: bool
) -> int:
    """Pinned host bytes of the offloaded layer inputs (0 without offload): a power-of-two
    block per layer, held from the first step on."""
    if not offload:
        return 0
    return layers * pinned_block_bytes(layer_input_bytes(tokens, hidden, dtype_bytes))


# The decoder layers ``decoder_saved_bytes`` counts, by model_type, and whether the attention
# normalizes q and k per head (Qwen3): transformers' Llama-style layer of RMSNorms, separate
# q/k/v projections, the rotary embedding, sdpa attention and a gated SiLU MLP.
SAVED_TENSORS_MODEL_TYPES = {"llama": False, "qwen2": False, "qwen3": True}
# Above this head dim sdpa's fused kernels (and its grouped-query attention) are off: the math
# kernel keeps the attention's probabilities, seq x seq a head.
MAX_FUSED_HEAD_DIM = 256
UNCHECKPOINTED_REMEDY = (
    "turn activation checkpointing on (activation_checkpointing true, as the recipes ship), or "
    "choose the ratio yourself instead of planning it"
)


@dataclasses.dataclass(frozen=True)
class DecoderWidths:
    """What ``decoder_saved_bytes`` reads of a model config."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    qk_norm: bool  # q and k normalized per head before the rotary embedding

    @classmethod
    def of(cls, config) -> DecoderWidths:
        """ValueError, saying what to change, for a config whose layers save tensors
        ``decoder_saved_bytes`` does not count."""
        why = uncounted(config)
        if why:
            raise ValueError(f"{why}: {UNCHECKPOINTED_REMEDY}")
        heads = config.num_attention_heads
        return cls(
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=_head_dim(config),
            qk_norm=SAVED_TENSORS_MODEL_TYPES[config.model_type],
        )


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def uncounted(config) -> str | None:
    """Why the tensors ``config``'s layers save without activation checkpointing are not
    counted here (None: they are)."""
    reason = _uncounted_layers(config)
    if reason is None:
        return None
    return (
        "without activation checkpointing every layer keeps all the tensors autograd saves for "
        f"its backward; the memory plan counts them for {', '.join(SAVED_TENSORS_MODEL_TYPES)} "
        f"decoders only, and {reason}"
    )


def _uncounted_layers(config) -> str | None:
    model_type = getattr(config, "model_type", None)
    if model_type not in SAVED_TENSORS_MODEL_TYPES:
        return f"{model_type!r} layers save other tensors"
    if getattr(config, "attention_dropout", 0.0):
        return "attention dropout keeps its masks (and leaves sdpa's fused kernels)"
    if getattr(config, "_attn_implementation", None) not in (None, "sdpa"):
        return f"the config asks for {config._attn_implementation!r} attention, not sdpa"
    if getattr(config, "use_sliding_window", False) or any(
        kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()
    ):
        return "sliding-window layers attend through a mask"
    if _head_dim(config) > MAX_FUSED_HEAD_DIM:
        return f"a head dim above {MAX_FUSED_HEAD_DIM} leaves sdpa's fused kernels"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"its MLP's {config.hidden_act!r} is not SiLU"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp slices its projections"
    return None


def rms_norm_saved_bytes(rows: int, width: int, dtype_bytes: int) -> int:
    """transformers' RMSNorm over ``rows`` vectors of ``width``: its input upcast to fp32 (the
    square and the scaling read it; in fp32 the input itself), the reciprocal root of each row
    (fp32), and the normalized values cast back (the weight's gradient reads them)."""
    return (4 + dtype_bytes) * rows * width + 4 * rows


# sdpa's CUDA kernels (flash, memory-efficient) keep their random-number seed and offset, two
# int64, for backward even without dropout (measured: 16 bytes a layer on an H100).
SDPA_CUDA_RNG_STATE_BYTES = 16


def layer_saved_bytes(
    widths: DecoderWidths, tokens: int, dtype_bytes: int, cuda: bool = True
) -> int:
    """The bytes autograd keeps for one decoder layer's backward over ``tokens`` (batch x
    sequence), activations in ``dtype_bytes``, the params not counted:

    - each of the two RMSNorms and its output (the input of the projections after it);
    - with q/k norms (Qwen3), those of the q and k heads;
    - the attention: q and k after the rotary embedding, v, sdpa's output (o_proj's input is a
      view of it) and its fp32 log-sum-exp a head and token (the rotary embedding keeps only
      its cos and sin, shared by the layers; grouped-query k and v are not repeated), and
      on CUDA (``cuda``) sdpa's random-number state;
    - the MLP: the gate and up projections' outputs, SiLU of the gate, and their product (the
      down projection's input).
    """
    low, w = dtype_bytes, widths
    q_dim, kv_dim = w.heads * w.head_dim, w.kv_heads * w.head_dim
    norm_and_output = rms_norm_saved_bytes(tokens, w.hidden, low) + low * tokens * w.hidden
    qk_norms = 0
    if w.qk_norm:
        qk_norms = rms_norm_saved_bytes(tokens * w.heads, w.head_dim, low)
        qk_norms += rms_norm_saved_bytes(tokens * w.kv_heads, w.head_dim, low)
    attention = low * tokens * (2 * q_dim + 2 * kv_dim) + 4 * tokens * w.heads
    attention += SDPA_CUDA_RNG_STATE_BYTES if cuda else 0
    mlp = 4 * low * tokens * w.intermediate
    return 2 * norm_and_output + qk_norms + attention + mlp


def decoder_saved_bytes(
    widths: DecoderWidths, batch: int, seq: int, dtype_bytes: int, cuda: bool = True
) -> int:
    """GPU bytes a decoder run without activation checkpointing keeps from forward to backward,
    the loss's logits apart (``loss_memory.py``): every layer's (``layer_saved_bytes``), the
    embedding's token ids (int64), the rotary cos and sin (one a token of the batch, at most),
    the final RMSNorm and its output, the LM head's input.

    It assumes batches without a padding mask (the recipes fill every sequence): a padded batch
    gives sdpa a mask, which takes the grouped-query k and v repeated and may save the mask."""
    tokens = batch * seq
    low = dtype_bytes
    outside_layers = (
        8 * tokens
        + 2 * low * tokens * widths.head_dim
        + rms_norm_saved_bytes(tokens, widths.hidden, low)
        + low * tokens * widths.hidden
    )
    return widths.layers * layer_saved_bytes(widths, tokens, low, cuda) + outside_layers
