"""A checkpoint interrupted while it is written leaves the previous one loadable.

Two layers: ``state_io.save_atomically`` (the optimizer file itself: a write that fails
half-way leaves the file at that path as it was, and no temporary file behind), and
``save.last_complete_checkpoint`` (a Trainer ``checkpoint-N`` whose save did not finish is not
resumed from). The interruption is a ``torch.save`` that writes half of its bytes and raises,
as a full disk does.
"""

from __future__ import annotations

import io
import json
import logging
import os

import pytest
import torch
from engine_reference import (
    RunConfig,
    build_model,
    engine_do_step,
    engine_state,
    make_batches,
    make_engine,
    train_loop,
)

from hf_superoffload.engine import state_io
from hf_superoffload.engine.state_io import save_atomically
from hf_superoffload.integrations.save import TRAINER_STATE_NAME, last_complete_checkpoint

REAL_SAVE = torch.save


def _torn_save(obj, f, *args, **kwargs):
    """Write the first half of what torch.save would, then fail as a full disk does."""
    whole = io.BytesIO()
    REAL_SAVE(obj, whole, *args, **kwargs)
    data = whole.getvalue()
    f.write(data[: len(data) // 2])
    raise OSError(28, "No space left on device (injected)")


def _trained(steps: int):
    cfg = RunConfig(steps=steps)
    model = build_model(cfg)
    opt = make_engine(model, cfg, gpu_tail=0)
    train_loop(cfg, model, opt, make_batches(cfg), engine_do_step(opt))
    opt.synchronize()
    return cfg, model, opt


def _loads_as(path, want: dict) -> None:
    """``path`` loads into a new optimizer over a fresh model and gives the state ``want``."""
    cfg = RunConfig()
    model = build_model(cfg)
    with make_engine(model, cfg, gpu_tail=0) as opt:
        opt.load_state_dict(torch.load(path, weights_only=True))
        got = engine_state(opt, model)
    for name, entry in want.items():
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got[name][key], entry[key]), f"{key} of {name}"
        assert got[name]["step"] == entry["step"]


def test_an_interrupted_save_leaves_the_previous_file_whole(tmp_path, monkeypatch):
    path = tmp_path / "optimizer.pt"
    _, model, opt = _trained(steps=2)
    save_atomically(opt.state_dict(), path)
    before = engine_state(opt, model)
    saved_bytes = path.read_bytes()
    opt.close()

    _, _, later = _trained(steps=4)
    monkeypatch.setattr(state_io.torch, "save", _torn_save)
    with pytest.raises(OSError, match="No space left"):
        save_atomically(later.state_dict(), path)
    later.close()
    monkeypatch.undo()

    assert os.listdir(tmp_path) == ["optimizer.pt"], "a temporary file was left behind"
    assert path.read_bytes() == saved_bytes
    _loads_as(path, before)


def test_a_finished_save_replaces_the_file(tmp_path):
    path = tmp_path / "optimizer.pt"
    path.write_bytes(b"an older checkpoint")
    _, model, opt = _trained(steps=3)
    save_atomically(opt.state_dict(), path)
    want = engine_state(opt, model)
    opt.close()
    assert os.listdir(tmp_path) == ["optimizer.pt"]
    _loads_as(path, want)


def _write_checkpoint(folder, opt, *, finished: bool) -> None:
    """What the Trainer's _save_checkpoint writes, in its order: the optimizer's state, then
    trainer_state.json last (not at all when the save is cut short)."""
    os.makedirs(folder)
    save_atomically(opt.state_dict(), os.path.join(folder, "optimizer.pt"))
    if finished:
        with open(os.path.join(folder, TRAINER_STATE_NAME), "w") as f:
            json.dump({"global_step": int(os.path.basename(folder).split("-")[1])}, f)


def test_resume_skips_a_checkpoint_whose_save_did_not_finish(tmp_path, monkeypatch, caplog):
    _, model, opt = _trained(steps=2)
    _write_checkpoint(tmp_path / "checkpoint-2", opt, finished=True)
    want = engine_state(opt, model)
    opt.close()
    assert last_complete_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")

    # The save of step 4 fails in the optimizer file: no trainer_state.json follows.
    _, _, later = _trained(steps=4)
    monkeypatch.setattr(state_io.torch, "save", _torn_save)
    with pytest.raises(OSError):
        _write_checkpoint(tmp_path / "checkpoint-4", later, finished=True)
    later.close()
    monkeypatch.undo()
    # And one of step 6 with a truncated trainer_state.json (the machine went mid-write).
    (tmp_path / "checkpoint-6").mkdir()
    (tmp_path / "checkpoint-6" / TRAINER_STATE_NAME).write_text('{"global_step": ')

    with caplog.at_level(logging.WARNING, logger="hf_superoffload"):
        chosen = last_complete_checkpoint(str(tmp_path))
    assert chosen == str(tmp_path / "checkpoint-2")
    skipped = [r.getMessage() for r in caplog.records if "did not finish" in r.getMessage()]
    assert len(skipped) == 2 and "checkpoint-6" in skipped[0] and "checkpoint-4" in skipped[1]
    assert os.listdir(tmp_path / "checkpoint-4") == []  # the torn file was removed
    _loads_as(os.path.join(chosen, "optimizer.pt"), want)


def test_no_complete_checkpoint_gives_none(tmp_path):
    assert last_complete_checkpoint(str(tmp_path)) is None
    (tmp_path / "checkpoint-3").mkdir()
    (tmp_path / "checkpoint-notanumber").mkdir()
    assert last_complete_checkpoint(str(tmp_path)) is None
