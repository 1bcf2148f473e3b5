"""Ulysses sequence parallelism (DeepSpeed's, for HF models) trains through the ZeRO-3
SuperOffload path as plain data parallelism does: on two ranks a tiny Llama run with
``sequence_parallel_size`` 2 has the same per-step losses, global grad norms and final fp32
masters as the same model run data-parallel over the same sequences, both with
``"super_offload": true`` (the engine's optimizer is SuperOffloadZero3Optimizer in both).

The SP run is set up as DeepSpeed's ALST tutorial does it for a HF model:
``UlyssesSPAttentionHF.register_with_transformers`` (wraps the model's sdpa attention, returns
the mpu), ``deepspeed.initialize(..., mpu=mpu)``, each rank's DataLoader wrapped in
``UlyssesSPDataLoaderAdapter`` (sequence shards, ``shift_labels``), and the shards' losses
combined by their valid tokens through a differentiable all-gather. The adapter turns each
rank's batch into one micro step that both ranks compute, so the SP run accumulates
``sp_size`` micro steps: each optimizer step sees the same sequences as one data-parallel
step, and the token-weighted loss equals the data-parallel mean of means (every sequence has
the same count of valid tokens).

Tolerances: in fp32 both runs do the same arithmetic in another order (attention heads and
sequence halves on other ranks, partial gradients summed across ranks, shard losses weighted
and summed), so they differ by fp32 rounding fed back through a few steps: the standalone
engine's bounds (engine_reference: 1e-4 relative) hold; measured on CPU: losses 1.2e-7
relative apart, norms equal, masters 7.5e-7 apart at most. A broken combination fails them:
shards weighted equally moves the losses 1.9e-3 relative, a gradient scaled by the SP size
doubles the norms (clipped Adam steps hide a scale from the losses). In bf16 (GPU) other GEMM shapes round
differently at bf16's 3.9e-3 precision and the next forward amplifies it, as
tests/test_zero3_gpu.py states: losses and norms there agree to 1e-2 and 2e-2, and masters are
not compared (one flipped rounding of a bf16 copy moves them past any fp32 bound).
"""

from __future__ import annotations

import os

import pytest
import torch
from engine_reference import LOSS_TOL, NORM_TOL, PARAM_TOL
from ranks import spawn_ranks
from zero3_reference import SEQ, VOCAB, Zero3Case, build_model, ds_config, free_port, init_rank

SP_SIZE = 2
WORLD = 2
# assert_close's rtol and atol for what each run records (no masters in bf16: see above).
FP32_TOLERANCES = {"losses": LOSS_TOL, "norms": NORM_TOL, "masters": PARAM_TOL}
BF16_TOLERANCES = {"losses": {"rtol": 1e-2, "atol": 0.0}, "norms": {"rtol": 2e-2, "atol": 0.0}}


def _rank_batches(case: Zero3Case, rank: int) -> list[dict]:
    """This rank's data-parallel batches, one a step, with the position ids Ulysses needs."""
    batches = []
    for step in range(case.steps):
        generator = torch.Generator().manual_seed(1000 * step + rank)
        ids = torch.randint(0, VOCAB, (case.micro_batch, SEQ), generator=generator)
        positions = torch.arange(SEQ).repeat(case.micro_batch, 1)
        batches.append({"input_ids": ids, "labels": ids.clone(), "position_ids": positions})
    return batches


def _engine(model, case: Zero3Case, world: int, mpu=None):
    """Our ZeRO-3 path with torch's AdamW as the base (what the Trainer passes)."""
    import deepspeed

    optimizer = torch.optim.AdamW(
        model.parameters(), lr=case.lr, eps=case.eps, weight_decay=case.weight_decay
    )
    config = ds_config(case, super_offload=True, world=world)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=config, mpu=mpu
    )
    return engine, optimizer


def _full_masters(engine) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param

    return {
        name: safe_get_full_fp32_param(param).float().cpu().clone()
        for name, param in engine.module.named_parameters()
    }


def _data_parallel_run(case: Zero3Case, rank: int) -> dict:
    """Each rank trains on its own batches; a step's loss is the mean over the ranks."""
    import deepspeed.comm as dist

    engine, optimizer = _engine(build_model(), case, world=WORLD)
    losses, norms = [], []
    for batch in _rank_batches(case, rank):
        batch = {key: value.to(engine.device) for key, value in batch.items()}
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        mean_loss = loss.detach().float().clone()
        dist.all_reduce(mean_loss)
        losses.append(float(mean_loss) / WORLD)
        norms.append(float(engine.get_global_grad_norm()))
    record = {"kind": type(optimizer).__name__, "losses": losses, "norms": norms}
    record["masters"] = _full_masters(engine)
    engine.destroy()
    return record


