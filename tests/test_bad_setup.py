"""Bad input beyond the optimizer's options (those are in test_bad_input.py): unknown keyword
arguments, fp16 params without a loss scaler, tied weights, DeepSpeed configs that set
``super_offload`` off stage 3 or keys nothing reads, and a multi-process launch without the
GPUs for it. Each is a clear error or a documented, tested behaviour (docs/troubleshooting.md).
"""

from __future__ import annotations

import json
import logging
import re
import types

import pytest
import torch
from accelerate.utils import DistributedType

from hf_superoffload import SuperOffloadOptimizer
from hf_superoffload.engine.checks import FP16_WARNING, refuse_unknown_kwargs
from hf_superoffload.integrations import checks as trainer_checks
from hf_superoffload.zero3.config import refuse_super_offload_below_stage3
from hf_superoffload.zero3.options import warn_unused_offload_keys

KNOWN = ("lr", "betas", "eps", "weight_decay", "gpu_tail", "bucket_size", "cpu_threads")


# --- unknown keyword arguments ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "suggestion"),
    [("gpu_tial", "gpu_tail"), ("bucketsize", "bucket_size"), ("weight_decy", "weight_decay")],
)
def test_unknown_kwarg_names_the_closest_known_one(given, suggestion):
    with pytest.raises(TypeError) as err:
        refuse_unknown_kwargs({"lr": 1e-3, given: 3}, KNOWN, "SuperOffloadOptimizer")
    assert str(err.value) == (
        f"SuperOffloadOptimizer() got an unexpected keyword argument {given!r}; did you mean "
        f"{suggestion!r}?"
    )


def test_unknown_kwarg_far_from_every_name_lists_them():
    with pytest.raises(TypeError, match=r"'nesterov'; it takes betas, bucket_size, cpu_threads"):
        refuse_unknown_kwargs({"nesterov": True}, KNOWN, "SuperOffloadOptimizer")


def test_known_kwargs_pass():
    refuse_unknown_kwargs({"lr": 1e-3, "gpu_tail": 0}, KNOWN, "SuperOffloadOptimizer")
    refuse_unknown_kwargs({}, KNOWN, "SuperOffloadOptimizer")


# --- fp16 params without a loss scaler --------------------------------------------------------


def _fp16_linear() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(8, 4).half()


def test_fp16_params_warn_that_there_is_no_loss_scaler_and_overflows_skip(caplog):
    """Documented behaviour: fp16 params train (the masters are fp32), with a warning at
    construction; a gradient that overflows fp16 skips the step, counted and logged; the
    model keeps its values."""
    model = _fp16_linear()
    x = torch.randn(16, 8).half()
    with caplog.at_level(logging.WARNING, logger="hf_superoffload"):
        opt = SuperOffloadOptimizer(model.parameters(), lr=1e-2, gpu_tail=0)
    assert [r.getMessage() for r in caplog.records].count(FP16_WARNING) == 1
    with opt:
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        opt.synchronize()
        before = [p.detach().clone() for p in model.parameters()]
        handle = model.weight.register_hook(lambda g: g * 1e6)  # past fp16's 65504: inf
        model(x).float().square().mean().backward()
        handle.remove()
        opt.step()
        opt.zero_grad()
        opt.synchronize()
        assert opt.last_step_skipped and opt.stats["rollbacks_nonfinite"] == 1
        for p, q in zip(model.parameters(), before, strict=True):
            assert torch.equal(p, q)
        assert all(p.dtype == torch.float16 for p in model.parameters())


def test_bf16_and_fp32_params_do_not_warn(caplog):
    for dtype in (torch.float32, torch.bfloat16):
        with caplog.at_level(logging.WARNING, logger="hf_superoffload"):
            SuperOffloadOptimizer(torch.nn.Linear(4, 2).to(dtype).parameters()).close()
    assert FP16_WARNING not in [r.getMessage() for r in caplog.records]


# --- tied weights -----------------------------------------------------------------------------


