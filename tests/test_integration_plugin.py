"""`SuperOffloadPlugin` and the ``superoffload_*`` training-argument fields.

Resolution order for every field: explicit argument > ``SUPEROFFLOAD_<FIELD>`` environment
variable > default. Invalid values (explicit or from the environment) raise ValueError naming
the field and, where the value came from it, the environment variable. The training-argument
classes (Transformers and TRL) carry one ``superoffload_<field>`` per plugin field, parse from
the command line, and build the plugin the trainer hands to the optimizer.
"""

from __future__ import annotations

import dataclasses
import inspect
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may touch the network

import pytest
from transformers import HfArgumentParser

from hf_superoffload import (
    SuperOffloadOptimizer,
    SuperOffloadPlugin,
    SuperOffloadTrainer,
    SuperOffloadTrainingArguments,
)
from hf_superoffload.integrations.arguments import SuperOffloadArgumentsMixin
from hf_superoffload.toy import build_tiny_llama

FIELDS = [f.name for f in dataclasses.fields(SuperOffloadPlugin)]
DEFAULTS = {
    "gpu_buckets": "auto",
    "bucket_size": 1 << 25,
    "cpu_threads": None,
    "speculate": True,
    "speculate_after_clip": False,
    "cast": "auto",
}
# Per field: (explicit value, env string, what the env string resolves to).
CASES = {
    "gpu_buckets": (2, "5", 5),
    "bucket_size": (4096, "1000", 1000),
    "cpu_threads": (3, "7", 7),
    "speculate": (True, "false", False),
    "speculate_after_clip": (False, "yes", True),
    "cast": ("gpu", "cpu", "cpu"),
}


def _env_name(field: str) -> str:
    return "SUPEROFFLOAD_" + field.upper()


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """No SUPEROFFLOAD_* variable of the calling shell leaks into these tests."""
    for name in list(os.environ):
        if name.startswith("SUPEROFFLOAD_"):
            monkeypatch.delenv(name)


def _training_args(tmp_path, cls=SuperOffloadTrainingArguments, **kwargs):
    return cls(output_dir=str(tmp_path), use_cpu=True, report_to=[], bf16=False, **kwargs)


# ------------------------------------------------------------------------------- resolution


def test_fields_and_cases_cover_every_plugin_field():
    assert set(FIELDS) == set(DEFAULTS) == set(CASES)
    for field in dataclasses.fields(SuperOffloadPlugin):
        assert field.default is None, field.name  # None means "not given": env, then default
        assert _env_name(field.name) in field.metadata["help"], field.name  # documented


def test_defaults():
    plugin = SuperOffloadPlugin()
    assert {name: getattr(plugin, name) for name in FIELDS} == DEFAULTS


@pytest.mark.parametrize("field", list(CASES))
def test_env_overrides_default(monkeypatch, field):
    _, env_value, resolved = CASES[field]
    monkeypatch.setenv(_env_name(field), env_value)
    plugin = SuperOffloadPlugin()
    assert getattr(plugin, field) == resolved
    for other in FIELDS:  # the other fields keep their defaults
        if other != field:
            assert getattr(plugin, other) == DEFAULTS[other], other


@pytest.mark.parametrize("field", list(CASES))
def test_explicit_overrides_env(monkeypatch, field):
    explicit, env_value, resolved = CASES[field]
    assert explicit != resolved  # otherwise the test could not tell which one won
    monkeypatch.setenv(_env_name(field), env_value)
    assert getattr(SuperOffloadPlugin(**{field: explicit}), field) == explicit


@pytest.mark.parametrize(
    ("field", "falsy"),
    [("speculate", False), ("speculate_after_clip", False), ("gpu_buckets", 0)],
)
def test_explicit_falsy_values_win(monkeypatch, field, falsy):
    """False and 0 are values, not "unset": they must beat the environment."""
    monkeypatch.setenv(_env_name(field), "true" if isinstance(falsy, bool) else "4")
    assert getattr(SuperOffloadPlugin(**{field: falsy}), field) == falsy


