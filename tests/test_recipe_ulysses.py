"""The SFT recipe's ``--sequence_parallel_size`` (Ulysses through accelerate's
``ParallelismConfig``, hf_superoffload/recipes/sequence_parallel.py) trains on the ZeRO-3
SuperOffload path as data parallelism over the same sequences does, and refuses what it cannot
run before anything is built.

Two spawned ranks (DeepSpeed's CPU accelerator, gloo, fp32), the recipe's own ``build_trainer``
on the demo's tiny Llama and bundled arithmetic rows, a ZeRO-3 config with ``"super_offload":
"hf_superoffload"``; both runs in the same two processes, data parallel first (Ulysses replaces
the attention function process-wide once registered).

The mapping: with data parallelism each rank computes its own batch and one step averages the
two; under SP each micro step is one rank's batch computed by both ranks (half a sequence each),
so ``gradient_accumulation_steps`` 2 under SP sees the two batches that one data-parallel step
sees (same ``data_seed``, same sampler over 2 processes). The loss of each batch is its mean
over valid tokens in both; how batches combine differs by default: transformers' SP loss
averages the micro steps' means, the data-parallel Trainer weights batches by their valid tokens
(``average_tokens_across_devices``). The reference turns that off, so both take the mean of the
two batches' means (the completion-only rows hold different token counts, so the default would
differ by design, not by error).

Tolerances: engine_reference's (1e-4 relative): the same fp32 arithmetic in another order
(attention heads and half sequences on other ranks, shard losses weighted and summed), and the
batches padded to an even length under SP (masked padding at the end of causal rows).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from engine_reference import LOSS_TOL, NORM_TOL
from launched import SEVERAL_PROCESSES, run_launched
from ranks import spawn_ranks
from zero3_reference import free_port, trainer_zero3_config

from hf_superoffload.integrations.metrics import ThroughputMeter
from hf_superoffload.recipes import run, sequence_parallel
from hf_superoffload.recipes.arguments import DEMO_BUCKET_SIZE, parse
from hf_superoffload.toy import build_tiny_llama, tiny_llama_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

WORLD = 2
STEPS = 3
ZERO3_SUPEROFFLOAD = trainer_zero3_config(super_offload="hf_superoffload")


# gloo gathers equal shapes only, and DeepSpeed's adapter gathers each rank's batch: pad all
# to the demo's max_length 64 (NCCL takes uneven ones; there the recipe's own padding to a
# multiple of the SP size suffices).
SP_ARGS = (
    "--sequence_parallel_size", "2", "--gradient_accumulation_steps", "2",
    "--pad_to_multiple_of", "64",
)  # fmt: skip


def _argv(out_dir: str, ds_path: str, *extra: str) -> list[str]:
    return [
        "--output_dir", out_dir, "--deepspeed", ds_path, "--use_cpu", "true",
        "--bf16", "false", "--max_steps", str(STEPS), "--per_device_train_batch_size", "4",
        "--learning_rate", "1e-3", "--lr_scheduler_type", "constant", "--warmup_steps", "0",
        "--weight_decay", "0.1", "--adam_epsilon", "1e-6", "--max_grad_norm", "1.0",
        "--optim", "adamw_torch", "--data_seed", "0", "--disable_tqdm", "true",
        "--average_tokens_across_devices", "false", "--save_model", "false",
        "--loss_plot", "false", "--require_loss_decrease", "false", *extra,
    ]  # fmt: skip


def _train(argv: list[str]) -> dict:
    from hf_superoffload.recipes.run import build_trainer

    _, trainer, _ = build_trainer("sft", argv)
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log and "step" in log]
    pc = trainer.accelerator.parallelism_config
    result = {
        "losses": [log["loss"] for log in logs],
        "norms": [log["grad_norm"] for log in logs],
        "optimizer": type(trainer.deepspeed.optimizer).__name__,
        "sp_size": pc.sp_size if pc is not None else 1,
        "train_batch_size": trainer.deepspeed.train_batch_size(),  # rows per optimizer step
        "num_tokens": [log["num_tokens"] for log in logs],  # TRL's count over all ranks
        "pad_to_multiple_of": trainer.args.pad_to_multiple_of,
    }
    trainer.deepspeed.destroy()
    return result


def _two_runs(rank: int, port: int, out_dir: str, ds_path: str) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
        LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(1)
    results = {
        "data_parallel": _train(_argv(f"{out_dir}/dp", ds_path)),
        "sequence_parallel": _train(_argv(f"{out_dir}/sp", ds_path, *SP_ARGS)),
    }
    torch.save(results, f"{out_dir}/rank{rank}.pt")


def test_recipe_sp2_follows_data_parallel_over_the_same_sequences(tmp_path):
    ds_path = tmp_path / "zero3_superoffload.json"
    ds_path.write_text(json.dumps(ZERO3_SUPEROFFLOAD))
    spawn_ranks(_two_runs, (free_port(), str(tmp_path), str(ds_path)), WORLD, timeout=300)
    runs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for rank, result in enumerate(runs):
        dp, sp = result["data_parallel"], result["sequence_parallel"]
        assert dp["optimizer"] == sp["optimizer"] == "SuperOffloadZero3Optimizer"
        assert (dp["sp_size"], sp["sp_size"]) == (1, 2)
        # The same rows a step: 2 ranks x 4 rows, or 2 micro steps of 4 rows computed by both.
        assert dp["train_batch_size"] == sp["train_batch_size"] == 8
        assert dp["num_tokens"] == sp["num_tokens"], "the same sequences, step by step"
        assert len(sp["losses"]) == len(dp["losses"]) == STEPS, f"rank {rank}"
        torch.testing.assert_close(
            torch.tensor(sp["losses"]), torch.tensor(dp["losses"]), **LOSS_TOL
        )
        torch.testing.assert_close(torch.tensor(sp["norms"]), torch.tensor(dp["norms"]), **NORM_TOL)
    assert runs[0]["sequence_parallel"]["losses"] == runs[1]["sequence_parallel"]["losses"]


# --- refusals and plumbing, in this process (no ranks) ---

ZERO3 = SimpleNamespace(zero_stage=3)


def _args(**overrides) -> SimpleNamespace:
    """The training arguments the checks read."""
    return SimpleNamespace(**{"deepspeed_plugin": ZERO3, "pad_to_multiple_of": None, **overrides})


@pytest.mark.parametrize(
    ("world", "kind", "args", "message"),
    [
        (3, "sft", _args(), "does not divide the 3 launched rank"),
        (2, "dpo", _args(), "runs SFT only"),
        (2, "sft", _args(deepspeed_plugin=None), "needs DeepSpeed ZeRO-3"),
        (2, "sft", _args(deepspeed_plugin=SimpleNamespace(zero_stage=2)), "ZeRO stage 2"),
        (2, "sft", _args(pad_to_multiple_of=3), "not a multiple of --sequence_parallel_size 2"),
    ],
)
def test_sequence_parallel_refuses_what_it_cannot_run(monkeypatch, world, kind, args, message):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ValueError, match=message):
        sequence_parallel.check_arguments(2, kind, args)


@pytest.mark.parametrize(
    ("version", "refused"),
    [
        ("1.10.0", True),
        ("1.10.0rc1", True),
        ("1.11.0", False),
        ("1.16.0", False),
        ("2.0.0.dev0", False),
    ],
)
def test_sequence_parallel_needs_a_trl_whose_collator_gives_position_ids(version, refused):
    """TRL 1.10's SFT collator leaves position_ids out, and DeepSpeed's Ulysses loader stops
    at the first batch without them: refused before the model is built, naming the fix."""
    if refused:
        with pytest.raises(ValueError, match=r"needs TRL >= 1\.11.*pip install 'trl>=1\.11'"):
            sequence_parallel.check_trl(2, version)
    else:
        sequence_parallel.check_trl(2, version)


def test_sequence_parallel_accepts_a_size_dividing_ranks_and_padding(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    sequence_parallel.check_arguments(2, "sft", _args(pad_to_multiple_of=64))


@pytest.mark.parametrize(
    ("heads", "kv_heads", "attention", "packing", "message"),
    [
        (6, 6, "sdpa", False, "6 query heads and 6 key/value heads"),  # 6 % 4
        (8, 3, "sdpa", False, "8 query heads and 3 key/value heads"),  # neither divides
        (8, 8, "eager", False, "pass --attn_implementation sdpa"),
        (8, 8, "sdpa", True, "attends across the packed rows"),
    ],
)
def test_sequence_parallel_refuses_a_model_it_cannot_split(
    heads, kv_heads, attention, packing, message
):
    config = tiny_llama_config(
        vocab_size=32, hidden_size=48, num_heads=heads, num_kv_heads=kv_heads
    )
    config._attn_implementation = attention
    with pytest.raises(ValueError, match=message):
        sequence_parallel.check_model(4, config, packing)


def test_sequence_parallel_takes_replicated_kv_heads_and_flash_attention_with_packing():
    config = tiny_llama_config(vocab_size=32, hidden_size=64, num_heads=8, num_kv_heads=2)
    config._attn_implementation = "flash_attention_2"
    assert sequence_parallel.check_model(4, config, packing=True) == "flash_attention_2"


def test_configure_pads_to_the_sp_size_and_sizes_data_parallelism(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    args = _args(parallelism_config=None)
    sequence_parallel.configure(2, args, "sdpa")
    pc = args.parallelism_config
    assert (pc.sp_backend, pc.sp_size, pc.data_parallel_size) == ("deepspeed", 2, 2)
    assert pc.sp_handler.sp_attn_implementation == "sdpa"
    assert args.pad_to_multiple_of == 2


def test_flag_and_accelerate_config_must_agree(monkeypatch):
    monkeypatch.setenv(sequence_parallel.LAUNCHER_SP_SIZE, "2")
    assert sequence_parallel.requested_size(SimpleNamespace(sequence_parallel_size=None)) == 2
    assert sequence_parallel.requested_size(SimpleNamespace(sequence_parallel_size=2)) == 2
    with pytest.raises(ValueError, match="disagrees with the accelerate config"):
        sequence_parallel.requested_size(SimpleNamespace(sequence_parallel_size=4))
    monkeypatch.delenv(sequence_parallel.LAUNCHER_SP_SIZE)
    assert sequence_parallel.requested_size(SimpleNamespace(sequence_parallel_size=None)) == 1
    with pytest.raises(ValueError, match="must be 1 or more"):
        sequence_parallel.requested_size(SimpleNamespace(sequence_parallel_size=0))


def test_recipe_refuses_before_building_anything(tmp_path, monkeypatch):
    """Through the recipe's own entry: one process cannot hold an SP group of 2."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv(sequence_parallel.LAUNCHER_SP_SIZE, raising=False)
    ds_path = tmp_path / "zero3.json"
    ds_path.write_text(json.dumps(ZERO3_SUPEROFFLOAD))
    argv = [*_argv(str(tmp_path), str(ds_path)), "--sequence_parallel_size", "2"]
    built = []
    monkeypatch.setattr(run, "build_model", lambda *a, **k: built.append(a))
    with pytest.raises(ValueError, match="does not divide the 1 launched rank"):
        run.build_trainer("sft", argv)
    assert not built