def _sequence_parallel_run(case: Zero3Case, rank: int) -> dict:
    """Both ranks compute every batch, each on half of its sequence; ``sp_size`` micro steps (one
    batch from each rank) make one optimizer step."""
    import torch.distributed.nn.functional as dist_nn
    from deepspeed.runtime.sequence_parallel.ulysses_sp import (
        UlyssesSPAttentionHF,
        UlyssesSPDataLoaderAdapter,
    )
    from torch.utils.data import DataLoader

    model = build_model()
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model,
        core_attn_implementation=model.config._attn_implementation,  # sdpa
        sequence_parallel_size=SP_SIZE,
        micro_batch_size=case.micro_batch,
        seq_length=SEQ,
    )
    sp_case = case.replace(accumulation=SP_SIZE * case.accumulation)
    engine, optimizer = _engine(model, sp_case, world=WORLD // SP_SIZE, mpu=mpu)
    sp_group = mpu.get_sequence_parallel_group()
    loader = UlyssesSPDataLoaderAdapter(
        DataLoader(_rank_batches(case, rank), batch_size=None),
        sp_rank=mpu.get_sequence_parallel_rank(),
        sp_group=sp_group,
        sp_world_size=SP_SIZE,
        device=engine.device,
    )
    losses, norms, step_loss, shard_lengths = [], [], 0.0, set()
    for micro, shard in enumerate(loader):
        # On CPU the adapter's shards stay slices of the gathered batch: make them contiguous.
        shard = {key: value.to(engine.device).contiguous() for key, value in shard.items()}
        shift_labels = shard["shift_labels"]
        shard_lengths.add(shard["input_ids"].shape[1])
        logits = engine(**shard).logits
        shard_loss = engine.module.loss_function(
            logits=logits, labels=None, shift_labels=shift_labels, vocab_size=VOCAB
        )
        # Mean over all valid tokens of the sequences: each shard's mean weighted by its count.
        shard_losses = dist_nn.all_gather(shard_loss, group=sp_group)
        shard_tokens = dist_nn.all_gather((shift_labels != -100).sum(), group=sp_group)
        loss = sum(mean * n for mean, n in zip(shard_losses, shard_tokens, strict=True))
        loss = loss / sum(shard_tokens)
        engine.backward(loss)
        engine.step()
        step_loss += float(loss.detach()) / sp_case.accumulation
        if (micro + 1) % sp_case.accumulation == 0:
            losses.append(step_loss)
            norms.append(float(engine.get_global_grad_norm()))
            step_loss = 0.0
    record = {"kind": type(optimizer).__name__, "losses": losses, "norms": norms}
    record.update(masters=_full_masters(engine), shard_lengths=shard_lengths)
    engine.destroy()
    return record


def _both_on_rank(rank: int, port: int, case: Zero3Case, out_dir: str) -> None:
    init_rank(rank, WORLD, port)
    torch.set_num_threads(1)
    import hf_superoffload  # noqa: F401  (activates the ZeRO-3 path)

    # Data parallel first: registering Ulysses replaces the attention function process-wide.
    results = {"data_parallel": _data_parallel_run(case, rank)}
    results["sequence_parallel"] = _sequence_parallel_run(case, rank)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def _assert_sequence_parallel_follows_data_parallel(case: Zero3Case, tmp_path) -> None:
    tolerances = BF16_TOLERANCES if case.bf16 else FP32_TOLERANCES
    spawn_ranks(_both_on_rank, (free_port(), case, str(tmp_path)), WORLD)
    for rank in range(WORLD):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        dp, sp = result["data_parallel"], result["sequence_parallel"]
        assert dp["kind"] == sp["kind"] == "SuperOffloadZero3Optimizer"
        assert len(sp["losses"]) == len(dp["losses"]) == case.steps, f"rank {rank}"
        assert sp["shard_lengths"] == {SEQ // SP_SIZE}, "each rank computed half a sequence"
        for key in ("losses", "norms"):
            torch.testing.assert_close(
                torch.tensor(sp[key]),
                torch.tensor(dp[key]),
                **tolerances[key],
                msg=lambda m, r=rank, k=key: f"rank {r}: {k}: {m}",
            )
        if "masters" in tolerances:
            assert sp["masters"].keys() == dp["masters"].keys()
            for name, master in sp["masters"].items():
                torch.testing.assert_close(
                    master, dp["masters"][name], **tolerances["masters"], msg=name
                )


@pytest.mark.parametrize(
    "bf16",
    [
        pytest.param(False, id="fp32", marks=pytest.mark.slow),
        pytest.param(
            True,
            id="bf16-2gpu",
            marks=[
                pytest.mark.multi_gpu,
                pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
            ],
        ),
    ],
)
def test_ulysses_sp2_follows_data_parallel_on_the_same_sequences(bf16, tmp_path):
    # Clipping (max_grad_norm 1.0, norms 0.9 to 1.4) is active on most steps: a wrong gradient
    # scale would show in the norms, as clipped Adam steps hide it from the losses.
    case = Zero3Case(steps=4, bf16=bf16)
    _assert_sequence_parallel_follows_data_parallel(case, tmp_path)
