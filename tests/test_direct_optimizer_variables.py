"""A SuperOffloadOptimizer built directly (an Accelerate loop, a plain PyTorch loop) resolves its
engine options as the trainers do: a keyword given, else its ``HF_SUPEROFFLOAD_<OPTION>``
variable, else the default. Each variable is honoured, a keyword beats its variable, and a bad
variable is refused with SuperOffloadOptions' error before anything changes (another optimizer
over the same params keeps them and trains on)."""

from __future__ import annotations

import pytest
import torch
from engine_reference import RunConfig, assert_same_trajectory, run_reference, run_superoffload

from hf_superoffload import SuperOffloadOptimizer, SuperOffloadOptions, ops
from hf_superoffload.engine import ownership

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

ENGINE_VARIABLES = [
    "HF_SUPEROFFLOAD_" + name
    for name in (
        "GPU_TAIL", "GPU_TAIL_CAP", "BUCKET_SIZE", "CPU_THREADS", "SPECULATE",
        "SPECULATE_AFTER_CLIP", "CAST", "MOMENTS",
    )
]  # fmt: skip


@pytest.fixture(autouse=True)
def _no_engine_variables(monkeypatch):
    for name in ENGINE_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def _model(dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)).to(dtype)


def _layout(opt: SuperOffloadOptimizer) -> dict:
    """What the engine options decide in a built optimizer: the state's layout and the policy."""
    return {
        "moments": opt.moments,
        "buckets": opt.stats["buckets"],
        "gpu_tail_buckets": opt.stats["gpu_tail_buckets"],
        "gpu_tail_cap": opt.gpu_tail_cap,
        "cpu_adam_threads": ops.get_num_threads(),
        "speculate": opt._stv.speculate,
        "speculate_after_clip": opt._stv.speculate_after_clip,
        "cast": opt._cast,
        "host_bytes": opt.host_bytes(),
    }


def _built_layout(dtype=torch.float32, **kwargs) -> dict:
    model = _model(dtype)
    with SuperOffloadOptimizer(model.parameters(), model=model, **kwargs) as opt:
        return _layout(opt)


# (variable, its value, the keyword that means the same, the layout entry it changes).
EACH_VARIABLE = [
    ("GPU_TAIL", "1", {"gpu_tail": 1}, "gpu_tail_buckets"),
    ("GPU_TAIL_CAP", "2.5", {"gpu_tail_cap": 2.5}, "gpu_tail_cap"),
    ("BUCKET_SIZE", "64", {"bucket_size": 64}, "buckets"),
    ("CPU_THREADS", "3", {"cpu_threads": 3}, "cpu_adam_threads"),
    ("SPECULATE", "false", {"speculate": False}, "speculate"),
    ("SPECULATE_AFTER_CLIP", "true", {"speculate_after_clip": True}, "speculate_after_clip"),
    ("CAST", "gpu", {"cast": "gpu"}, "cast"),
    ("MOMENTS", "compact", {"moments": "compact"}, "host_bytes"),
]


@pytest.mark.parametrize(
    ("variable", "value", "keyword", "changes"), EACH_VARIABLE, ids=[v[0] for v in EACH_VARIABLE]
)
def test_each_variable_acts_as_its_keyword(monkeypatch, variable, value, keyword, changes):
    dtype = torch.bfloat16 if variable == "CAST" else torch.float32  # fp32 params: no cast
    default = _built_layout(dtype)
    by_keyword = _built_layout(dtype, **keyword)
    assert by_keyword[changes] != default[changes]  # the option shows in the layout
    monkeypatch.setenv("HF_SUPEROFFLOAD_" + variable, value)
    assert _built_layout(dtype) == by_keyword


def test_variables_give_the_trajectory_of_adamw(monkeypatch):
    """Small buckets and no speculation from the variables: every step as AdamW's, with the
    layout the keywords give (15 buckets, none speculated)."""
    cfg = RunConfig(steps=6)
    want = run_reference(cfg)
    monkeypatch.setenv("HF_SUPEROFFLOAD_BUCKET_SIZE", "2000")
    monkeypatch.setenv("HF_SUPEROFFLOAD_SPECULATE", "false")
    got = run_superoffload(cfg, bucket_size=None)  # the harness passes bucket_size otherwise
    assert_same_trajectory(got, want)
    assert got.stats["speculative_steps"] == got.stats["speculations_applied"] == 0
    monkeypatch.delenv("HF_SUPEROFFLOAD_SPECULATE")
    by_keyword = run_superoffload(cfg, bucket_size=2000, speculate=False)
    assert got.stats["buckets"] == by_keyword.stats["buckets"] > 1


def test_compact_moments_from_the_variable_equal_the_keywords(monkeypatch):
    """Compact moments are not AdamW's to the ulp; from the variable they are the keyword's
    exactly, step by step."""
    cfg = RunConfig(steps=4)
    by_keyword = run_superoffload(cfg, moments="compact")
    monkeypatch.setenv("HF_SUPEROFFLOAD_MOMENTS", "compact")
    by_variable = run_superoffload(cfg)
    assert by_variable.losses == by_keyword.losses
    for field in ("master", "exp_avg", "exp_avg_sq", "params"):
        ours, theirs = getattr(by_variable, field), getattr(by_keyword, field)
        for name, tensor in theirs.items():
            assert torch.equal(ours[name], tensor), (field, name)