def test_all_env_vars_at_once(monkeypatch):
    for field, (_, env_value, _) in CASES.items():
        monkeypatch.setenv(_env_name(field), env_value)
    plugin = SuperOffloadPlugin()
    assert {name: getattr(plugin, name) for name in FIELDS} == {
        field: resolved for field, (_, _, resolved) in CASES.items()
    }


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", "yes", "on", "0", "false", "No", "OFF"])
def test_bool_env_spellings(monkeypatch, raw):
    monkeypatch.setenv("SUPEROFFLOAD_SPECULATE", raw)
    assert SuperOffloadPlugin().speculate is (raw.lower() in ("1", "true", "yes", "on"))


def test_gpu_buckets_auto_and_numeric_strings(monkeypatch):
    assert SuperOffloadPlugin(gpu_buckets="auto").gpu_buckets == "auto"
    assert SuperOffloadPlugin(gpu_buckets="3").gpu_buckets == 3
    assert SuperOffloadPlugin(gpu_buckets=0).gpu_buckets == 0
    monkeypatch.setenv("SUPEROFFLOAD_GPU_BUCKETS", "auto")
    assert SuperOffloadPlugin().gpu_buckets == "auto"


# ---------------------------------------------------------------------------- invalid values


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"bucket_size": -1}, "bucket_size"),
        ({"bucket_size": 1.5}, "bucket_size"),
        ({"bucket_size": "many"}, "bucket_size"),
        ({"bucket_size": True}, "bucket_size"),
        ({"gpu_buckets": -1}, "gpu_buckets"),
        ({"gpu_buckets": "-2"}, "gpu_buckets"),
        ({"gpu_buckets": "all"}, "gpu_buckets"),
        ({"gpu_buckets": 1.0}, "gpu_buckets"),
        ({"gpu_buckets": True}, "gpu_buckets"),
        ({"cpu_threads": 0}, "cpu_threads"),
        ({"cpu_threads": "two"}, "cpu_threads"),
        ({"speculate": "yes"}, "speculate"),
        ({"speculate_after_clip": 1}, "speculate_after_clip"),
        ({"cast": "bf16"}, "cast"),
        ({"cast": "GPU"}, "cast"),
    ],
)
def test_invalid_explicit_values_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SuperOffloadPlugin(**kwargs)


@pytest.mark.parametrize(
    ("field", "invalid", "env_value"),
    [("bucket_size", 0, "2048"), ("cast", "", "cpu")],
    ids=["bucket_size=0", "cast=''"],
)
def test_explicit_falsy_invalid_values_raise(monkeypatch, field, invalid, env_value):
    """An explicit invalid value must raise, not be replaced by the env var or the default.

    Fails at the time of writing: ``SuperOffloadPlugin.__post_init__`` resolves these two
    fields with ``self.bucket_size or _env(...)`` / ``self.cast or _env(...)``, so an explicit
    0 (or "") counts as "not given": ``bucket_size=0`` silently becomes 2**25, or the env value.
    """
    with pytest.raises(ValueError, match=field):
        SuperOffloadPlugin(**{field: invalid})
    monkeypatch.setenv(_env_name(field), env_value)
    with pytest.raises(ValueError, match=field):
        SuperOffloadPlugin(**{field: invalid})


@pytest.mark.parametrize(
    ("field", "raw"),
    [
        ("bucket_size", "-5"),
        ("bucket_size", "0"),
        ("bucket_size", "1e6"),
        ("bucket_size", "lots"),
        ("gpu_buckets", "-1"),
        ("gpu_buckets", "some"),
        ("cpu_threads", "0"),
        ("cpu_threads", "x"),
        ("speculate", "maybe"),
        ("speculate_after_clip", "2"),
        ("cast", "fp8"),
    ],
)
def test_invalid_env_values_raise(monkeypatch, field, raw):
    monkeypatch.setenv(_env_name(field), raw)
    with pytest.raises(ValueError, match=f"(?i){field}") as error:  # field or env var name
        SuperOffloadPlugin()
    if not raw.lstrip("-").isdigit():  # a malformed value: the message says where it came from
        assert _env_name(field) in str(error.value)


