"""TRL's SFTTrainer given a DeepSpeed ZeRO-3 config trains through hf_superoffload's ZeRO-3
optimizer once the package is imported, and follows the same run on DeepSpeed's plain CPU offload;
SuperOffloadSFTTrainer given a ZeRO-3 config without the flag takes the same path.

One spawned process (DeepSpeed needs its distributed environment), CPU accelerator, fp32, the
download-free toy model and the bundled SFT data. Losses agree to the engine tests' 1e-4.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from ranks import set_rank_env, spawn_ranks
from zero3_reference import free_port, trainer_zero3_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")
DATA_FILE = Path(__file__).resolve().parents[1] / "examples" / "data" / "arithmetic_sft.jsonl"
STEPS = 6

ZERO3_CPU_OFFLOAD = trainer_zero3_config()


def _rows(n: int) -> list[dict[str, str]]:
    with open(DATA_FILE, encoding="utf-8") as f:
        return [json.loads(line) for _, line in zip(range(n), f, strict=False)]


def _sft(out_dir: str, trainer_kind: str, ds_config: dict) -> dict:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from hf_superoffload import SuperOffloadSFTConfig, SuperOffloadSFTTrainer
    from hf_superoffload.toy import build_tiny_llama, make_char_tokenizer

    ours = trainer_kind == "superoffload_trainer"
    config_cls, trainer_cls = (
        (SuperOffloadSFTConfig, SuperOffloadSFTTrainer) if ours else (SFTConfig, SFTTrainer)
    )
    args = config_cls(
        output_dir=out_dir,
        max_steps=STEPS,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        weight_decay=0.1,
        adam_epsilon=1e-6,
        max_grad_norm=1.0,
        bf16=False,
        max_length=64,
        logging_steps=1,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
        data_seed=0,
        deepspeed=copy.deepcopy(ds_config),
    )
    trainer = trainer_cls(
        model=build_tiny_llama(seed=0),
        args=args,
        train_dataset=Dataset.from_list(_rows(200)),
        processing_class=make_char_tokenizer(),
    )
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log and "step" in log]
    kind = type(trainer.deepspeed.optimizer).__name__
    base = type(trainer.deepspeed.optimizer.optimizer).__name__
    stats = getattr(trainer, "superoffload_stats", None)
    keys = sorted({k for log in trainer.state.log_history if "loss" in log for k in log})
    trainer.deepspeed.destroy()
    return {"losses": losses, "optimizer": kind, "base": base, "stats": stats, "log_keys": keys}


def _three_runs(rank, port, out_dir) -> None:
    set_rank_env(0, 1, port)
    torch.set_num_threads(1)
    import hf_superoffload  # noqa: F401  (activates "super_offload": true)

    flagged = copy.deepcopy(ZERO3_CPU_OFFLOAD)
    flagged["zero_optimization"]["offload_optimizer"]["super_offload"] = True
    results = {
        "reference": _sft(f"{out_dir}/ref", "trl", ZERO3_CPU_OFFLOAD),
        "trl_flag": _sft(f"{out_dir}/trl", "trl", flagged),
        "ours_no_flag": _sft(f"{out_dir}/ours", "superoffload_trainer", ZERO3_CPU_OFFLOAD),
    }
    torch.save(results, f"{out_dir}/results.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("zero3_trainer")
    spawn_ranks(_three_runs, (free_port(), str(out)), world=1)
    return torch.load(out / "results.pt", weights_only=False)


@pytest.mark.slow  # the plain run's CPU Adam (accelerate maps AdamW to it) is a JIT build
def test_plain_sfttrainer_with_the_flag_trains_through_our_zero3_optimizer(runs):
    ref, ours = runs["reference"], runs["trl_flag"]
    assert ref["optimizer"] == "DeepSpeedZeroOptimizer_Stage3"
    assert ours["optimizer"] == "SuperOffloadZero3Optimizer"
    assert len(ours["losses"]) == len(ref["losses"]) == STEPS
    torch.testing.assert_close(ours["losses"], ref["losses"], rtol=1e-4, atol=0)
    assert ours["losses"][-1] < ours["losses"][0]  # it learned: the comparison is not vacuous
    # TRL's own trainer logs what the SuperOffload trainers log (Zero3MetricsCallback).
    assert {"tokens_per_second", "stv/rollbacks_clip", "stv/speculative_steps"} <= set(
        ours["log_keys"]
    ), ours["log_keys"]
    assert not any(k.startswith("stv/") for k in ref["log_keys"])  # not on DeepSpeed's own
    # accelerate swapped the Trainer's AdamW for a state holder, not a CPU Adam to compile.
    assert (ours["base"], ref["base"]) == ("HostAdamState", "DeepSpeedCPUAdam")


@pytest.mark.slow
def test_superoffload_sfttrainer_turns_the_flag_on_and_logs_stv_counters(runs):
    ref, ours = runs["reference"], runs["ours_no_flag"]
    assert ours["optimizer"] == "SuperOffloadZero3Optimizer"
    torch.testing.assert_close(ours["losses"], ref["losses"], rtol=1e-4, atol=0)
    assert ours["stats"]["steps"] == STEPS


def test_superoffload_trainer_refuses_a_deepspeed_config_it_cannot_run():
    from hf_superoffload.zero3.config import require_super_offload

    with pytest.raises(ValueError, match="stage 3 with the optimizer offloaded"):
        require_super_offload({"zero_optimization": {"stage": 2}})
    config = copy.deepcopy(ZERO3_CPU_OFFLOAD)
    require_super_offload(config)
    assert config["zero_optimization"]["offload_optimizer"]["super_offload"] is True


REPO = Path(__file__).resolve().parents[1]
LAUNCHER_VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE", "MPI_LOCALNRANKS",
    "SLURM_NTASKS",
)  # fmt: skip


@pytest.mark.slow
def test_python_train_py_with_a_deepspeed_config_and_no_launcher_runs_one_process(tmp_path):
    """`python examples/sft.py --deepspeed <the shipped JSON>` with no launcher (and no MPI):
    DeepSpeed's MPI discovery would fail on mpi4py after the model has loaded; it trains as one
    process. TRL's own SFTTrainer (--optimizer adamw) drives our ZeRO-3 optimizer here, and
    its logs, the summary and the printed summary line say which optimizer ran and the bytes
    its state held."""
    from launched import ONE_PROCESS, run_launched

    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    out = tmp_path / "out"
    argv = [
        sys.executable, str(REPO / "examples" / "sft.py"),
        "--deepspeed", str(REPO / "accelerate_configs" / "deepspeed" / "zero3_superoffload.json"),
        "--optimizer", "adamw", "--use_cpu", "true", "--max_steps", "3",
        "--output_dir", str(out), "--require_loss_decrease", "false",
    ]  # fmt: skip
    done = run_launched(argv, timeout=ONE_PROCESS, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "DeepSpeed runs it as one process" in done.stderr
    summary = json.loads((out / "sft_summary.json").read_text())
    assert summary["steps"] == 3 and summary["processes"] == 1
    assert summary["optimizer"] == "SuperOffloadZero3Optimizer"
    state = summary["optimizer_state"]
    assert state["optimizer"] == "SuperOffloadZero3Optimizer"
    params = sum(p.numel() for p in _demo_model().parameters())
    # This rank holds every sub group on the host: fp32 master and two moments, 12 B/param
    # (and no padding with one rank).
    assert (state["host_bytes"], state["device_bytes"]) == (12 * params, 0)
    assert summary["superoffload_stats"]["steps"] == 3
    line = next(x for x in done.stdout.splitlines() if x.startswith("optimizer state:"))
    assert "SuperOffloadZero3Optimizer" in line and f"host {12 * params / 2**20:.2f} MiB" in line
    logged = json.loads((out / "trainer_state.json").read_text())["log_history"]
    step_logs = [log for log in logged if "loss" in log]
    assert all("tokens_per_second" in log and "stv/rollbacks_clip" in log for log in step_logs)


@pytest.mark.slow
def test_examples_sft_with_compact_moments_on_zero3_holds_them_and_says_so(tmp_path):
    """`examples/sft.py --deepspeed <JSON> --superoffload_moments compact`: the argument reaches
    the ZeRO-3 optimizer DeepSpeed builds, whose state is the fp32 master and the codes (about
    6 B/param with the block scales), and the summary names compact moments."""
    from launched import ONE_PROCESS, run_launched

    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    env.pop("HF_SUPEROFFLOAD_MOMENTS", None)
    out = tmp_path / "out"
    argv = [
        sys.executable, str(REPO / "examples" / "sft.py"),
        "--deepspeed", str(REPO / "accelerate_configs" / "deepspeed" / "zero3_superoffload.json"),
        "--use_cpu", "true", "--max_steps", "3", "--superoffload_moments", "compact",
        "--output_dir", str(out), "--require_loss_decrease", "false",
    ]  # fmt: skip
    done = run_launched(argv, timeout=ONE_PROCESS, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    state = json.loads((out / "sft_summary.json").read_text())["optimizer_state"]
    params = sum(p.numel() for p in _demo_model().parameters())
    assert 6 * params < state["host_bytes"] < 6.1 * params and state["device_bytes"] == 0
    line = next(x for x in done.stdout.splitlines() if x.startswith("optimizer state:"))
    assert "compact moments (8 bits a value)" in line, line


def _demo_model():
    from hf_superoffload.recipes.arguments import parse
    from hf_superoffload.recipes.model import build_model, load_tokenizer

    recipe, args = parse("sft", ["--output_dir", "unused"])
    return build_model(recipe, load_tokenizer(recipe), args.seed)