class TiedLM(torch.nn.Module):
    """An embedding and an output head sharing one weight, as tie_word_embeddings does."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.embed = torch.nn.Embedding(16, 8)
        self.mid = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        logits = self.head(self.mid(self.embed(ids)))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())


def test_tied_weights_get_one_master_and_train_as_adamw():
    """Documented behaviour: a tied tensor is one param (``model.parameters()`` yields it
    once), so it gets one fp32 master and one pair of moments, stepped with the sum of both
    uses' gradients, as AdamW does; both modules keep sharing it."""
    model, ref = TiedLM(), TiedLM()
    ids = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(0))
    opt = SuperOffloadOptimizer(
        model.parameters(), lr=1e-2, eps=1e-6, gpu_tail=0, bucket_size=64, model=model
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-6)
    with opt:
        assert len(opt.trainable_params()) == len(list(model.parameters())) == 3
        for _ in range(4):
            for m, o in ((model, opt), (ref, ref_opt)):
                m(ids).backward()
                if o is ref_opt:
                    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
                o.step()
                o.zero_grad()
        opt.synchronize()
        assert model.head.weight is model.embed.weight
        state = opt.master_state(model.embed.weight)
        want = ref_opt.state[ref.embed.weight]
        torch.testing.assert_close(state["master"], ref.embed.weight, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(state["exp_avg"], want["exp_avg"], rtol=1e-5, atol=1e-8)
        torch.testing.assert_close(state["exp_avg_sq"], want["exp_avg_sq"], rtol=1e-5, atol=1e-10)
        assert state["step"] == 4
        # One state dict entry for the tied tensor, as torch's AdamW writes.
        assert len(opt.state_dict()["state"]) == len(ref_opt.state_dict()["state"]) == 3


# --- DeepSpeed configs ------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_super_offload_below_stage3_is_refused_with_what_to_set(stage):
    with pytest.raises(ValueError, match=rf'stage 3 only.*has stage {stage}.*"stage": 3'):
        refuse_super_offload_below_stage3(stage, True)
    refuse_super_offload_below_stage3(stage, False)  # plain ZeRO-Offload stays allowed
    refuse_super_offload_below_stage3(3, True)


def test_offload_keys_nothing_reads_are_named_in_a_warning(caplog):
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig

    used = DeepSpeedZeroOffloadOptimizerConfig(
        device="cpu", pin_memory=True, ratio=0.9, super_offload=True, cpuadam_cores_perc=0.5
    )
    unused = DeepSpeedZeroOffloadOptimizerConfig(
        device="cpu", super_offload=True, buffer_count=8, pipeline_read=True
    )
    with caplog.at_level(logging.WARNING, logger="hf_superoffload"):
        warn_unused_offload_keys(used)
        assert not caplog.records
        warn_unused_offload_keys(unused)
    (record,) = caplog.records
    assert "['buffer_count', 'pipeline_read'] have no effect with super_offload" in (
        record.getMessage()
    )


# --- a multi-process launch without the GPUs for it -------------------------------------------


def _launched(monkeypatch, world: int, local: int, gpus: int) -> None:
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
    monkeypatch.setattr(trainer_checks.torch.cuda, "device_count", lambda: gpus)


def test_processes_that_each_train_alone_are_refused(monkeypatch):
    """accelerate launch --multi_gpu --num_processes 2 on a machine without GPUs: each of the
    two processes finds no group to join (distributed type NO, one process)."""
    _launched(monkeypatch, world=2, local=2, gpus=0)
    with pytest.raises(
        RuntimeError, match=r"one of 2 .*WORLD_SIZE=2.*one of 1 .*--num_processes 1.*--use_cpu true"
    ):
        trainer_checks.check_launch_matches_devices(DistributedType.NO, 1)


def test_more_processes_per_host_than_gpus_are_refused(monkeypatch):
    _launched(monkeypatch, world=4, local=4, gpus=2)
    with pytest.raises(RuntimeError, match=r"LOCAL_WORLD_SIZE=4.*2 CUDA device.*--num_processes 2"):
        trainer_checks.check_launch_matches_devices(DistributedType.MULTI_GPU, 4)


def test_matching_launches_pass(monkeypatch):
    _launched(monkeypatch, world=2, local=2, gpus=2)
    trainer_checks.check_launch_matches_devices(DistributedType.MULTI_GPU, 2)
    _launched(monkeypatch, world=2, local=2, gpus=0)  # gloo data parallelism on CPU
    trainer_checks.check_launch_matches_devices(DistributedType.MULTI_CPU, 2)
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    trainer_checks.check_launch_matches_devices(DistributedType.NO, 1)


def test_the_trainer_check_runs_the_launch_check(monkeypatch):
    _launched(monkeypatch, world=2, local=2, gpus=0)
    trainer = types.SimpleNamespace(
        accelerator=types.SimpleNamespace(distributed_type=DistributedType.NO, num_processes=1),
        args=types.SimpleNamespace(fp16=False),
    )
    with pytest.raises(RuntimeError, match="would train the whole job alone"):
        trainer_checks.check_supported(trainer)


def _deepspeed_refusals(rank: int, port: int, out_path: str) -> None:
    """Two plain ``deepspeed.initialize`` calls in one process (DeepSpeed's import is the
    slow part): ``super_offload`` on stage 2, and on stage 3 with host memory faked short."""
    from zero3_reference import Zero3Case, build_model, ds_config, init_rank

    init_rank(rank, 1, port)
    import deepspeed
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    import hf_superoffload  # noqa: F401  (activates the ZeRO-3 path and the stage check)
    from hf_superoffload.engine import host_memory

    def initialize(stage: int) -> str:
        config = ds_config(Zero3Case(), True, 1)
        config["zero_optimization"]["stage"] = stage
        model = build_model()
        try:
            deepspeed.initialize(
                model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config
            )
        except (ValueError, MemoryError) as error:
            return f"{type(error).__name__}: {error}"
        return "initialized"

    outcomes = {"stage 2": initialize(2)}

    def allocates(*args, **kwargs):
        raise AssertionError("DeepSpeed's optimizer was built (it allocates the host state)")

    host_memory.host_memory_available = lambda: (100_000, "a test's figure")  # under the model
    DeepSpeedZeroOptimizer_Stage3.__init__ = allocates
    outcomes["short host"] = initialize(3)
    with open(out_path, "w") as f:
        json.dump(outcomes, f)


def test_deepspeed_initialize_refusals(tmp_path):
    """Under a plain ``deepspeed.initialize`` (no Trainer): DeepSpeed would drop the flag on
    stage 2 and run ZeRO-Offload, and would allocate a host state that cannot fit; with
    hf_superoffload imported both are refused, the second before anything is allocated."""
    from ranks import spawn_ranks
    from zero3_reference import free_port

    out = tmp_path / "outcomes.json"
    spawn_ranks(_deepspeed_refusals, (free_port(), str(out)), 1, timeout=300)
    outcomes = json.loads(out.read_text())
    assert (
        "runs on ZeRO stage 3 only, and this DeepSpeed config has stage 2" in (outcomes["stage 2"])
    )
    short = outcomes["short host"]
    assert short.startswith("HostMemoryError: the optimizer's host state needs"), short
    assert re.search(r"x 1 rank\(s\) on this host .* only 0\.00 GiB is available", short)
    assert '"ratio" below 1' in short and "fewer GPUs per host" in short


def test_no_gpu_at_all_says_to_use_a_gpu_machine_or_a_cpu_config(monkeypatch):
    _launched(monkeypatch, world=2, local=2, gpus=0)
    with pytest.raises(
        RuntimeError, match=r"0 CUDA device.*machine with GPUs, or use a CPU config"
    ):
        trainer_checks.check_launch_matches_devices(DistributedType.MULTI_GPU, 2)


def test_without_a_launcher_the_per_host_check_does_not_apply(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(trainer_checks.torch.cuda, "device_count", lambda: 0)
    trainer_checks.check_launch_matches_devices(DistributedType.MULTI_GPU, 1)