def test_from_dict():
    plugin = SuperOffloadPlugin.from_dict({"bucket_size": 2048, "cast": "cpu"})
    assert plugin.bucket_size == 2048 and plugin.cast == "cpu"
    assert plugin.speculate is True  # the rest resolved as usual
    with pytest.raises(ValueError, match="bucket_sise") as error:
        SuperOffloadPlugin.from_dict({"bucket_sise": 2048, "cast": "cpu"})
    assert "bucket_size" in str(error.value)  # and lists the valid names


def test_optimizer_kwargs_match_the_optimizer_signature():
    kwargs = SuperOffloadPlugin().optimizer_kwargs()
    assert set(kwargs) == set(FIELDS)
    params = inspect.signature(SuperOffloadOptimizer.__init__).parameters
    for name in kwargs:
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY, name


# ------------------------------------------------------------------------ training arguments


def _argument_fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.name.startswith("superoffload_")}


def test_arguments_mirror_the_plugin_fields():
    expected = {"superoffload_" + name for name in FIELDS} | {"superoffload_save_dtype"}
    assert _argument_fields(SuperOffloadArgumentsMixin) == expected
    assert _argument_fields(SuperOffloadTrainingArguments) == expected
    for field in dataclasses.fields(SuperOffloadArgumentsMixin):
        assert field.default is None and field.metadata["help"], field.name


def test_training_arguments_build_the_plugin(tmp_path, monkeypatch):
    args = _training_args(tmp_path, superoffload_gpu_buckets="3")
    plugin = args.superoffload_plugin()
    assert isinstance(plugin, SuperOffloadPlugin)
    assert plugin.gpu_buckets == 3
    assert {name: getattr(plugin, name) for name in FIELDS if name != "gpu_buckets"} == {
        name: value for name, value in DEFAULTS.items() if name != "gpu_buckets"
    }

    # Unset arguments fall back to the environment; set ones beat it.
    monkeypatch.setenv("SUPEROFFLOAD_CAST", "cpu")
    monkeypatch.setenv("SUPEROFFLOAD_BUCKET_SIZE", "777")
    plugin = _training_args(tmp_path, superoffload_bucket_size=4096).superoffload_plugin()
    assert plugin.cast == "cpu" and plugin.bucket_size == 4096

    with pytest.raises(ValueError, match="gpu_buckets"):
        _training_args(tmp_path, superoffload_gpu_buckets="-1").superoffload_plugin()


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
    assert args.superoffload_gpu_buckets is None
    plugin = args.superoffload_plugin()
    assert (plugin.cast, plugin.bucket_size, plugin.speculate) == ("cpu", 1000, False)
    assert plugin.gpu_buckets == "auto"


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
    args = _training_args(tmp_path, cls, superoffload_gpu_buckets="2", superoffload_cast="gpu")
    plugin = args.superoffload_plugin()
    assert (plugin.gpu_buckets, plugin.cast) == (2, "gpu")

    parser = HfArgumentParser(cls)
    (parsed,) = parser.parse_args_into_dataclasses(
        [
            *("--output_dir", str(tmp_path), "--use_cpu", "--bf16", "false"),
            *("--superoffload_bucket_size", "1000", "--superoffload_cpu_threads", "2"),
        ]
    )
    assert parsed.superoffload_plugin().bucket_size == 1000
    assert parsed.superoffload_plugin().cpu_threads == 2


def test_trainer_prefers_an_explicit_plugin(tmp_path):
    """A plugin given to the trainer beats the one the arguments describe."""
    args = _training_args(tmp_path, superoffload_bucket_size=1 << 20, superoffload_cast="cpu")
    model = build_tiny_llama()
    assert SuperOffloadTrainer(model=model, args=args)._resolved_plugin().bucket_size == 1 << 20
    plugin = SuperOffloadPlugin(bucket_size=512, cast="gpu")
    trainer = SuperOffloadTrainer(model=model, args=args, superoffload_plugin=plugin)
    assert trainer._resolved_plugin() is plugin
