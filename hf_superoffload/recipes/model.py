"""The model and tokenizer a recipe trains: a pretrained checkpoint, random weights from an
architecture's ``config.json`` (``--random_init_from_config``), or the demo's tiny Llama.

Nothing is downloaded for random weights: the config is a local file or one shipped in
``hf_superoffload/model_configs``, and the tokenizer is the character tokenizer of
``hf_superoffload.toy`` unless one is named. ``shrink_config`` keeps an architecture (MoE
routing, attention layout, norms) but makes it small enough to train in seconds on a CPU.
"""

from __future__ import annotations

import copy

import torch
import transformers

from ..cli import model_source
from ..cli.errors import UsageError
from ..toy import build_tiny_llama, make_char_tokenizer, tiny_llama_config

# The shrunken shape: small, but with every structural feature kept (grouped-query attention,
# several experts routed top-k, alternating layer types).
SHRUNK = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
          "moe_intermediate_size": 32}  # fmt: skip
MAX_EXPERTS, MAX_TOP_K = 16, 2
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts")  # GPT-OSS, Qwen3-MoE
SPECIAL_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")


def load_config(spec: str):
    """A transformers config from a config.json, a model directory or a shipped name.

    The shipped files' comment keys and a ``quantization_config`` (full fine-tuning trains the
    dequantized weights) are dropped, as ``hf-superoffload plan`` does."""
    try:
        return model_source.resolve(spec).config
    except UsageError as error:
        raise ValueError(f"--random_init_from_config: {error}") from None


def shrink_config(config):
    """A copy of ``config`` with the small shape of ``SHRUNK``: at most 16 experts and top-2,
    layer types cut to the layers kept. Keys the architecture does not have stay absent."""
    small = copy.deepcopy(config)
    for key, value in SHRUNK.items():
        if hasattr(small, key):
            setattr(small, key, value)
    for key in EXPERT_COUNT_KEYS:
        if getattr(small, key, None):
            setattr(small, key, min(getattr(small, key), MAX_EXPERTS))
    if getattr(small, "num_experts_per_tok", None):
        small.num_experts_per_tok = min(small.num_experts_per_tok, MAX_TOP_K)
    if hasattr(small, "experts_per_token"):  # GPT-OSS carries both names
        small.experts_per_token = small.num_experts_per_tok
    if isinstance(getattr(small, "layer_types", None), list):
        small.layer_types = small.layer_types[: small.num_hidden_layers]
    if getattr(small, "mlp_only_layers", None):  # Qwen3-MoE: dense layers by index
        small.mlp_only_layers = [i for i in small.mlp_only_layers if i < small.num_hidden_layers]
    return small


def fit_to_tokenizer(config, tokenizer, *, shrink_vocab: bool) -> None:
    """Make ``config`` agree with the tokenizer the model will see: its special-token ids
    (a random model has no reason to keep the checkpoint's), and with ``shrink_vocab`` its
    vocabulary size. A vocabulary smaller than the tokenizer's is refused."""
    if shrink_vocab:
        config.vocab_size = len(tokenizer)
    if config.vocab_size < len(tokenizer):
        raise ValueError(
            f"the model's vocab_size {config.vocab_size} is below the tokenizer's "
            f"{len(tokenizer)} tokens: use a tokenizer of this model (--tokenizer_name_or_path)"
        )
    for key in SPECIAL_IDS:
        setattr(config, key, getattr(tokenizer, key))


def load_tokenizer(recipe):
    if recipe.tokenizer_name_or_path:
        return transformers.AutoTokenizer.from_pretrained(recipe.tokenizer_name_or_path)
    if recipe.model_name_or_path and not recipe.random_init_from_config:
        return transformers.AutoTokenizer.from_pretrained(recipe.model_name_or_path)
    return make_char_tokenizer()


def build_model(recipe, tokenizer, seed: int):
    """The model to train, with the attention implementation asked for."""
    model = _build_model(recipe, tokenizer, seed)
    if recipe.attn_implementation:
        model.set_attn_implementation(recipe.attn_implementation)
    return model


def _build_model(recipe, tokenizer, seed: int):
    """Random weights in fp32 (the trainers cast for bf16 themselves), or the checkpoint's."""
    if recipe.shrink_model and not recipe.random_init_from_config:
        raise ValueError(
            "--shrink_model shrinks the config of --random_init_from_config (the demo is tiny "
            "already, and a pretrained checkpoint cannot be shrunk): add that, or drop "
            "--shrink_model"
        )
    if recipe.demo:  # already tiny: 0.14M params
        return build_tiny_llama(tiny_llama_config(vocab_size=len(tokenizer)), seed=seed)
    if recipe.random_init_from_config:
        config = load_config(recipe.random_init_from_config)
        if recipe.shrink_model:
            config = shrink_config(config)
        if recipe.tokenizer_name_or_path is None:  # the toy tokenizer: ids and vocab follow it
            fit_to_tokenizer(config, tokenizer, shrink_vocab=recipe.shrink_model)
        transformers.set_seed(seed)
        # NOTE: from_config builds in the config's dtype (bf16 for every shipped config); the
        # fp32 master weights must start from fp32 values, and the trainers cast for bf16.
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return transformers.AutoModelForCausalLM.from_pretrained(recipe.model_name_or_path)
