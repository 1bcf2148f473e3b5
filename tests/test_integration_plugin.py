"""`SuperOffloadOptions` and the ``superoffload_*``
training-argument fields.

Resolution order for every field: explicit argument > ``HF_SUPEROFFLOAD_<FIELD>`` environment
variable > default. Invalid values (explicit or from the environment) raise ValueError naming
the field and, where the value came from it, the environment variable. The training-argument
classes (Transformers and TRL) carry one ``superoffload_<field>`` per option, parse from the
command line, and build the options the trainer hands to the optimizer. No former name of
them is kept.
"""

from __future__ import annotations

import dataclasses
import inspect
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may touch the network

import pytest
from transformers import HfArgumentParser

import hf_superoffload
from hf_superoffload import (
    SuperOffloadOptimizer,
    SuperOffloadOptions,
    SuperOffloadTrainer,
    SuperOffloadTrainerMixin,
    SuperOffloadTrainingArguments,
)
from hf_superoffload.integrations import plugin
from hf_superoffload.integrations.arguments import SuperOffloadArgumentsMixin
from hf_superoffload.toy import build_tiny_llama

FIELDS = [f.name for f in dataclasses.fields(SuperOffloadOptions)]
DEFAULTS = {
    "gpu_tail": "auto",
    "bucket_size": 1 << 25,
    "cpu_threads": None,
    "speculate": True,
    "speculate_after_clip": False,
    "cast": "auto",
    "moments": "fp32",
    "gpu_tail_cap": None,
}
# Per field: (explicit value, env string, what the env string resolves to).
CASES = {
    "gpu_tail": (2, "5", 5),
    "bucket_size": (4096, "1000", 1000),
    "cpu_threads": (3, "7", 7),
    "speculate": (True, "false", False),
    "speculate_after_clip": (False, "yes", True),
    "cast": ("gpu", "cpu", "cpu"),
    "moments": ("fp32", "compact", "compact"),
    "gpu_tail_cap": (12.5, "40", 40.0),
}


def _env_name(field: str) -> str:
    return "HF_SUPEROFFLOAD_" + field.upper()


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """No HF_SUPEROFFLOAD_* variable of the calling shell leaks into these tests."""
    for name in list(os.environ):
        if name.startswith("SUPEROFFLOAD_") or name in map(_env_name, FIELDS):
            monkeypatch.delenv(name)


def _training_args(tmp_path, cls=SuperOffloadTrainingArguments, **kwargs):
    return cls(output_dir=str(tmp_path), use_cpu=True, report_to=[], bf16=False, **kwargs)


# ------------------------------------------------------------------------------- resolution


def test_fields_and_cases_cover_every_option():
    assert set(FIELDS) == set(DEFAULTS) == set(CASES)
    for field in dataclasses.fields(SuperOffloadOptions):
        assert field.default is None, field.name  # None means "not given": env, then default
        assert _env_name(field.name) in field.metadata["help"], field.name  # documented


def test_defaults():
    options = SuperOffloadOptions()
    assert {name: getattr(options, name) for name in FIELDS} == DEFAULTS


@pytest.mark.parametrize("field", list(CASES))
def test_env_overrides_default(monkeypatch, field):
    _, env_value, resolved = CASES[field]
    monkeypatch.setenv(_env_name(field), env_value)
    options = SuperOffloadOptions()
    assert getattr(options, field) == resolved
    for other in FIELDS:  # the other fields keep their defaults
        if other != field:
            assert getattr(options, other) == DEFAULTS[other], other


@pytest.mark.parametrize("field", list(CASES))
def test_explicit_overrides_env(monkeypatch, field):
    explicit, env_value, resolved = CASES[field]
    assert explicit != resolved  # otherwise the test could not tell which one won
    monkeypatch.setenv(_env_name(field), env_value)
    assert getattr(SuperOffloadOptions(**{field: explicit}), field) == explicit


@pytest.mark.parametrize(
    ("field", "falsy"),
    [
        ("speculate", False),
        ("speculate_after_clip", False),
        ("gpu_tail", 0),
        ("gpu_tail_cap", 0.0),
    ],
)
def test_explicit_falsy_values_win(monkeypatch, field, falsy):
    """False and 0 are values, not "unset": they must beat the environment."""
    monkeypatch.setenv(_env_name(field), "true" if isinstance(falsy, bool) else "4")
    assert getattr(SuperOffloadOptions(**{field: falsy}), field) == falsy


