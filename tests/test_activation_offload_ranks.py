"""The recipes' ``--activation_checkpoint_offload true`` on DeepSpeed ZeRO-3 changes nothing but
where the checkpointed layer inputs wait: the same recipe run with and without it has equal
losses and gradient norms at every step and equal fp32 masters after the last (``==`` and
``torch.equal``: it only moves tensors), on one rank (SuperOffload's ZeRO-3 path and DeepSpeed's
ZeRO-Offload) and on two ranks with Ulysses SP 2 (SuperOffload); and the offload moved, per
micro step, one input a layer of the rank's tokens, the memory plan's size
(zero3/activation_memory.py).

Spawned ranks (DeepSpeed's CPU accelerator, gloo, fp32), the recipe's own ``build_trainer`` on
the demo's tiny Llama with activation checkpointing on; both runs of a comparison in the same
processes (``_forget_ulysses`` undoes Ulysses's process-wide registration between them).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from ranks import set_rank_env, spawn_ranks
from zero3_reference import free_port, trainer_zero3_config

from hf_superoffload.recipes.arguments import KINDS, checkpointing_name
from hf_superoffload.zero3.activation_memory import layer_input_bytes

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

CHECKPOINTING = checkpointing_name(KINDS["sft"])  # the name this transformers gives it
STEPS, BATCH, PAD = 1, 4, 64  # every batch padded to 64 tokens (gloo gathers equal shapes)
ZERO3 = trainer_zero3_config()
SYSTEMS = {
    "superoffload": ({"super_offload": "hf_superoffload"}, "superoffload"),
    "zerooffload": ({}, "adamw"),  # DeepSpeed's CPU Adam, the dev/long_sequences.sh baseline
}


def _argv(out_dir: str, ds_path: str, optimizer: str, *extra: str) -> list[str]:
    return [
        "--output_dir", out_dir, "--deepspeed", ds_path, "--use_cpu", "true", "--bf16", "false",
        "--max_steps", str(STEPS), "--per_device_train_batch_size", str(BATCH),
        "--learning_rate", "1e-3", "--lr_scheduler_type", "constant", "--warmup_steps", "0",
        "--optim", "adamw_torch", "--data_seed", "0", "--disable_tqdm", "true",
        "--save_model", "false", "--loss_plot", "false", "--require_loss_decrease", "false",
        "--pad_to_multiple_of", str(PAD), f"--{CHECKPOINTING}", "true",
        "--optimizer", optimizer, *extra,
    ]  # fmt: skip


def _train(argv: list[str]) -> dict:
    from deepspeed.utils import safe_get_full_fp32_param

    from hf_superoffload.integrations.activation_offload import ActivationOffloadCallback
    from hf_superoffload.recipes.run import build_trainer

    _, trainer, model = build_trainer("sft", argv)
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log and "step" in log]
    offload = [
        c.offload
        for c in trainer.callback_handler.callbacks
        if isinstance(c, ActivationOffloadCallback)
    ]
    result = {
        "losses": [log["loss"] for log in logs],
        "norms": [log["grad_norm"] for log in logs],
        "optimizer": type(trainer.deepspeed.optimizer).__name__,
        "masters": {
            name: safe_get_full_fp32_param(p).clone() for name, p in model.named_parameters()
        },
        "shape": (model.config.num_hidden_layers, model.config.hidden_size),
        "micro_steps": STEPS * trainer.args.gradient_accumulation_steps,
        "sp_size": getattr(trainer.accelerator.parallelism_config, "sp_size", 1),
    }
    if offload:
        tally = offload[0].tally
        result["offload"] = {
            "layers": offload[0].layers,
            "packed": tally.packed,
            "packed_bytes": tally.packed_bytes,
            "peak_live_bytes": tally.peak_live_bytes,
            "live_bytes": tally.live_bytes,
        }
    trainer.deepspeed.destroy()
    return result


def _forget_ulysses(sdpa) -> None:
    """Undo what registering Ulysses did to the process (its SP groups, its wrapper in place of
    sdpa), so that the next run registers it afresh rather than wrapping the wrapper."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    parallel_state_sp._release_sequence_parallel_groups()
    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa


def _both(rank: int, world: int, port: int, out_dir: str, systems: list[str], extra: list[str]):
    set_rank_env(rank, world, port)
    torch.set_num_threads(1)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    results = {}
    for system in systems:
        config, optimizer = SYSTEMS[system]
        ds = json.loads(json.dumps(ZERO3))
        ds["zero_optimization"]["offload_optimizer"].update(config)
        ds_path = f"{out_dir}/{system}.json"
        with open(ds_path, "w") as f:
            json.dump(ds, f)
        for flag in ("false", "true"):
            argv = _argv(f"{out_dir}/{system}_{flag}", ds_path, optimizer, *extra)
            argv += ["--activation_checkpoint_offload", flag]
            results[(system, flag)] = _train(argv)
            _forget_ulysses(sdpa)
    torch.save(results, f"{out_dir}/rank{rank}.pt")


def _check(results: dict, system: str, sp_size: int, optimizer: str) -> None:
    plain, offloaded = results[(system, "false")], results[(system, "true")]
    assert plain["optimizer"] == offloaded["optimizer"] == optimizer
    assert plain["sp_size"] == offloaded["sp_size"] == sp_size
    tokens_per_rank = BATCH * PAD // sp_size  # a rank's share of each padded sequence
    assert len(plain["losses"]) == STEPS
    assert offloaded["losses"] == plain["losses"] and offloaded["norms"] == plain["norms"]
    for name, master in plain["masters"].items():
        assert torch.equal(offloaded["masters"][name], master), f"{system}: {name}"
    layers, hidden = offloaded["shape"]
    moved = offloaded["offload"]
    each = layer_input_bytes(tokens_per_rank, hidden, 4)  # fp32 on the CPU
    assert moved["layers"] == layers
    assert moved["packed"] == offloaded["micro_steps"] * layers
    assert moved["packed_bytes"] == offloaded["micro_steps"] * layers * each
    assert moved["peak_live_bytes"] == layers * each, "one micro step's inputs at a time"
    assert moved["live_bytes"] == 0
    assert "offload" not in plain


@pytest.mark.slow  # 4 recipe runs in one process: about 30-40 s on 2 busy cores
def test_one_rank_zero3_runs_are_identical_with_and_without_the_offload(tmp_path):
    spawn_ranks(_both, (1, free_port(), str(tmp_path), list(SYSTEMS), []), 1, timeout=600)
    results = torch.load(tmp_path / "rank0.pt", weights_only=False)
    _check(results, "superoffload", 1, "SuperOffloadZero3Optimizer")
    _check(results, "zerooffload", 1, "DeepSpeedZeroOptimizer_Stage3")


def test_two_ranks_ulysses_sp2_runs_are_identical_with_and_without_the_offload(tmp_path):
    """The long-sequence case the offload is for: about 30 s on 2 busy cores, kept in the CPU
    tier (the one test of the offload through ZeRO-3 and Ulysses there)."""
    sp = ["--sequence_parallel_size", "2", "--gradient_accumulation_steps", "2"]
    spawn_ranks(_both, (2, free_port(), str(tmp_path), ["superoffload"], sp), 2, timeout=600)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        _check(results, "superoffload", 2, "SuperOffloadZero3Optimizer")
