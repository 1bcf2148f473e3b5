"""`examples/sft.py --resume_from_checkpoint DIR` resumes: the recipe runner hands the argument to
`Trainer.train` (which does not read it from its TrainingArguments), and the resumed run ends
where an uninterrupted one does, loss by loss and tensor by tensor."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from hf_superoffload.recipes.run import train

COMMON = [
    "--max_steps", "4", "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", "2",
    "--loss_plot", "false", "--require_loss_decrease", "false", "--report_to", "none",
]  # fmt: skip


def _losses(log_history: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in log_history if "loss" in r}


def test_resume_from_checkpoint_continues_the_run_exactly(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    whole = tmp_path / "whole"
    resumed = tmp_path / "resumed"
    first = train("sft", [*COMMON, "--output_dir", str(whole)])
    second = train(
        "sft",
        [*COMMON, "--output_dir", str(resumed),
         "--resume_from_checkpoint", str(whole / "checkpoint-2")],
    )  # fmt: skip
    assert first["steps"] == second["steps"] == 4
    history = json.loads((whole / "trainer_state.json").read_text())["log_history"]
    history_resumed = json.loads((resumed / "trainer_state.json").read_text())["log_history"]
    whole_losses, resumed_losses = _losses(history), _losses(history_resumed)
    # The resumed process stepped twice (a fresh start would have stepped 4 times, to the
    # same numbers: same seed, same data); its history carries steps 1-2 from the checkpoint.
    assert first["superoffload_stats"]["steps"] == 4
    assert second["superoffload_stats"]["steps"] == 2
    assert resumed_losses == whole_losses
    a = load_file(whole / "model.safetensors")
    b = load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)


def test_save_model_false_keeps_the_state_and_summary_but_writes_no_model(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "out"
    summary = train(
        "sft",
        ["--max_steps", "2", "--logging_steps", "1", "--loss_plot", "false",
         "--require_loss_decrease", "false", "--report_to", "none", "--save_strategy", "no",
         "--save_model", "false", "--output_dir", str(out)],
    )  # fmt: skip
    assert summary["steps"] == 2
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert sorted(_losses(history)) == [1, 2]
    assert (out / "sft_summary.json").is_file()
    assert not list(out.glob("*.safetensors")) and not (out / "README.md").exists()
    lines = [json.loads(line) for line in (out / "log_history.jsonl").read_text().splitlines()]
    # Every logged dict, as the Trainer logged it (full precision), the final summary included.
    assert [r for r in lines if "loss" in r] == [r for r in history if "loss" in r]
    assert lines[-1]["step"] == 2 and "train_runtime" in lines[-1]
