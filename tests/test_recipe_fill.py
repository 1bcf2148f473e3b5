"""A full-size run with random weights on the bundled rows (the launcher's throughput and
memory checks) gets one row of at least max_length tokens per sequence of the run, so every
step is full; a smoke run and a run on other data train on their data as it is."""

from __future__ import annotations

import json

import pytest
import transformers
from datasets import Dataset

from hf_superoffload.recipes import arithmetic
from hf_superoffload.recipes.data import fill_sequences
from hf_superoffload.recipes.run import train
from hf_superoffload.toy import make_char_tokenizer

COMMON = [
    "--per_device_train_batch_size", "2", "--logging_steps", "1", "--save_strategy", "no",
    "--save_model", "false", "--loss_plot", "false", "--require_loss_decrease", "false",
    "--report_to", "none", "--bf16", "false",
]  # fmt: skip


class Recipe:
    random_init_from_config = "llama-3.1-8b"
    shrink_model = False


def _args(**kw):
    values = dict(output_dir="/tmp/unused", per_device_train_batch_size=4, max_steps=3,
                  gradient_accumulation_steps=2, packing=False, max_length=256, report_to="none", bf16=False)  # fmt: skip
    values.update(kw)
    from trl import SFTConfig

    return SFTConfig(**values)


def test_each_sequence_of_the_run_gets_a_full_row():
    tokenizer = make_char_tokenizer()
    rows = Dataset.from_list(arithmetic.make_sft_rows())
    filled = fill_sequences(rows, Recipe, _args(), tokenizer)
    assert len(filled) == 4 * 2 * 3  # batch x accumulation x steps, one rank
    lengths = [len(ids) for ids in tokenizer(list(filled["text"]))["input_ids"]]
    assert min(lengths) >= 256
    assert len(set(filled["text"])) == len(filled)  # not one row repeated


def test_packing_is_refused_and_smoke_runs_and_other_data_are_left_alone():
    tokenizer = make_char_tokenizer()
    rows = Dataset.from_list(arithmetic.make_sft_rows())
    with pytest.raises(ValueError, match="drop --packing"):
        fill_sequences(rows, Recipe, _args(packing=True), tokenizer)

    class Smoke(Recipe):
        shrink_model = True

    assert fill_sequences(rows, Smoke, _args(), tokenizer) is rows
    chats = Dataset.from_list([{"messages": [{"role": "user", "content": "hi"}]}])
    assert fill_sequences(chats, Recipe, _args(), tokenizer) is chats


def test_a_random_weights_recipe_run_trains_full_sequences(tmp_path, monkeypatch):
    """The recipe end to end (a tiny Llama config file stands in for a shipped one)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        vocab_size=len(make_char_tokenizer()), max_position_embeddings=128,
    )  # fmt: skip
    config.save_pretrained(tmp_path / "cfg")
    out = tmp_path / "out"
    train("sft", [*COMMON, "--random_init_from_config", str(tmp_path / "cfg"),
                  "--max_length", "96", "--max_steps", "3", "--output_dir", str(out)])  # fmt: skip
    lines = [json.loads(x) for x in (out / "log_history.jsonl").read_text().splitlines()]
    seen = [r["num_tokens"] for r in lines if "num_tokens" in r]
    assert [b - a for a, b in zip([0.0, *seen], seen, strict=False)] == [2 * 96] * 3


@pytest.mark.parametrize("sp_size, sequences", [(1, 4 * 4), (2, 4 * 2), (4, 4 * 1)])
def test_ranks_that_share_a_sequence_get_one_row_for_it(capsys, monkeypatch, sp_size, sequences):
    """Four ranks: data parallel, every rank trains batch 4 of its own sequences; under
    Ulysses (sequence_parallel_size 2 or 4) the ranks of one group split the same sequences,
    so a step takes 4 x 4 / sp_size of them, as the Trainer's total batch counts."""
    from hf_superoffload.recipes import sequence_parallel

    args = _args(max_steps=1, gradient_accumulation_steps=1)
    monkeypatch.setattr(type(args), "world_size", property(lambda self: 4))
    monkeypatch.setenv("WORLD_SIZE", "4")
    if sp_size > 1:
        sequence_parallel.configure(sp_size, args, "sdpa")
    tokenizer = make_char_tokenizer()
    rows = Dataset.from_list(arithmetic.make_sft_rows())
    filled = fill_sequences(rows, Recipe, args, tokenizer)
    assert len(filled) == sequences
    assert f"random weights: {sequences} rows of at least 256 tokens" in capsys.readouterr().out