def test_demo_under_deepspeed_leaves_the_partition_to_the_config(tmp_path):
    """The demo's small engine bucket is refused under DeepSpeed (the partition is the
    config's sub_group_size), so ``--deepspeed`` with the demo must not set it."""
    ds_path = tmp_path / "zero3.json"
    ds_path.write_text(json.dumps(ZERO3_SUPEROFFLOAD))
    _, args = parse("sft", ["--output_dir", str(tmp_path), "--deepspeed", str(ds_path)])
    assert args.superoffload_bucket_size is None
    _, args = parse("sft", ["--output_dir", str(tmp_path)])
    assert args.superoffload_bucket_size == DEMO_BUCKET_SIZE


def test_mfu_counts_attention_over_the_whole_sequence_under_sp():
    """A rank's shard of a sequence split 2 ways counts the FLOPs of its tokens attending to
    the whole sequence: two shards add up to the unsplit batch's FLOPs."""
    model = build_tiny_llama()
    ids = torch.zeros(2, 16, dtype=torch.long)
    whole, shards = ThroughputMeter(), ThroughputMeter()
    whole.add_batch({"input_ids": ids}, model)
    for half in ids.split(8, dim=1):
        shards.add_batch({"input_ids": half}, model, sequence_parallel=2)
    assert shards.tokens == whole.tokens
    assert shards.flops == pytest.approx(whole.flops, rel=1e-12)


