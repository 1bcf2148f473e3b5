"""The ZeRO-3 path's memory plan: its host side equals what the optimizer allocates and its GPU
tail the sub groups the optimizer keeps there (tests/test_zero3_sub_group_cut.py builds both on
CPU); at every point measured (docs/benchmarks.md) it predicts the peaks within 5%; it counts
a resume; and it says which runs do not fit, and why."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import transformers

from hf_superoffload.zero3.loss_memory import LIGER_MODEL_TYPES, liger_loss_bytes, trl_loss_bytes
from hf_superoffload.zero3.memory_plan import (
    HOST_HEADROOM,
    Zero3Run,
    resume_extra_host_bytes,
    zero3_memory_plan,
)
from hf_superoffload.zero3.model_shape import ModelShape
from hf_superoffload.zero3.save_memory import STREAMED_SHARD_BYTES
from hf_superoffload.zero3.sub_group_cut import DEEPSPEED_PERSISTENCE_THRESHOLD

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
H100_GPU, H100_HOST = int(79.18 * GIB), int(125 * GIB)  # what torch and free(1) report there


def _config(name: str):
    if name == "3b":
        return transformers.LlamaConfig(  # the DESIGN.md 3.0B point (benchmarks/train_step.py)
            hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
            num_attention_heads=24, num_key_value_heads=24, vocab_size=32000,
            max_position_embeddings=4096, tie_word_embeddings=False,
        )  # fmt: skip
    values = json.loads((ROOT / f"hf_superoffload/model_configs/{name}.json").read_text())
    values = {k: v for k, v in values.items() if not k.startswith("_")}
    values.pop("quantization_config", None)
    return transformers.AutoConfig.for_model(values.pop("model_type"), **values)


_SHAPES: dict[str, ModelShape] = {}


def _plan(name: str, **run):
    config = _config(name)
    shape = _SHAPES.setdefault(name, ModelShape.of(config))
    return zero3_memory_plan(config, Zero3Run(seq=4096, batch=4, **run), shape)


# Peaks measured at seq 4096, batch 4 with benchmarks/suite.py, whose DeepSpeed config has one
# param group (model.parameters()) and DeepSpeed's persistence threshold: (model, GPUs,
# ratio) -> (peak torch-allocated GPU GiB of a rank, peak host RSS GiB of a rank).
# One H100 80GB, 128 GiB host: docs/data/suite_zero3_h100_3b_seq4096_g_2026-11-24.csv,
# suite_zero3_ratio_h100_3b_seq4096_2026-11-24.csv (call 4 at 0.6) and _2026-11-25.csv,
# suite_zero3_h100_llama31_8b_seq4096_2026-11-23.csv (1.0) and _2026-11-25.csv (0.9, 0.85).
# 2 x H200, 256 GiB host: docs/data/plan_vs_measured_qwen3_14b_2xh200_2026-11-26.csv.
# 4 x H200, 512 GiB host: docs/data/scaling_h200x4_3b_seq4096_2026-11-26.csv and
# suite_zero3_h200x4_qwen3-30b-a3b_seq4096_2026-11-26.csv (the largest rank's host RSS).
MEASURED = {
    ("3b", 1, 1.0): (15.26, 46.13),
    ("3b", 1, 0.8): (25.73, 36.99),
    ("3b", 1, 0.6): (35.71, 28.29),
    ("3b", 1, 0.5): (40.35, 24.19),
    ("3b", 1, 0.4): (45.04, 20.07),
    ("3b", 1, 0.3): (50.10, 15.69),
    ("llama-3.1-8b", 1, 1.0): (43.07, 107.09),
    ("llama-3.1-8b", 1, 0.9): (60.65, 91.58),
    ("llama-3.1-8b", 1, 0.85): (65.40, 87.43),
    ("qwen3-14b", 2, 0.85): (70.37, 81.24),
    ("3b", 4, 1.0): (12.43, 13.2),
    ("qwen3-30b-a3b", 4, 0.5): (104.3, 52.3),
}


@pytest.mark.parametrize(("model", "gpus", "ratio"), sorted(MEASURED))
def test_predicts_every_measured_peak_within_five_percent(model, gpus, ratio):
    # Measured with the default cast ("auto": on a GPU the params are cast there, and no
    # copy-out ring is made); a plan without the cast counts the ring, 96 MiB a rank at most.
    plan = _plan(
        model, ranks=gpus, ratio=ratio, decay_groups=False,
        persistence_threshold=DEEPSPEED_PERSISTENCE_THRESHOLD, cast="auto",
    )  # fmt: skip
    gpu, host = MEASURED[model, gpus, ratio]
    assert plan.gpu_bytes / GIB == pytest.approx(gpu, rel=0.05)
    if host is not None:
        assert plan.host_bytes_without_resume / GIB == pytest.approx(host, rel=0.05)
    assert plan.host["param_copy_out"] == 0 and plan.upper_bounds == {}
    unknown = dataclasses.replace(plan.run, cast=None)
    ring = zero3_memory_plan(_config(model), unknown, plan.shape).host["param_copy_out"]
    assert 0 < ring <= 96 * 2**20


def test_predicts_the_recipe_launchers_run_with_trls_fused_head():
    """Llama-3.1-8B through `hf-superoffload finetune` on 2 x H100 (256 GiB host), ratio 0.5,
    nothing saved: the Trainer's param groups and persistence, and TRL's fused LM head, which
    the launcher plans (docs/data/liger_llama31_8b_2xh100_2026-11-26.csv: torch's allocated
    peak of each rank, and the process tree's host memory over both ranks). Counted as the full
    logits, the same run would be planned 20 GiB a rank above what it held."""
    run = {"ranks": 2, "ratio": 0.5, "saves_model": False}
    plan = _plan("llama-3.1-8b", fused_cross_entropy="trl", **run)
    assert plan.gpu_bytes / GIB == pytest.approx(47.45, rel=0.05)
    assert plan.host_training / GIB == pytest.approx(56.47 / 2, rel=0.05)
    full = _plan("llama-3.1-8b", **run)
    assert full.gpu_bytes / GIB > 47.45 * 1.4


def test_trainer_groups_and_persistence_cut_the_dense_models_as_the_benchmark_did():
    # The Trainer's decay / no-decay groups and its "auto" persistence threshold (10 x hidden)
    # put the norms in sub groups of their own, as one group and DeepSpeed's threshold do.
    for name in ("llama-3.1-8b", "qwen3-14b"):
        trainer = _plan(name, ratio=0.85)
        benchmark = _plan(name, ratio=0.85, decay_groups=False, persistence_threshold=10**5)
        assert trainer.split == benchmark.split, name


def test_ratio_keeps_a_share_of_the_sub_groups_and_the_embedding_is_the_first():
    # Llama-3.1-8B: the 525M-element embedding is sub group 0, alone; the first 10% of the 163
    # sub groups hold 14.7% of the params, 17.6 GiB of optimizer state (an element share,
    # what the plan counted before, was 12.0).
    plan = _plan("llama-3.1-8b", ratio=0.9)
    split = plan.split
    assert split.numels[0] == 128256 * 4096 and len(split.numels) == 163
    assert split.device_count == 16 == int(0.1 * 163)
    assert plan.gpu["optimizer_on_gpu"] == 16 * sum(split.numels[:16])
    assert plan.gpu["optimizer_on_gpu"] / GIB == pytest.approx(17.58, abs=0.01)
    assert plan.host["master"] == 4 * (split.partition - split.device_numel)
    # The Trainer's no-decay group, the 65 norms (persistent), is the last sub group.
    assert split.numels[-1] == 65 * 4096


def test_resume_and_save_fit_the_host_that_trained():
    plan = _plan("llama-3.1-8b", ratio=0.85)
    # The optimizer file is mapped and copied a sub group at a time: at most two saved sub
    # groups' masters and moments (12 B/param) beside the live state; here the embedding's.
    largest = plan.split.largest_sub_group
    assert largest == 128256 * 4096
    assert resume_extra_host_bytes(plan.split) == 12 * 2 * largest
    assert plan.host_resume == plan.host_training + resume_extra_host_bytes(plan.split)
    # A save streams the weights: rank 0 holds one shard and one param (the embedding) of them.
    embedding = 2 * 128256 * 4096
    assert plan.host_save == plan.host_training + STREAMED_SHARD_BYTES + embedding
    assert plan.host_bytes == plan.host_resume > plan.host_save > plan.host_bytes_without_resume
    assert plan.host_peak_phase == "resume" and "(the peak)" in plan.table().split("resume")[-1]
    # Measured through the recipe launcher on one H200 (2026-11-26), each run's host peak
    # (anonymous and shared memory of the process tree), every one at a save, when the save
    # gathered the whole bf16 model into rank 0's memory: 102.43, 102.49 and, resumed, 102.42
    # GiB; its mapped checkpoint pages peaked at 5.96 GiB. Training's figure with that gather:
    gathering_save = plan.host_training + 2 * plan.shape.params
    assert gathering_save / GIB == pytest.approx(102.45, rel=0.05)
    # The H100 with its 128 GiB host that trains it can save and resume it (a whole-file
    # load, 12 B per param of the partition beside the live state, could not).
    assert plan.shortfalls(H100_GPU, H100_HOST) == []
    whole_file = plan.host_training + 12 * plan.split.partition
    assert whole_file * (1 + HOST_HEADROOM) > H100_HOST
    (reason,) = plan.shortfalls(H100_GPU, int(plan.host_training * (1 + HOST_HEADROOM)) + GIB)
    assert reason.startswith("host: needs") and "while a checkpoint is loaded" in reason
    # Where the save is the peak (no resume), a host too small for it says so.
    saving = dataclasses.replace(plan, host_resume=0)
    (reason,) = saving.shortfalls(H100_GPU, int(plan.host_save * (1 + HOST_HEADROOM)) - GIB)
    assert "while the model is saved (rank 0 holds a shard of the 16-bit model" in reason


def test_only_rank_0_holds_the_gathered_model_while_saving():
    two = _plan("qwen3-14b", ratio=0.85, ranks=2, ranks_per_host=2)
    saving = two.host_training + two.host_save
    assert two.host_bytes_per_host == max(2 * max(two.host_resume, two.host_start_up), saving)


def test_start_up_exceeds_training_when_nearly_all_state_is_on_the_gpu():
    plan = _plan("3b", ratio=0.1)
    # DeepSpeed's fp32 masters of the whole partition, and its bf16 accumulation buffer only
    # when micro-batches accumulate.
    assert plan.host_start_up == 4 * plan.split.partition + plan.host["process"]
    assert plan.host_bytes_without_resume == plan.host_start_up > plan.host_training
    accumulating = _plan("3b", ratio=0.1, gradient_accumulation=2)
    assert accumulating.host_start_up == 6 * plan.split.partition + plan.host["process"]
    mostly_host = _plan("3b", ratio=0.8)
    assert mostly_host.host_bytes_without_resume == mostly_host.host_training


def test_says_why_a_run_does_not_fit():
    # A quarter of the sub groups' state on the GPU ran out of GPU memory on the H100.
    gpu_short = _plan("llama-3.1-8b", ratio=0.75)
    reasons = gpu_short.shortfalls(H100_GPU, 10 * H100_HOST)
    assert len(reasons) == 1 and reasons[0].startswith("GPU: needs")
    assert "largest part: optimizer_on_gpu" in reasons[0]
    # Accumulating keeps DeepSpeed's accumulation buffer: 2 B/param more while training.
    host_short = _plan("llama-3.1-8b", gradient_accumulation=4)
    training_host = host_short.host_training * 1.05
    (reason,) = host_short.shortfalls(H100_GPU, int(training_host) - 1)
    assert reason.startswith("host: needs") and "smaller model" in reason
    # Two ranks on one host share it; each holds half the state.
    two = _plan("llama-3.1-8b", ranks=2)
    one = _plan("llama-3.1-8b")
    assert two.host["moments"] * 2 == pytest.approx(one.host["moments"], abs=16 * 300)
    assert two.gpu["gathered_params"] > 0 == one.gpu["gathered_params"]


def test_refuses_a_ratio_outside_zero_to_one():
    with pytest.raises(ValueError, match="ratio must be within"):
        zero3_memory_plan(_config("3b"), Zero3Run(seq=16, batch=1, ratio=1.5))


@pytest.mark.parametrize(
    ("name", "width"),
    [
        ("gpt-oss-20b", 4 * 2880),  # top-4 experts, each intermediate_size wide
        ("qwen3-30b-a3b", 8 * 768),  # top-8 experts of moe_intermediate_size (not the dense 6144)
        ("llama-3.1-8b", 14336),  # dense: intermediate_size
    ],
)
def test_recomputed_mlp_is_as_wide_as_the_experts_a_token_goes_through(name, width):
    plan = _plan(name)
    assert plan.shape.active_intermediate == width
    # Three activations of that width (gate, up and their product) per token, in bf16.
    assert plan.gpu["layer_recompute"] == 3 * 2 * 4096 * 4 * width


def test_liger_chunk_follows_its_own_worked_example():
    """Liger's comment on its chunking (fused_linear_cross_entropy.py, 0.8.5): BT = 4096 x 4,
    V = 32000, H = 4096 give 8 chunks of 2048 tokens. The plan holds one chunk's logits, the
    hidden states' and head weight's gradients (bf16) and an fp32 loss a token."""
    expected = 2 * (2048 * 32000 + 16384 * 4096 + 32000 * 4096) + 4 * 16384
    assert liger_loss_bytes(16384, 4096, 32000, 2) == expected
    # 100 tokens there: 8 chunks' worth rounds up to 16 tokens a chunk.
    chunked = 2 * (16 * 32000 + 100 * 4096 + 32000 * 4096) + 400
    assert liger_loss_bytes(100, 4096, 32000, 2) == chunked
    # A vocabulary within C x hidden: one chunk of all the tokens, never more than there are.
    whole = 2 * (100 * 4000 + 100 * 4096 + 4000 * 4096) + 400
    assert liger_loss_bytes(100, 4096, 4000, 2) == whole


def test_trl_fused_head_holds_fp32_gradients_and_one_tile():
    tokens, hidden, vocab = 16384, 5120, 151936
    tile = 2 * 4096 * 32768
    expected = 6 * tokens * hidden + 6 * vocab * hidden + tile
    assert trl_loss_bytes(tokens, hidden, vocab, 2) == expected


def test_a_fused_loss_frees_the_logits_and_changes_nothing_else():
    """Qwen3-14B at seq 4096, batch 4: 27.8 GiB of logits and their fp32 copies a rank, against
    a few GiB for either fused loss; every other part of the plan stays as it was."""
    full = _plan("qwen3-14b")
    assert full.gpu["logits_and_loss"] / GIB == pytest.approx(27.82, abs=0.01)
    for fused, most in (("trl", 5.1), ("liger", 2.0)):
        plan = _plan("qwen3-14b", fused_cross_entropy=fused)
        assert plan.gpu["logits_and_loss"] < most * GIB, fused
        others = {k: v for k, v in plan.gpu.items() if k != "logits_and_loss"}
        assert others == {k: v for k, v in full.gpu.items() if k != "logits_and_loss"}
        assert plan.host == full.host and plan.host_bytes == full.host_bytes


def test_liger_is_refused_for_a_model_it_does_not_patch():
    """Seed-OSS is not among the model types Liger-Kernel 0.8.5 patches."""
    with pytest.raises(ValueError, match="does not patch 'seed_oss'"):
        _plan("seed-oss-36b", fused_cross_entropy="liger")
    assert _plan("seed-oss-36b", fused_cross_entropy="trl").gpu["logits_and_loss"] > 0
    for name in ("llama-3.1-8b", "qwen3-14b", "qwen3-30b-a3b", "phi-4", "gpt-oss-20b"):
        assert _config(name).model_type in LIGER_MODEL_TYPES, name


def test_an_unknown_fused_loss_is_refused():
    with pytest.raises(ValueError, match="fused_cross_entropy must be None"):
        _plan("3b", fused_cross_entropy="cut_cross_entropy")


class _DeepSpeedDataTypes:
    """DeepSpeed's own rule for the gradient accumulation dtype (its engine's methods) over a
    parsed config, without a model."""

    from deepspeed.runtime.engine import DeepSpeedEngine as _Engine

    fp16_enabled = _Engine.fp16_enabled
    bfloat16_enabled = _Engine.bfloat16_enabled
    get_data_types = _Engine.get_data_types

    def __init__(self, bf16: bool, data_types: dict):
        from deepspeed.runtime.config import DeepSpeedConfig

        one = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
        config = {**one, "train_batch_size": 1, "bf16": {"enabled": bf16}}
        self._config = DeepSpeedConfig({**config, "data_types": data_types})


@pytest.mark.parametrize(
    ("bf16", "data_types"),
    [(True, {}), (True, {"grad_accum_dtype": "fp32"}), (False, {}), (True, {"grad_accum_dtype": "bf16"})],
    ids=["bf16", "bf16-fp32-gradients", "fp32", "bf16-bf16-gradients"],
)  # fmt: skip
def test_gradients_and_their_gpu_staging_are_planned_in_deepspeeds_accumulation_dtype(
    bf16, data_types
):
    """The optimizer holds its host gradients, gradient slots and the speculative passes' GPU
    staging (DeviceSpeculation) in DeepSpeed's gradient_accumulation_dtype, which
    data_types.grad_accum_dtype sets: fp32 gradients under bf16 weights take twice the bytes,
    and the plan counts them so."""
    from deepspeed.runtime.config import DtypeEnum

    from hf_superoffload.engine.device_speculation import device_speculation_bytes
    from hf_superoffload.zero3.memory_plan import gradient_dtype

    grads = _DeepSpeedDataTypes(bf16, data_types).get_data_types()[1]
    given = data_types.get("grad_accum_dtype")
    run = dict(
        compact_moments=True,
        dtype_bytes=2 if bf16 else 4,
        grad_accum_dtype=None if given is None else DtypeEnum(given).name,
        gradient_accumulation=2,
    )
    plan = _plan("llama-3.1-8b", **run)
    assert gradient_dtype(plan.run) == grads
    split = plan.split
    staging = device_speculation_bytes(split.largest_host_sub_group, grads)
    assert plan.gpu["compact_speculation"] == staging > 0
    assert plan.host["gradients"] == grads.itemsize * split.host_numel
    assert plan.host["accumulation"] == grads.itemsize * split.partition
    assert json.dumps(dataclasses.asdict(plan.run))  # plan --json prints the run


def test_an_unknown_gradient_dtype_is_refused():
    with pytest.raises(ValueError, match=r"grad_accum_dtype must be None .* got 'int8'"):
        _plan("llama-3.1-8b", grad_accum_dtype="int8")