def test_a_keyword_beats_its_variable(monkeypatch):
    default = _built_layout()
    for variable, value, _, _ in EACH_VARIABLE:
        monkeypatch.setenv("HF_SUPEROFFLOAD_" + variable, value)
    explicit = dict(gpu_tail="auto", gpu_tail_cap=None, bucket_size=2**25)
    explicit.update(speculate=True, speculate_after_clip=False, cast="auto", moments="fp32")
    got = _built_layout(**explicit, cpu_threads=default["cpu_adam_threads"])
    # gpu_tail_cap=None is "left out": its variable is read, as SuperOffloadOptions reads it.
    assert got == {**default, "gpu_tail_cap": 2.5}


def test_a_keyword_and_a_variable_that_do_nothing_together_are_refused(monkeypatch):
    monkeypatch.setenv("HF_SUPEROFFLOAD_SPECULATE_AFTER_CLIP", "1")
    model = _model()
    with pytest.raises(ValueError, match="unset HF_SUPEROFFLOAD_SPECULATE_AFTER_CLIP"):
        SuperOffloadOptimizer(model.parameters(), model=model, speculate=False)


BAD_VARIABLES = [
    ("MOMENTS", "int8"),
    ("BUCKET_SIZE", "2**10"),
    ("SPECULATE", "maybe"),
    ("SPECULATE_AFTER_CLIP", "2"),
    ("GPU_TAIL", "-1"),
    ("GPU_TAIL_CAP", "8GiB"),
    ("CPU_THREADS", "0"),
    ("CAST", "host"),
]


@pytest.mark.parametrize(("variable", "value"), BAD_VARIABLES, ids=[v[0] for v in BAD_VARIABLES])
def test_a_bad_variable_is_refused_before_anything_changes(monkeypatch, variable, value):
    """The trainers' error (SuperOffloadOptions'), and the params stay as they were: the
    optimizer that owns them keeps them and steps; with the keyword given the variable is not
    read."""
    model = _model()
    params = list(model.parameters())
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    with SuperOffloadOptimizer(params, lr=1e-2, model=model) as owner:
        before = [p.detach().clone() for p in params]
        monkeypatch.setenv("HF_SUPEROFFLOAD_" + variable, value)
        with pytest.raises(ValueError) as trainers:
            SuperOffloadOptions()
        with pytest.raises(ValueError) as direct:
            SuperOffloadOptimizer(params, lr=1e-2, model=model)
        assert str(direct.value) == str(trainers.value)
        assert f"HF_SUPEROFFLOAD_{variable}" in str(direct.value)
        for param, old in zip(params, before, strict=True):
            assert torch.equal(param, old)
            assert ownership.owner_of(param) is owner
        model(x).square().mean().backward()
        owner.step()  # still its params: not taken over
        owner.synchronize()
        assert not all(torch.equal(p, old) for p, old in zip(params, before, strict=True))
    keyword = next(k for v, _, k, _ in EACH_VARIABLE if v == variable)
    with SuperOffloadOptimizer(params, lr=1e-2, model=model, **keyword) as opt:
        assert all(opt.manages(p) for p in params)


def test_the_standalone_trainer_passes_every_option_it_resolved(tmp_path, monkeypatch):
    """The trainer resolves the options once (its arguments, then the variables) and hands each
    to the optimizer as a keyword: an argument beats a variable there too, and a variable
    reaches the optimizer through the trainer's resolution."""
    from hf_superoffload import SuperOffloadTrainer, SuperOffloadTrainingArguments
    from hf_superoffload.integrations import trainer as trainer_module
    from hf_superoffload.toy import build_tiny_llama

    monkeypatch.setenv("HF_SUPEROFFLOAD_MOMENTS", "compact")
    monkeypatch.setenv("HF_SUPEROFFLOAD_BUCKET_SIZE", "4096")
    monkeypatch.setenv("HF_SUPEROFFLOAD_SPECULATE", "false")
    args = SuperOffloadTrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], bf16=False,
        superoffload_moments="fp32", superoffload_bucket_size=512,
    )  # fmt: skip
    given = {}
    built = trainer_module.SuperOffloadOptimizer

    def spy(*args, **kwargs):
        given.update(kwargs)
        return built(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "SuperOffloadOptimizer", spy)
    trainer = SuperOffloadTrainer(model=build_tiny_llama(), args=args)
    opt = trainer.create_optimizer()
    try:
        resolved = args.superoffload_options().optimizer_kwargs()
        assert {name: given[name] for name in resolved} == resolved
        assert resolved["bucket_size"] == 512 and resolved["speculate"] is False
        assert (opt.moments, opt._stv.speculate) == ("fp32", False)
    finally:
        opt.close()