def test_all_env_vars_at_once(monkeypatch):
    # Speculation off with speculate_after_clip on is refused (test_option_precedence_and_pairs).
    cases = {field: case for field, case in CASES.items() if field != "speculate_after_clip"}
    for field, (_, env_value, _) in cases.items():
        monkeypatch.setenv(_env_name(field), env_value)
    options = SuperOffloadOptions()
    assert {name: getattr(options, name) for name in cases} == {
        field: resolved for field, (_, _, resolved) in cases.items()
    }


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", "yes", "on", "0", "false", "No", "OFF"])
def test_bool_env_spellings(monkeypatch, raw):
    monkeypatch.setenv("HF_SUPEROFFLOAD_SPECULATE", raw)
    assert SuperOffloadOptions().speculate is (raw.lower() in ("1", "true", "yes", "on"))


def test_gpu_tail_auto_and_numeric_strings(monkeypatch):
    assert SuperOffloadOptions(gpu_tail="auto").gpu_tail == "auto"
    assert SuperOffloadOptions(gpu_tail="3").gpu_tail == 3
    assert SuperOffloadOptions(gpu_tail=0).gpu_tail == 0
    monkeypatch.setenv("HF_SUPEROFFLOAD_GPU_TAIL", "auto")
    assert SuperOffloadOptions().gpu_tail == "auto"


# ---------------------------------------------------------------------------- invalid values


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bucket_size": -1}, "bucket_size"),
        ({"bucket_size": 1.5}, "bucket_size"),
        ({"bucket_size": "many"}, "bucket_size"),
        ({"bucket_size": True}, "bucket_size"),
        ({"gpu_tail": -1}, "gpu_tail"),
        ({"gpu_tail": "-2"}, "gpu_tail"),
        ({"gpu_tail": "all"}, "gpu_tail"),
        ({"gpu_tail": 1.0}, "gpu_tail"),
        ({"gpu_tail": True}, "gpu_tail"),
        ({"cpu_threads": 0}, "cpu_threads"),
        ({"cpu_threads": "two"}, "cpu_threads"),
        ({"speculate": "yes"}, "speculate"),
        ({"speculate_after_clip": 1}, "speculate_after_clip"),
        ({"cast": "bf16"}, "cast"),
        ({"cast": "GPU"}, "cast"),
        ({"moments": "8bit"}, "moments"),
        ({"gpu_tail_cap": -1}, "gpu_tail_cap"),
        ({"gpu_tail_cap": "lots"}, "gpu_tail_cap"),
        ({"gpu_tail_cap": float("nan")}, "gpu_tail_cap"),
        ({"gpu_tail_cap": float("inf")}, "gpu_tail_cap"),
        ({"gpu_tail_cap": True}, "gpu_tail_cap"),
    ],
)
def test_invalid_explicit_values_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SuperOffloadOptions(**kwargs)


@pytest.mark.parametrize(
    ("field", "invalid", "env_value"),
    [("bucket_size", 0, "2048"), ("cast", "", "cpu")],
    ids=["bucket_size=0", "cast=''"],
)
def test_explicit_falsy_invalid_values_raise(monkeypatch, field, invalid, env_value):
    """An explicit invalid value must raise, not be replaced by the env var or the default.

    Fails at the time of writing: ``SuperOffloadOptions.__post_init__`` resolves these two
    fields with ``self.bucket_size or _env(...)`` / ``self.cast or _env(...)``, so an explicit
    0 (or "") counts as "not given": ``bucket_size=0`` silently becomes 2**25, or the env value.
    """
    with pytest.raises(ValueError, match=field):
        SuperOffloadOptions(**{field: invalid})
    monkeypatch.setenv(_env_name(field), env_value)
    with pytest.raises(ValueError, match=field):
        SuperOffloadOptions(**{field: invalid})