# --- the shipped accelerate configs ---

REPO = Path(__file__).resolve().parents[1]
SP_CONFIGS = sorted((REPO / "accelerate_configs").glob("*_sp2.yaml"))


@pytest.mark.parametrize("path", SP_CONFIGS, ids=lambda p: p.name)
def test_sp_config_is_ulysses_over_its_processes_on_our_zero3(path):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(path))
    pc = config.parallelism_config
    assert str(config.distributed_type) in ("DEEPSPEED", "DistributedType.DEEPSPEED")
    assert (pc["parallelism_config_sp_backend"], pc["parallelism_config_sp_size"]) == (
        "deepspeed",
        config.num_processes,
    )
    ds = json.loads((REPO / config.deepspeed_config["deepspeed_config_file"]).read_text())
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["offload_optimizer"]["super_offload"] == "hf_superoffload"


@pytest.mark.slow
def test_sp_config_launches_the_example_with_ulysses(tmp_path):
    """accelerate launch of the x86 SP config: the launcher's parallelism_config reaches the
    recipe (no flag given) and both ranks train one sequence at a time together."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu"}
    env.pop(sequence_parallel.LAUNCHER_SP_SIZE, None)
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", "accelerate_configs/x86x2_superoffload_sp2.yaml",
        "examples/sft.py", "--use_cpu", "true", "--max_steps", "4",
        "--gradient_accumulation_steps", "2", "--pad_to_multiple_of", "64",
        "--output_dir", str(tmp_path / "out"), "--save_model", "false",
        "--require_loss_decrease", "false",
    ]  # fmt: skip
    result = run_launched(cmd, timeout=SEVERAL_PROCESSES, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "sft_summary.json").read_text())
    assert summary["optimizer"] == "SuperOffloadZero3Optimizer"
    assert (summary["processes"], summary["sequence_parallel_size"]) == (2, 2)
    assert "sequence parallel over 2 ranks" in result.stdout, result.stdout[-2000:]
