"""The README's main job, `examples/sft.py`, run end to end on CPU (progress bar, loss curve,
model card whose Reproduce command parses and runs, summary), and its bundled data."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launched import ONE_PROCESS, run_launched
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_superoffload.recipes import arguments
from hf_superoffload.toy import build_tiny_llama, make_char_tokenizer

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "sft.py"
DATA_DIR = REPO / "examples" / "data"
DATA_FILE = DATA_DIR / "arithmetic_sft.jsonl"
MAX_STEPS = 20
MAX_LENGTH = 64  # examples/sft.py's SFTConfig.max_length


def _load_module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(n: int | None = None) -> list[dict[str, str]]:
    with open(DATA_FILE, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return rows if n is None else rows[:n]


def _completion_loss(model, tokenizer, rows) -> float:
    """Mean loss over the completion tokens (answer + <eos>), as SFTTrainer computes it."""
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for row in rows:
            prompt_len = len(tokenizer(row["prompt"])["input_ids"])
            ids = tokenizer(row["prompt"] + row["completion"] + tokenizer.eos_token)["input_ids"]
            labels = torch.tensor([ids])
            labels[0, :prompt_len] = -100
            out = model(input_ids=torch.tensor([ids]), labels=labels)
            n = len(ids) - prompt_len
            total += out.loss.item() * n
            count += n
    return total / count


def test_bundled_data_is_reproducible(tmp_path):
    """The committed jsonl is exactly what the generator script writes."""
    gen = _load_module(DATA_DIR / "make_arithmetic_sft.py")
    out = tmp_path / "arithmetic_sft.jsonl"
    gen.main(["--output", str(out)])
    assert out.read_bytes() == DATA_FILE.read_bytes()
    assert DATA_FILE.stat().st_size < 200_000


def test_bundled_data_fits_the_tokenizer():
    """Every row tokenizes without <unk>, within max_length, with the prompt as a prefix.

    TRL finds the completion (the only tokens in the loss) where the tokenized prompt and the
    tokenized prompt + completion diverge, so the prefix property is what makes the loss right.
    """
    tok = make_char_tokenizer()
    rows = _rows()
    prompts = {row["prompt"] for row in rows}
    assert len(prompts) == len(rows) >= 500
    for row in rows:
        prompt_ids = tok(row["prompt"])["input_ids"]
        full_ids = tok(row["prompt"] + row["completion"] + tok.eos_token)["input_ids"]
        assert full_ids[: len(prompt_ids)] == prompt_ids
        assert full_ids[0] == tok.bos_token_id and full_ids[-1] == tok.eos_token_id
        assert tok.unk_token_id not in full_ids
        assert len(full_ids) <= MAX_LENGTH
        assert tok.decode(full_ids, skip_special_tokens=True) == row["prompt"] + row["completion"]


@pytest.mark.parametrize("fmt", ["prompt_completion", "conversational", "messages"])
def test_toy_tokenizer_gives_trl_the_right_loss_mask(fmt, tmp_path):
    """SFTTrainer prepares each data format with the toy tokenizer and masks what it should.

    Plain and conversational prompt-completion: only the completion and its <eos> are labels;
    "messages" with `assistant_only_loss`: only the assistant turn (the chat template's
    `{% generation %}` block) and its <eos>.
    """
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    if fmt == "prompt_completion":
        row = {"prompt": "1+2=", "completion": "3"}
    elif fmt == "conversational":
        row = {
            "prompt": [{"role": "user", "content": "1+2"}],
            "completion": [{"role": "assistant", "content": "3"}],
        }
    else:
        row = {
            "messages": [
                {"role": "system", "content": "add"},
                {"role": "user", "content": "1+2"},
                {"role": "assistant", "content": "3"},
            ]
        }
    tok = make_char_tokenizer()
    # Newer transformers warn on TRL's default `gradient_checkpointing=True`; set the new name.
    config = SFTConfig(
        output_dir=str(tmp_path),
        assistant_only_loss=fmt == "messages",
        bf16=False,
        report_to="none",
        dataloader_pin_memory=False,
        **{arguments.checkpointing_name(SFTConfig): False},
    )
    trainer = SFTTrainer(
        model=build_tiny_llama(),
        args=config,
        train_dataset=Dataset.from_list([row] * 2),
        processing_class=tok,
    )
    example = trainer.train_dataset[0]
    assert [tok.decode([i]) for i in example["labels"] if i != -100] == ["3", tok.eos_token]


@pytest.mark.slow
def test_example_sft_learns_and_saves_a_reloadable_model(tmp_path):
    out_dir = tmp_path / "out"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env["HF_HUB_OFFLINE"] = "1"
    env["WANDB_MODE"] = "disabled"
    # One intra-op thread: this model is too small to gain from more, and on a loaded CI box
    # OpenMP's spin-waiting threads made the same run up to 30x slower (35 s instead of 1 s).
    env["OMP_NUM_THREADS"] = "1"

    def run(*args: str) -> subprocess.CompletedProcess:
        proc = run_launched([sys.executable, *args], timeout=ONE_PROCESS, env=env, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return proc

    proc = run(str(EXAMPLE), "--max-steps", str(MAX_STEPS), "--output-dir", str(out_dir))
    # The summary: loss, tokens/s, rollbacks by cause, where the optimizer state lived.
    assert re.search(r"^sft: loss [\d.]+ -> [\d.]+ over 20 steps.* tokens/s", proc.stdout, re.M)
    assert re.search(r"^rollbacks: \d+ for gradient clipping, \d+ for NaN/Inf", proc.stdout, re.M)
    assert re.search(r"^optimizer state: SuperOffloadOptimizer, host [\d.]+ MiB", proc.stdout, re.M)
    assert f"{MAX_STEPS}/{MAX_STEPS}" in proc.stderr  # the progress bar reached the end
    assert (out_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The loss went down by a real margin: the untrained model scores ln(vocab) ~ 4.65 nats per
    # answer token; learning only the format (digits, answer length, <eos>) brings it to ~2.3.
    summary = json.loads((out_dir / "sft_summary.json").read_text())
    losses = summary["losses"]
    assert summary["steps"] == MAX_STEPS and len(losses) == MAX_STEPS
    assert all(math.isfinite(x) for x in losses)
    vocab_size = len(make_char_tokenizer())
    assert abs(losses[0] - math.log(vocab_size)) < 0.3, losses[0]
    last = sum(losses[-5:]) / 5
    assert last < losses[0] - 1.5, (losses[0], last)
    # The summary agrees with what the Trainer itself recorded.
    state = json.loads((out_dir / "trainer_state.json").read_text())
    assert [log["loss"] for log in state["log_history"] if "loss" in log] == losses

    # The saved model and tokenizer reload from the directory alone and are the trained ones.
    model = AutoModelForCausalLM.from_pretrained(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    ref_tok = make_char_tokenizer()
    text = "12+7=19"
    assert tokenizer(text)["input_ids"] == ref_tok(text)["input_ids"]
    assert tokenizer.chat_template == ref_tok.chat_template

    ids = torch.tensor([tokenizer("3*4=")["input_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], vocab_size)
    assert torch.isfinite(logits).all()

    rows = _rows(64)
    trained = _completion_loss(model, tokenizer, rows)
    untrained = _completion_loss(build_tiny_llama(model.config, seed=0), tokenizer, rows)
    assert trained < untrained - 1.5, (trained, untrained)

    # The model card: TRL's, tagged, with a Reproduce command that parses to this run.
    card = (out_dir / "README.md").read_text()
    assert "- superoffload" in card and "## Reproduce" in card
    command = re.search(r"### Command\n\n```bash\n(.+)\n```", card).group(1)
    argv = shlex.split(command)
    assert argv[0] == "python" and Path(argv[1]).name == "sft.py"
    _, args = arguments.parse("sft", argv[2:])
    assert args.max_steps == MAX_STEPS and args.output_dir == str(out_dir)
    assert args.learning_rate == 3e-3  # the demo's, as the run used

    # ... and runs: the same command, cut to 2 steps into another directory, trains and writes
    # its own card.
    rerun = tmp_path / "rerun"
    overrides = ["--max_steps", "2", "--output_dir", str(rerun), "--require_loss_decrease", "false"]
    run(*argv[1:], *overrides)
    assert json.loads((rerun / "sft_summary.json").read_text())["steps"] == 2
    assert "## Reproduce" in (rerun / "README.md").read_text()