@pytest.mark.parametrize(
    ("field", "raw"),
    [
        ("bucket_size", "-5"),
        ("bucket_size", "0"),
        ("bucket_size", "1e6"),
        ("bucket_size", "lots"),
        ("gpu_tail", "-1"),
        ("gpu_tail", "some"),
        ("cpu_threads", "0"),
        ("cpu_threads", "x"),
        ("speculate", "maybe"),
        ("speculate_after_clip", "2"),
        ("cast", "fp8"),
        ("moments", "int8"),
        ("gpu_tail_cap", "-0.5"),
        ("gpu_tail_cap", "40GiB"),
    ],
)
def test_invalid_env_values_raise(monkeypatch, field, raw):
    monkeypatch.setenv(_env_name(field), raw)
    with pytest.raises(ValueError, match=f"(?i){field}") as error:  # field or env var name
        SuperOffloadOptions()
    if not raw.lstrip("-").isdigit():  # a malformed value: the message says where it came from
        assert _env_name(field) in str(error.value)


def test_from_dict():
    options = SuperOffloadOptions.from_dict({"bucket_size": 2048, "cast": "cpu"})
    assert options.bucket_size == 2048 and options.cast == "cpu"
    assert options.speculate is True  # the rest resolved as usual
    with pytest.raises(ValueError, match="bucket_sise") as error:
        SuperOffloadOptions.from_dict({"bucket_sise": 2048, "cast": "cpu"})
    assert "bucket_size" in str(error.value)  # and lists the valid names


def test_optimizer_kwargs_match_the_optimizer_signature():
    kwargs = SuperOffloadOptions().optimizer_kwargs()
    assert set(kwargs) == set(FIELDS)
    params = inspect.signature(SuperOffloadOptimizer.__init__).parameters
    for name in kwargs:
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name
    # None (the default) means no cap, on both sides.
    assert kwargs["gpu_tail_cap"] is None and params["gpu_tail_cap"].default is None
    assert SuperOffloadOptions(gpu_tail_cap=20).optimizer_kwargs()["gpu_tail_cap"] == 20.0


# ------------------------------------------------------------------------------- the old name


def test_no_former_name_is_kept(tmp_path):
    """0.1.0 is the first release: SuperOffloadPlugin (SuperOffloadOptions' first name) and
    the trainer's superoffload_plugin argument are gone, not aliases that warn."""
    with pytest.raises(AttributeError, match="SuperOffloadPlugin"):
        hf_superoffload.SuperOffloadPlugin  # noqa: B018
    assert not hasattr(plugin, "SuperOffloadPlugin")
    args = _training_args(tmp_path, superoffload_cast="cpu")
    assert args.superoffload_options() == SuperOffloadOptions(cast="cpu")
    assert not hasattr(args, "superoffload_plugin")
    params = inspect.signature(SuperOffloadTrainerMixin.__init__).parameters
    assert "superoffload_plugin" not in params


# ------------------------------------------------------------------------ training arguments


def _argument_fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.name.startswith("superoffload_")}


def test_arguments_mirror_the_option_fields():
    expected = {"superoffload_" + name for name in FIELDS} | {"superoffload_save_dtype"}
    assert _argument_fields(SuperOffloadArgumentsMixin) == expected
    assert _argument_fields(SuperOffloadTrainingArguments) == expected
    for field in dataclasses.fields(SuperOffloadArgumentsMixin):
        assert field.default is None and field.metadata["help"], field.name


def test_training_arguments_build_the_options(tmp_path, monkeypatch):
    args = _training_args(tmp_path, superoffload_gpu_tail="3")
    options = args.superoffload_options()
    assert isinstance(options, SuperOffloadOptions)
    assert options.gpu_tail == 3
    assert {name: getattr(options, name) for name in FIELDS if name != "gpu_tail"} == {
        name: value for name, value in DEFAULTS.items() if name != "gpu_tail"
    }

    # Unset arguments fall back to the environment; set ones beat it.
    monkeypatch.setenv("HF_SUPEROFFLOAD_CAST", "cpu")
    monkeypatch.setenv("HF_SUPEROFFLOAD_BUCKET_SIZE", "777")
    options = _training_args(tmp_path, superoffload_bucket_size=4096).superoffload_options()
    assert options.cast == "cpu" and options.bucket_size == 4096

    with pytest.raises(ValueError, match="gpu_tail"):
        _training_args(tmp_path, superoffload_gpu_tail="-1").superoffload_options()


