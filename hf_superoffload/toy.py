"""Tiny, download-free models, tokenizers and helpers for the example, the tests and benchmarks.

Everything here is built in memory from code, with no file and no Hugging Face Hub access, so
the example job and CI run on a machine without network. The pieces are real Hugging Face
objects (a ``PreTrainedTokenizerFast`` and a ``LlamaForCausalLM``), so they exercise the same
``Trainer`` / TRL ``SFTTrainer`` code paths as a downloaded checkpoint, only small:

- :func:`make_char_tokenizer`: a character-level tokenizer over printable ASCII with
  ``<pad>``/``<bos>``/``<eos>``/``<unk>``, role tokens and a chat template, so TRL accepts plain
  text, prompt/completion and conversational ("messages") data alike.
- :func:`tiny_llama_config` / :func:`build_tiny_llama`: a Llama-architecture model with seeded
  random weights (0.14 M parameters at the defaults).
"""

from __future__ import annotations

import string

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0, 1, 2, 3
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
# Printable ASCII without the vertical tab and form feed that `string.printable` also holds.
CHARS = "".join(c for c in string.printable if c not in "\x0b\x0c")

# Each message is `<|role|>content<eos>`; the whole conversation starts with `<bos>` (the chat
# template adds it, so `apply_chat_template` is tokenized without the post-processor's `<bos>`).
# The `{% generation %}` markers let TRL's `assistant_only_loss=True` mask everything but the
# assistant turns (including their `<eos>`, so the model learns to stop).
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|' + message['role'] + '|>' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + eos_token }}{% endgeneration %}"
    "{%- else %}"
    "{{- message['content'] + eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- endif %}"
)


def make_char_tokenizer(model_max_length: int = 512) -> PreTrainedTokenizerFast:
    """A deterministic character-level tokenizer (vocabulary of 105 tokens).

    Ids: ``<pad>``=0, ``<bos>``=1, ``<eos>``=2, ``<unk>``=3, then the three role tokens, then one id
    per printable ASCII character (``" "`` to ``"~"``, tab, newline, carriage return, in
    ``string.printable`` order). Any other character maps to ``<unk>``. Encoding text prepends
    ``<bos>`` but no ``<eos>`` (TRL appends ``<eos>`` to the text or completion itself, and a
    prompt must tokenize to a prefix of prompt + completion); decoding concatenates characters.
    """
    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *ROLE_TOKENS, *CHARS))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # One pre-token per character; `[\s\S]` also matches newlines, which `.` would not.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    # Register the multi-character tokens so they are matched whole before the per-character split
    # (they already are in the vocabulary, so their ids do not change).
    backend.add_special_tokens(
        [AddedToken(t, special=True) for t in (*SPECIAL_TOKENS, *ROLE_TOKENS)]
    )
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        additional_special_tokens=list(ROLE_TOKENS),
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        padding_side="right",
    )


def tiny_llama_config(
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 512,
    **kwargs,
) -> LlamaConfig:
    """A small ``LlamaConfig``; the special-token ids match :func:`make_char_tokenizer`.

    ``intermediate_size`` defaults to ``4 * hidden_size`` and ``num_kv_heads`` to ``num_heads``
    (no grouped-query attention). Extra keyword arguments go to ``LlamaConfig``.
    """
    kwargs.setdefault("pad_token_id", SPECIAL_TOKENS.index(PAD))
    kwargs.setdefault("bos_token_id", SPECIAL_TOKENS.index(BOS))
    kwargs.setdefault("eos_token_id", SPECIAL_TOKENS.index(EOS))
    kwargs.setdefault("tie_word_embeddings", False)
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads or num_heads,
        max_position_embeddings=max_position_embeddings,
        **kwargs,
    )


def build_tiny_llama(
    config: LlamaConfig | None = None, *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> LlamaForCausalLM:
    """A ``LlamaForCausalLM`` with random weights drawn from ``seed`` (same seed, same weights).

    ``config`` defaults to :func:`tiny_llama_config` sized for :func:`make_char_tokenizer`. The
    global torch RNG is left as it was.
    """
    if config is None:
        config = tiny_llama_config(vocab_size=len(make_char_tokenizer()))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(dtype=dtype)
