"""training_args.bin, which the Trainer pickles into every save and ``push_to_hub`` uploads,
holds no ``hub_token`` when a SuperOffload trainer writes it: not after ``save_model``, not in a
checkpoint, not in the output folder a checkpoint's push uploads; the arguments in memory keep
the token, and the uploads authenticate with it (hf_superoffload/integrations/saved_arguments.py).
The ZeRO-3 path is tested in test_zero3_trainer_save.py.

CPU, the tiny toy Llama of test_integration_trainer.py; the Hub is a stand-in recording each
upload (nothing touches the network).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may touch the network

import concurrent.futures
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_integration_trainer import _trainer
from transformers import TrainingArguments

from hf_superoffload import SuperOffloadTrainer
from hf_superoffload.integrations.saved_arguments import pickled_without_secrets
from hf_superoffload.toy import build_tiny_llama

TOKEN = "hf_saved_arguments_test_token_1234"
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _saved_args(directory) -> TrainingArguments:
    return torch.load(Path(directory) / "training_args.bin", weights_only=False)


def _files_holding_the_token(directory) -> list[str]:
    return [
        str(path)
        for path in Path(directory).rglob("*")
        if path.is_file() and TOKEN.encode() in path.read_bytes()
    ]


def test_the_arguments_pickle_without_the_token_and_keep_it(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), hub_token=TOKEN, report_to=[])
    own_class = type(args)
    with pickled_without_secrets(args):
        torch.save(args, tmp_path / "training_args.bin")
        copied = pickle.loads(pickle.dumps(args, protocol=0))  # every protocol
        assert args.hub_token == TOKEN  # what the upload reads
    assert type(args) is own_class and args.hub_token == TOKEN
    for loaded in (_saved_args(tmp_path), copied):
        assert type(loaded) is own_class  # a load needs nothing of hf_superoffload
        assert loaded.hub_token is None
        # Every other field as saved (to_dict shows a token as <HUB_TOKEN>, None as None).
        assert {**loaded.to_dict(), "hub_token": 0} == {**args.to_dict(), "hub_token": 0}


def test_the_arguments_get_their_class_back_when_the_save_fails(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), hub_token=TOKEN, report_to=[])
    with pytest.raises(OSError), pickled_without_secrets(args):
        raise OSError("disk full")
    assert type(args) is TrainingArguments
    assert pickle.loads(pickle.dumps(args)).hub_token == TOKEN  # outside: pickles as before


def test_arguments_that_pickle_in_their_own_way_are_refused_before_training(tmp_path):
    class OwnPickling(TrainingArguments):
        def __getstate__(self):
            return dict(vars(self))

    args = OwnPickling(output_dir=str(tmp_path), hub_token=TOKEN, report_to=[], use_cpu=True)
    with pytest.raises(TypeError, match=r"OwnPickling defines __getstate__.*hub_token"):
        SuperOffloadTrainer(model=build_tiny_llama(seed=0), args=args)
    with pytest.raises(TypeError, match="hub_token"), pickled_without_secrets(args):
        pass
    args.hub_token = None  # nothing to leave out
    with pickled_without_secrets(args):
        assert type(args) is OwnPickling


def test_save_model_and_checkpoints_leave_the_token_out(tmp_path):
    run = tmp_path / "run"
    trainer = _trainer(run, True, hub_token=TOKEN, max_steps=2, save_strategy="steps", save_steps=2)
    try:
        trainer.train()
        trainer.save_model(tmp_path / "final")
    finally:
        trainer.superoffload_optimizer.close()
    for directory in (run / "checkpoint-2", tmp_path / "final"):
        assert _saved_args(directory).hub_token is None
        assert _saved_args(directory).learning_rate == trainer.args.learning_rate
    assert _files_holding_the_token(tmp_path) == []
    assert trainer.args.hub_token == TOKEN


class _Hub:
    """Stands in for transformers' ``hf_api()``: records the token of each upload and the
    hub_token of the training_args.bin in the uploaded folder at that moment."""

    def __init__(self):
        self.uploads = []

    def create_repo(self, repo_id, token=None, **kwargs):
        return SimpleNamespace(repo_id=repo_id)

    def upload_folder(self, folder_path, token=None, **kwargs):
        saved = Path(folder_path) / "training_args.bin"
        self.uploads.append((token, _saved_args(folder_path).hub_token if saved.exists() else "-"))
        done = concurrent.futures.Future()
        done.set_result(None)
        return done


def test_pushes_authenticate_with_the_token_and_upload_none(tmp_path, monkeypatch):
    hub = _Hub()
    monkeypatch.setattr("transformers.trainer.hf_api", lambda: hub)
    trainer = _trainer(
        tmp_path / "run",
        True,
        hub_token=TOKEN,
        push_to_hub=True,
        hub_model_id="me/tiny",
        hub_strategy="checkpoint",  # the output folder and the checkpoint, at each save
        max_steps=2,
        save_strategy="steps",
        save_steps=1,
    )
    try:
        trainer.train()
        trainer.push_to_hub()
    finally:
        trainer.superoffload_optimizer.close()
    # Two checkpoints, two folders each, and the final push.
    assert hub.uploads == [(TOKEN, None)] * 5
    assert _files_holding_the_token(tmp_path) == []
    assert trainer.args.hub_token == TOKEN