def test_hf_argument_parser(tmp_path):
    parser = HfArgumentParser(SuperOffloadTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(
        [
            "--output_dir",
            str(tmp_path),
            "--use_cpu",
            "--report_to",
            "none",
            "--superoffload_cast",
            "cpu",
            "--superoffload_bucket_size",
            "1000",
            "--superoffload_speculate",
            "false",
        ]
    )
    assert isinstance(args, SuperOffloadTrainingArguments)
    assert args.superoffload_cast == "cpu"
    assert args.superoffload_bucket_size == 1000
    assert args.superoffload_speculate is False
    assert args.superoffload_gpu_tail is None
    options = args.superoffload_options()
    assert (options.cast, options.bucket_size, options.speculate) == ("cpu", 1000, False)
    assert options.gpu_tail == "auto"


# TRL's configs default the deprecated `gradient_checkpointing` to True (TRL's own business).
@pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("config_name", ["SuperOffloadSFTConfig", "SuperOffloadDPOConfig"])
def test_trl_configs_carry_the_same_fields(tmp_path, config_name):
    import trl

    import hf_superoffload

    cls = getattr(hf_superoffload, config_name)
    base = getattr(trl, config_name.removeprefix("SuperOffload"))
    assert issubclass(cls, base)
    assert _argument_fields(cls) == _argument_fields(SuperOffloadTrainingArguments)
    args = _training_args(tmp_path, cls, superoffload_gpu_tail="2", superoffload_cast="gpu")
    options = args.superoffload_options()
    assert (options.gpu_tail, options.cast) == (2, "gpu")

    parser = HfArgumentParser(cls)
    (parsed,) = parser.parse_args_into_dataclasses(
        [
            *("--output_dir", str(tmp_path), "--use_cpu", "--bf16", "false"),
            *("--superoffload_bucket_size", "1000", "--superoffload_cpu_threads", "2"),
        ]
    )
    assert parsed.superoffload_options().bucket_size == 1000
    assert parsed.superoffload_options().cpu_threads == 2


def test_gpu_tail_cap_argument(tmp_path, monkeypatch):
    parser = HfArgumentParser(SuperOffloadTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "--superoffload_gpu_tail_cap", "12.5"]
    )
    assert args.superoffload_options().gpu_tail_cap == 12.5
    with pytest.raises(ValueError, match="gpu_tail_cap must be a number of GiB >= 0"):
        _training_args(tmp_path, superoffload_gpu_tail_cap=-1.0)
    # DeepSpeed ZeRO-3 takes the GPU's share from its config: the argument is refused there,
    # whether the config comes as an argument or from `accelerate launch`.
    with pytest.raises(ValueError, match=r"offload_optimizer\.ratio"):
        _training_args(tmp_path, superoffload_gpu_tail_cap=8.0, deepspeed={"train_batch_size": 1})
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ValueError, match=r"offload_optimizer\.ratio"):
        _training_args(tmp_path, superoffload_gpu_tail_cap=8.0)


def test_the_trainer_hands_the_gpu_tail_cap_to_the_optimizer(tmp_path):
    args = _training_args(tmp_path, superoffload_gpu_tail_cap=3.5, superoffload_bucket_size=4096)
    trainer = SuperOffloadTrainer(model=build_tiny_llama(), args=args)
    trainer.create_optimizer()
    try:
        assert trainer.superoffload_optimizer.gpu_tail_cap == 3.5
    finally:
        trainer.superoffload_optimizer.close()


def test_trainer_takes_options_one_way_not_both(tmp_path):
    """The arguments' superoffload_* fields, or superoffload_options: each alone is used; both
    given is refused (the fields would be dropped without a word)."""
    args = _training_args(tmp_path, superoffload_bucket_size=1 << 20, superoffload_cast="cpu")
    model = build_tiny_llama()
    assert SuperOffloadTrainer(model=model, args=args)._resolved_options().bucket_size == 1 << 20
    options = SuperOffloadOptions(bucket_size=512, cast="gpu")
    with pytest.raises(ValueError, match="superoffload_bucket_size, superoffload_cast: give"):
        SuperOffloadTrainer(model=model, args=args, superoffload_options=options)
    trainer = SuperOffloadTrainer(
        model=model, args=_training_args(tmp_path / "plain"), superoffload_options=options
    )
    assert trainer._resolved_options() is options
