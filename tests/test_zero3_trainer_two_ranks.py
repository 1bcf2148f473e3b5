"""TRL's plain SFTTrainer given a DeepSpeed ZeRO-3 config with ``"super_offload": true`` trains
through hf_superoffload's ZeRO-3 optimizer on two data-parallel ranks, and follows the same
two-rank run on DeepSpeed's plain CPU offload (test_zero3_trainer.py does this on one process).

Two spawned processes, each with the launcher's variables (RANK, WORLD_SIZE, ...), as torchrun
or ``accelerate launch`` sets them; the Trainer (accelerate) joins them itself. DeepSpeed's CPU
accelerator, gloo, fp32, the download-free toy model and the bundled SFT data. Both runs happen
in the same two processes, one after the other (the Trainer resets accelerate's state and
DeepSpeed re-uses the process group).

The arguments carry ``use_cpu=True``, and on a machine without a GPU they must: with it,
accelerate joins the processes over gloo (MULTI_CPU, one of two) and then runs them as
DeepSpeed. Without it, accelerate finds no device backend (``backend is None``), lets DeepSpeed
start the process group, and still counts itself as process 0 of 1: every rank trains the whole
job alone, and TRL's first ``gather_for_metrics`` hands gloo a one-tensor list for a two-rank
all_gather ("expected length 2, got 1"). The last test pins that cause.

Losses agree to the engine tests' 1e-4 (relative): the two optimizers step the same fp32
partitions with different CPU Adam kernels, so the params differ by a few ulps a step, which the
loss carries forward; measured 1.1e-7 over the 4 steps.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from cpu_trainer_args import cpu_training_args
from ranks import set_rank_env, spawn_ranks
from test_zero3_trainer import ZERO3_CPU_OFFLOAD, _rows
from zero3_reference import free_port

os.environ.setdefault("HF_HUB_OFFLINE", "1")
WORLD = 2
STEPS = 4
ROWS = 200
MICRO_BATCH, ACCUMULATION = 8, 2


def _args(out_dir: str, ds_config: dict, use_cpu: bool = True):
    from trl import SFTConfig

    return SFTConfig(
        **cpu_training_args(
            out_dir,
            use_cpu=use_cpu,
            max_steps=STEPS,
            per_device_train_batch_size=MICRO_BATCH,
            gradient_accumulation_steps=ACCUMULATION,
            learning_rate=1e-3,
            weight_decay=0.1,
            adam_epsilon=1e-6,
            max_grad_norm=1.0,
            max_length=64,
            data_seed=0,
            deepspeed=copy.deepcopy(ds_config),
        )
    )


def _sft(out_dir: str, ds_config: dict) -> dict:
    from datasets import Dataset
    from trl import SFTTrainer

    from hf_superoffload.toy import build_tiny_llama, make_char_tokenizer

    trainer = SFTTrainer(
        model=build_tiny_llama(seed=0),
        args=_args(out_dir, ds_config),
        train_dataset=Dataset.from_list(_rows(ROWS)),
        processing_class=make_char_tokenizer(),
    )
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log and "step" in log]
    state = trainer.accelerator.state
    result = {
        "losses": [log["loss"] for log in logs],
        "num_tokens": [log["num_tokens"] for log in logs],  # TRL's gathered metrics
        "mean_token_accuracy": [log["mean_token_accuracy"] for log in logs],
        "epoch": logs[-1]["epoch"],
        "optimizer": type(trainer.deepspeed.optimizer).__name__,
        "distributed_type": str(state.distributed_type),
        "num_processes": state.num_processes,
        "process_index": state.process_index,
        "dp_world_size": trainer.deepspeed.dp_world_size,
    }
    trainer.deepspeed.destroy()
    return result


def _without_use_cpu(out_dir: str) -> dict:
    """What accelerate makes of the same processes when the arguments leave use_cpu off."""
    import torch.distributed as dist

    args = _args(out_dir, ZERO3_CPU_OFFLOAD, use_cpu=False)
    state = args.distributed_state
    return {
        "backend": state.backend,
        "distributed_type": str(state.distributed_type),
        "num_processes": state.num_processes,
        "process_index": state.process_index,
        "torch_world_size": dist.get_world_size(),
    }


def _two_runs(rank: int, port: int, out_dir: str) -> None:
    set_rank_env(rank, WORLD, port)
    torch.set_num_threads(1)
    import hf_superoffload  # noqa: F401  (activates "super_offload": true)

    flagged = copy.deepcopy(ZERO3_CPU_OFFLOAD)
    flagged["zero_optimization"]["offload_optimizer"]["super_offload"] = True
    results = {
        "reference": _sft(f"{out_dir}/ref", ZERO3_CPU_OFFLOAD),
        "flag": _sft(f"{out_dir}/flag", flagged),
        "without_use_cpu": _without_use_cpu(f"{out_dir}/no_cpu"),
    }
    torch.save(results, f"{out_dir}/rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("zero3_trainer_two_ranks")
    spawn_ranks(_two_runs, (free_port(), str(out)), world=WORLD, timeout=240)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.slow
def test_both_runs_are_one_two_rank_deepspeed_job(runs):
    for rank, result in enumerate(runs):
        for run in ("reference", "flag"):
            assert result[run]["distributed_type"] == "DistributedType.DEEPSPEED"
            assert result[run]["num_processes"] == WORLD
            assert result[run]["process_index"] == rank
            assert result[run]["dp_world_size"] == WORLD
            # Each optimizer step took WORLD * MICRO_BATCH * ACCUMULATION rows: the ranks shared
            # the data (a rank training it all alone would log half this epoch; the Trainer
            # rounds the last partial batch of an epoch up, hence not exact).
            rows = STEPS * WORLD * MICRO_BATCH * ACCUMULATION
            assert result[run]["epoch"] == pytest.approx(rows / ROWS, rel=0.1)


@pytest.mark.slow
def test_plain_sfttrainer_with_the_flag_trains_through_our_zero3_optimizer(runs):
    ref, ours = runs[0]["reference"], runs[0]["flag"]
    assert ref["optimizer"] == "DeepSpeedZeroOptimizer_Stage3"
    assert ours["optimizer"] == "SuperOffloadZero3Optimizer"
    assert len(ours["losses"]) == len(ref["losses"]) == STEPS
    torch.testing.assert_close(ours["losses"], ref["losses"], rtol=1e-4, atol=0)
    assert ours["losses"][-1] < ours["losses"][0]  # it learned: the comparison is not vacuous
    # TRL's metrics went through accelerate's gathers over both ranks, on the same batches.
    assert ours["num_tokens"] == ref["num_tokens"]
    torch.testing.assert_close(ours["mean_token_accuracy"], ref["mean_token_accuracy"])
    assert runs[1]["flag"]["losses"] == ours["losses"]  # the logged loss is the ranks' mean


@pytest.mark.slow
def test_without_use_cpu_accelerate_counts_one_process_of_the_two(runs):
    """The cause of the metric-gather failure on DeepSpeed's CPU accelerator: with no device
    backend accelerate lets DeepSpeed join the ranks but sizes everything for one process. If
    this fails, accelerate now counts the ranks and ``use_cpu`` is no longer needed."""
    for result in runs:
        seen = result["without_use_cpu"]
        assert seen["torch_world_size"] == WORLD
        assert seen["backend"] is None
        assert seen["distributed_type"] == "DistributedType.DEEPSPEED"
        assert (seen["num_processes"], seen["process_index"]) == (1, 0)
