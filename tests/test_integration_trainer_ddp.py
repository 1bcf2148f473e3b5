"""`SuperOffloadTrainer` with data parallelism, on CPU: two gloo processes, as `accelerate launch
--num_processes 2` starts them, each training the tiny Llama of test_integration_trainer.py on
its shard of every batch, two micro-batches per step. The reference is the plain `Trainer` in the same two processes
(DistributedDataParallel + torch's AdamW + clipping). Same losses, grad norms and final params
within the single-process tolerances, the two ranks' SuperOffload params bit-identical, and a
run resumed from its halfway checkpoint ending where the uninterrupted one did."""

from __future__ import annotations

import pytest
import torch
from ranks import free_port, set_rank_env, spawn_ranks
from test_integration_trainer import STEPS, _params, _step_logs, _trainer

WORLD = 2


def _train_on_rank(rank: int, port: int, out_dir) -> None:
    set_rank_env(rank, WORLD, port)
    torch.set_num_threads(1)
    results = {}
    for run in ("plain", "superoffload", "resumed"):
        superoffload = run != "plain"
        trainer = _trainer(
            out_dir / ("plain" if run == "plain" else "superoffload"), superoffload,
            gradient_accumulation_steps=2,  # accelerate's sync_gradients marks the boundary
            ddp_timeout=120,  # a dead rank fails the other in minutes, not half an hour
            save_strategy="steps" if superoffload else "no", save_steps=STEPS // 2,
        )  # fmt: skip
        assert trainer.accelerator.num_processes == WORLD
        halfway = out_dir / "superoffload" / f"checkpoint-{STEPS // 2}"
        trainer.train(resume_from_checkpoint=str(halfway) if run == "resumed" else None)
        logs = _step_logs(trainer)
        model = trainer.accelerator.unwrap_model(trainer.model)
        results[run] = {
            "losses": [log["loss"] for log in logs],
            "grad_norms": [log["grad_norm"] for log in logs],
            "params": _params(model),
            "ddp_wrapped": type(trainer.model_wrapped).__name__,
        }
    torch.save(results, out_dir / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("ddp")
    port = free_port()
    spawn_ranks(_train_on_rank, (port, out_dir), WORLD, timeout=600)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.slow
def test_the_plain_trainer_used_ddp_and_superoffload_did_not(runs):
    assert runs[0]["plain"]["ddp_wrapped"] == "DistributedDataParallel"
    assert runs[0]["superoffload"]["ddp_wrapped"] != "DistributedDataParallel"


@pytest.mark.slow
def test_superoffload_follows_the_plain_ddp_trainer(runs):
    ours, plain = runs[0]["superoffload"], runs[0]["plain"]
    assert len(ours["losses"]) == len(plain["losses"]) == STEPS
    torch.testing.assert_close(ours["losses"], plain["losses"], rtol=1e-5, atol=0)
    torch.testing.assert_close(ours["grad_norms"], plain["grad_norms"], rtol=1e-4, atol=0)
    for name, param in plain["params"].items():
        torch.testing.assert_close(ours["params"][name], param, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_ranks_hold_bit_identical_params(runs):
    for name, param in runs[0]["superoffload"]["params"].items():
        assert torch.equal(param, runs[1]["superoffload"]["params"][name]), name


@pytest.mark.slow
def test_resuming_halfway_under_data_parallelism_ends_where_one_run_does(runs):
    """Rank 0 saved the checkpoint; both ranks load it (onto the host, not each GPU)."""
    for rank in range(WORLD):
        resumed, whole = runs[rank]["resumed"], runs[rank]["superoffload"]
        for name, param in whole["params"].items():
            torch.testing.assert_close(resumed["params"][name], param, rtol=1e-6, atol=1e-8)
