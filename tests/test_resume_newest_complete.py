"""``resume_from_checkpoint=True`` resumes from the newest checkpoint whose save finished, from
the recipes' command line (``--resume_from_checkpoint true``) and on DeepSpeed ZeRO-3 as on the
standalone path.

A save cut off after DeepSpeed wrote its state but before the Trainer's ``trainer_state.json``
(written last) leaves a folder the engine would load at step N while the Trainer restarts its
count at 0; the newest complete folder before it is the one to resume from. Each resumed run
must end where the uninterrupted run ended: same per-step losses, same final weights.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from cpu_trainer_args import cpu_training_args
from ranks import set_rank_env, spawn_ranks
from safetensors.torch import load_file
from test_zero3_trainer import ZERO3_CPU_OFFLOAD, _rows
from zero3_reference import free_port

from hf_superoffload.integrations.save import TRAINER_STATE_NAME, last_complete_checkpoint
from hf_superoffload.recipes.run import resume_argument, train

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _losses(run_dir) -> dict[int, float]:
    history = json.loads((run_dir / TRAINER_STATE_NAME).read_text())["log_history"]
    return {r["step"]: r["loss"] for r in history if "loss" in r}


def _assert_same_weights(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("true", True), ("True", True), ("1", True), ("yes", True), ("false", False),
     ("NO", False), (None, None), (True, True), ("out/checkpoint-2", "out/checkpoint-2")],
)  # fmt: skip
def test_the_command_lines_true_and_false_are_booleans(value, expected):
    assert resume_argument(value) == expected


def test_a_folder_named_like_a_boolean_stays_a_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "true").mkdir()
    assert resume_argument("true") == "true"


RECIPE = [
    "--max_steps", "4", "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", "2",
    "--loss_plot", "false", "--require_loss_decrease", "false", "--report_to", "none",
]  # fmt: skip


def test_recipe_resume_true_takes_the_newest_complete_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "run"
    whole = train("sft", [*RECIPE, "--output_dir", str(out)])
    want_losses, want_weights = _losses(out), load_file(out / "model.safetensors")
    # checkpoint-4's save was cut before its trainer_state.json.
    (out / "checkpoint-4" / TRAINER_STATE_NAME).unlink()
    resumed = train("sft", [*RECIPE, "--output_dir", str(out), "--resume_from_checkpoint", "true"])
    assert whole["superoffload_stats"]["steps"] == 4
    assert resumed["superoffload_stats"]["steps"] == 2  # steps 3 and 4, from checkpoint-2
    assert _losses(out) == want_losses
    _assert_same_weights(load_file(out / "model.safetensors"), want_weights)


def _deepspeed_checkpoint(folder, step: int, *, state: bool, latest: bool) -> None:
    """A ZeRO-3 checkpoint folder as the Trainer writes it, in its order: DeepSpeed's state
    (global_stepN, then ``latest`` naming it), then ``trainer_state.json``."""
    (folder / f"global_step{step}").mkdir(parents=True)
    if latest:
        (folder / "latest").write_text(f"global_step{step}")
    if state:
        (folder / TRAINER_STATE_NAME).write_text(json.dumps({"global_step": step}))


def test_on_deepspeed_a_complete_folder_holds_trainer_state_and_deepspeeds_latest(tmp_path):
    _deepspeed_checkpoint(tmp_path / "checkpoint-1", 1, state=True, latest=True)
    # Cut after DeepSpeed's save, before trainer_state.json.
    _deepspeed_checkpoint(tmp_path / "checkpoint-2", 2, state=False, latest=True)
    # trainer_state.json, but DeepSpeed's state never named (its `latest` missing).
    _deepspeed_checkpoint(tmp_path / "checkpoint-3", 3, state=True, latest=False)
    assert last_complete_checkpoint(str(tmp_path), deepspeed=True) == str(tmp_path / "checkpoint-1")
    assert last_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-3")
    (tmp_path / "checkpoint-1" / "latest").write_text("global_step7")  # names no folder
    assert last_complete_checkpoint(str(tmp_path), deepspeed=True) is None


STEPS = 3


def _zero3_sft(out: str, resume) -> dict:
    from datasets import Dataset

    from hf_superoffload import SuperOffloadSFTConfig, SuperOffloadSFTTrainer
    from hf_superoffload.toy import build_tiny_llama, make_char_tokenizer

    config = json.loads(json.dumps(ZERO3_CPU_OFFLOAD))
    config["zero_optimization"]["offload_optimizer"]["super_offload"] = "hf_superoffload"
    args = SuperOffloadSFTConfig(
        **cpu_training_args(
            out, max_steps=STEPS, per_device_train_batch_size=4, learning_rate=1e-3,
            max_length=64, save_strategy="steps", save_steps=1, disable_tqdm=True,
            deepspeed=config,
        )
    )  # fmt: skip
    trainer = SuperOffloadSFTTrainer(
        model=build_tiny_llama(seed=0),
        args=args,
        train_dataset=Dataset.from_list(_rows(64)),
        processing_class=make_char_tokenizer(),
    )
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model()
    history = trainer.state.log_history  # a resumed run's holds the checkpoint's steps too
    result = {
        "steps": trainer.superoffload_stats["steps"],
        "losses": {r["step"]: r["loss"] for r in history if "loss" in r},
    }
    trainer.deepspeed.destroy()
    return result


def _interrupted_and_resumed(rank, port, out) -> None:
    set_rank_env(0, 1, port)
    torch.set_num_threads(1)
    import hf_superoffload  # noqa: F401  (our optimizer for "super_offload")

    whole = _zero3_sft(out, None)
    os.rename(f"{out}/model.safetensors", f"{out}/whole.safetensors")
    # The save of step 3 did not happen; that of step 2 was cut after DeepSpeed's state.
    shutil.rmtree(f"{out}/checkpoint-3")
    os.remove(f"{out}/checkpoint-2/{TRAINER_STATE_NAME}")
    resumed = _zero3_sft(out, True)
    torch.save({"whole": whole, "resumed": resumed}, f"{out}/results.pt")


def test_zero3_resume_true_skips_a_folder_cut_after_deepspeeds_save(tmp_path):
    spawn_ranks(_interrupted_and_resumed, (free_port(), str(tmp_path)), world=1)
    results = torch.load(tmp_path / "results.pt", weights_only=False)
    assert results["whole"]["steps"] == STEPS
    assert results["resumed"]["steps"] == STEPS - 1  # from checkpoint-1: steps 2 and 3
    assert sorted(results["whole"]["losses"]) == list(range(1, STEPS + 1))
    assert results["resumed"]["losses"] == results["whole"]["losses"]
    _assert_same_weights(
        load_file(tmp_path / "model.safetensors"), load_file(tmp_path / "whole.safetensors")
    )
