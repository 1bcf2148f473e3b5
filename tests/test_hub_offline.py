"""Offline mode of the recipe scripts (examples/sft.py, examples/dpo.py, ``hf-superoffload
demo``): set for a run that needs nothing from the Hub, never forced on a run that names a Hub
model or dataset or pushes, and a clear refusal, before anything is built, when the user's
HF_HUB_OFFLINE=1 meets a run that needs the Hub. No network is used."""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys
from pathlib import Path

import pytest

from hf_superoffload.cli import main
from hf_superoffload.recipes import hub_access

ROOT = Path(__file__).resolve().parents[1]
QWEN_RECIPE = str(ROOT / "examples" / "recipes" / "qwen3-14b.yaml")
LOCAL_DATA = str(ROOT / "examples" / "data" / "arithmetic_sft.jsonl")


@pytest.fixture
def no_offline_setting(monkeypatch):
    """os.environ without HF_HUB_OFFLINE (restored afterwards), and the module's record of
    having set it cleared."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "restored afterwards")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(hub_access, "_set_here", False)


@pytest.mark.parametrize(
    ("argv", "offline"),
    [
        ([], True),  # the demo
        (["--max_steps", "3", "--output_dir", "out"], True),
        (["--model_name_or_path", "Qwen/Qwen3-14B"], False),
        (["--model_name_or_path=Qwen/Qwen3-14B"], False),
        (["--config", QWEN_RECIPE, "--model_name_or_path", "Qwen/Qwen3-14B"], False),
        (["--config", QWEN_RECIPE], False),  # the recipe's Hub model and dataset
        # Random weights ignore the recipe's model; its Hub dataset is still read...
        (["--config", QWEN_RECIPE, "--random_init_from_config", "qwen3-14b"], False),
        # ...unless a local file replaces it, or the smoke test's bundled data does.
        (["--config", QWEN_RECIPE, "--random_init_from_config", "qwen3-14b",
          "--dataset_path", LOCAL_DATA], True),
        (["--config", QWEN_RECIPE, "--random_init_from_config", "qwen3-14b",
          "--shrink_model"], True),
        (["--config", QWEN_RECIPE, "--random_init_from_config", "qwen3-14b",
          "--shrink_model", "false"], False),
        (["--dataset_name", "trl-lib/Capybara"], False),
        (["--tokenizer_name_or_path", "Qwen/Qwen3-14B"], False),
        (["--push_to_hub"], False),
        (["--push_to_hub", "--max_steps", "3"], False),
        (["--push_to_hub", "true"], False),
        (["--push_to_hub", "false"], True),
        # hub_model_id only names the repository a push goes to.
        (["--hub_model_id", "me/tiny"], True),
        (["--hub_model_id", "me/tiny", "--push_to_hub"], False),
        # trackio logging to a Hub Space; without a Space it logs locally, and a Space id
        # means nothing to a run that does not report to trackio.
        (["--report_to", "trackio", "--trackio_space_id", "me/runs"], False),
        (["--trackio_space_id=me/runs", "--report_to=trackio"], False),
        (["--report_to", "trackio"], True),
        (["--trackio_space_id", "me/runs"], True),
        (["--report_to", "wandb", "--trackio_space_id", "me/runs"], True),
        (["--report_to", "none", "--trackio_space_id", "me/runs"], True),
    ],
)  # fmt: skip
def test_offline_only_when_nothing_comes_from_the_hub(argv, offline):
    environ: dict[str, str] = {}
    assert hub_access.choose_offline_mode(argv, environ) is offline
    assert environ == ({"HF_HUB_OFFLINE": "1"} if offline else {})


def test_trackio_space_from_the_recipe_or_the_environment_stays_online(tmp_path, monkeypatch):
    """The Space id and report_to from a recipe (report_to as a list), the Space id from
    TRACKIO_SPACE_ID (trackio's own variable), and report_to all with trackio installed."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("report_to: [trackio]\ntrackio_space_id: me/runs\n")
    environ: dict[str, str] = {}
    assert not hub_access.choose_offline_mode(["--config", str(recipe)], environ)
    assert not hub_access.choose_offline_mode(
        ["--report_to", "trackio"], {"TRACKIO_SPACE_ID": "me/runs"}
    )
    assert hub_access.choose_offline_mode(["--report_to", "none"], {"TRACKIO_SPACE_ID": "me/runs"})

    # report_to all: every integration installed, trackio among them or not.
    argv = ["--report_to", "all", "--trackio_space_id", "me/runs"]
    find_spec = importlib.util.find_spec
    for trackio_installed in (True, False):
        spec = object() if trackio_installed else None
        monkeypatch.setattr(
            importlib.util, "find_spec",
            lambda name, *rest, spec=spec: spec if name == "trackio" else find_spec(name, *rest),
        )  # fmt: skip
        assert hub_access.choose_offline_mode(argv, environ) is not trackio_installed


def test_local_model_directory_is_offline(tmp_path):
    environ: dict[str, str] = {}
    argv = ["--model_name_or_path", str(tmp_path), "--dataset_path", LOCAL_DATA]
    assert hub_access.choose_offline_mode(argv, environ)
    assert environ == {"HF_HUB_OFFLINE": "1"}


@pytest.mark.parametrize("value", ["0", "1"])
def test_users_setting_wins(value):
    environ = {"HF_HUB_OFFLINE": value}
    assert not hub_access.choose_offline_mode([], environ)
    assert not hub_access.choose_offline_mode(["--model_name_or_path", "Qwen/Qwen3-14B"], environ)
    assert environ == {"HF_HUB_OFFLINE": value}


@pytest.mark.parametrize("script", ["sft.py", "dpo.py"])
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], "1"),
        (["--model_name_or_path", "Qwen/Qwen3-14B"], None),
        (["--push_to_hub", "--hub_model_id", "me/tiny"], None),
    ],
)
def test_example_scripts(no_offline_setting, monkeypatch, script, argv, expected):
    """The scripts' own preamble (run here without __main__, so nothing trains)."""
    monkeypatch.setattr(sys, "argv", [script, *argv])
    runpy.run_path(str(ROOT / "examples" / script), run_name="offline_check")
    assert os.environ.get("HF_HUB_OFFLINE") == expected


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["demo"], "1"),
        (["demo", "--dpo", "--recipe-help"], "1"),
        (["demo", "--model_name_or_path", "Qwen/Qwen3-14B"], None),
        (["demo", "--push_to_hub"], None),
    ],
)
def test_demo_command(no_offline_setting, monkeypatch, argv, expected):
    from hf_superoffload.recipes import run as recipe_run

    jobs = []
    monkeypatch.setattr(recipe_run, "main", lambda kind, job_args, prog: jobs.append(kind) or 0)
    assert main(argv) == 0 and jobs
    assert os.environ.get("HF_HUB_OFFLINE") == expected


def _cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    return cache


def test_refusal_names_what_needs_the_hub(no_offline_setting, tmp_path, monkeypatch):
    _cache(tmp_path, monkeypatch)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    values = {"model_name_or_path": "Qwen/Qwen3-14B", "dataset_name": "trl-lib/Capybara",
              "push_to_hub": True}  # fmt: skip
    with pytest.raises(ValueError) as refusal:
        hub_access.check_hub_reachable(values, offline=True)
    message = str(refusal.value)
    for part in ("--model_name_or_path Qwen/Qwen3-14B", "--dataset_name trl-lib/Capybara",
                 "--push_to_hub", "HF_HUB_OFFLINE=1 in your environment",
                 "Unset HF_HUB_OFFLINE (or set it to 0)"):  # fmt: skip
        assert part in message
    hub_access.check_hub_reachable(values, offline=False)  # online: nothing to refuse


def test_cached_model_and_dataset_load_offline(no_offline_setting, tmp_path, monkeypatch):
    cache = _cache(tmp_path, monkeypatch)
    (cache / "models--Qwen--Qwen3-14B" / "snapshots").mkdir(parents=True)
    (tmp_path / "datasets" / "trl-lib___capybara").mkdir(parents=True)
    values = {"model_name_or_path": "Qwen/Qwen3-14B", "dataset_name": "trl-lib/Capybara"}
    hub_access.check_hub_reachable(values, offline=True)
    with pytest.raises(ValueError, match=r"--push_to_hub \(uploads"):  # no cache makes a push
        hub_access.check_hub_reachable({**values, "push_to_hub": True}, offline=True)


@pytest.mark.parametrize(
    ("values", "environ", "named", "remedy"),
    [
        ({"report_to": ["trackio"], "trackio_space_id": "me/runs"}, {},
         "--trackio_space_id me/runs (trackio logs to this Hub Space)",
         "drop --trackio_space_id (trackio then logs locally)"),
        ({"report_to": "trackio"}, {"TRACKIO_SPACE_ID": "me/runs"},
         "TRACKIO_SPACE_ID=me/runs (trackio logs to this Hub Space)",
         "unset TRACKIO_SPACE_ID (trackio then logs locally)"),
    ],
)  # fmt: skip
def test_refusal_names_the_trackio_space(no_offline_setting, values, environ, named, remedy):
    """A run logging to a Hub Space while offline: the Space is named (no cache stands in for
    it), with how to log locally instead."""
    environ = {"HF_HUB_OFFLINE": "1", **environ}
    with pytest.raises(ValueError) as refusal:
        hub_access.check_hub_reachable(values, offline=True, environ=environ)
    message = str(refusal.value)
    assert named in message and remedy in message
    assert "HF_HUB_OFFLINE=1 in your environment" in message
    assert "--push_to_hub" not in message and "local paths" not in message
    # Not reporting to trackio, or reporting without a Space: nothing leaves the machine.
    hub_access.check_hub_reachable({**values, "report_to": ["wandb"]}, True, environ)
    local = {"report_to": ["trackio"]}
    hub_access.check_hub_reachable(local, offline=True, environ={"HF_HUB_OFFLINE": "1"})
    # hub_model_id without a push names a repository nobody uploads to.
    hub_access.check_hub_reachable({"hub_model_id": "me/tiny"}, True, {"HF_HUB_OFFLINE": "1"})


def test_transformers_offline_named(no_offline_setting, tmp_path, monkeypatch):
    _cache(tmp_path, monkeypatch)
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"Unset TRANSFORMERS_OFFLINE \(or set it to 0\)"):
        hub_access.check_hub_reachable({"model_name_or_path": "org/model"}, offline=True)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--model_name_or_path", "Qwen/Qwen3-14B"], "--model_name_or_path Qwen/Qwen3-14B"),
        (["--push_to_hub", "--hub_model_id", "me/tiny"], "--push_to_hub"),
        (["--report_to", "trackio", "--trackio_space_id", "me/runs"], "--trackio_space_id me/runs"),
    ],
)
def test_recipe_refuses_before_building(no_offline_setting, tmp_path, monkeypatch, argv, named):
    """The user's HF_HUB_OFFLINE=1 with a run that needs the Hub: our refusal, before the
    tokenizer or model is loaded (transformers' error there says to check the connection)."""
    from huggingface_hub import constants

    from hf_superoffload.recipes import run as recipe_run

    _cache(tmp_path, monkeypatch)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)

    def built(*args):
        raise AssertionError("the tokenizer was loaded before the refusal")

    monkeypatch.setattr(recipe_run, "load_tokenizer", built)
    argv = [*argv, "--bf16", "false", "--output_dir", str(tmp_path / "out")]
    with pytest.raises(ValueError, match="Unset HF_HUB_OFFLINE \\(or set it to 0\\)") as refusal:
        recipe_run.build_trainer("sft", argv)
    assert named in str(refusal.value)


RECIPES = sorted(str(p) for p in (ROOT / "examples" / "recipes").glob("*.yaml"))
# On this CPU machine the recipes' bf16 is refused by the training config, not by hub_access.
CPU = ["--output_dir", "out", "--use_cpu", "--bf16", "false"]
OVERRIDES = [
    [],
    ["--push_to_hub"],
    ["--push_to_hub", "false"],
    ["--push_to_hub=true"],
    ["--dataset_path", LOCAL_DATA, "--random_init_from_config", "qwen3-14b"],
    ["--shrink_model"],
    ["--shrink_model", "False"],
    ["--model_name_or_path=Qwen/Qwen3-14B", "--random_init_from_config", "qwen3-14b"],
    ["--tokenizer_name_or_path", "Qwen/Qwen3-14B", "--dataset_name", "trl-lib/Capybara"],
    ["--hub_model_id", "me/tiny"],
    ["--report_to", "trackio", "--trackio_space_id", "me/runs"],
    ["--report_to=trackio", "--trackio_space_id=me/runs", "--push_to_hub"],
    ["--trackio_space_id", "me/runs"],
    ["--report_to", "all", "--trackio_space_id", "me/runs"],
]


@pytest.mark.parametrize("kind", ["sft", "dpo"])
@pytest.mark.parametrize("extra", OVERRIDES, ids=lambda e: " ".join(e) or "as-shipped")
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: Path(p).stem)
def test_offline_reading_agrees_with_the_recipe_parser(recipe, extra, kind):
    """hub_access reads the command line before any Hugging Face import, so it cannot use the
    recipe's TRL parser: what it finds the run takes from the Hub must be what the parser,
    reading the same YAML and overrides, hands the run."""
    from hf_superoffload.recipes.arguments import build_parser

    argv = ["--config", recipe, *CPU, *extra]
    script, config = build_parser(kind).parse_args_and_config(argv)
    ours = hub_access.values_from_argv(argv)
    parsed = {}
    for name in (*hub_access._NAMES, *hub_access._FLAGS):
        holder = script if hasattr(script, name) else config
        if hasattr(holder, name):
            parsed[name] = getattr(holder, name)
        else:  # DPO has no chat template argument: the parser refuses one, so none is read
            assert kind == "dpo" and name == "chat_template_path" and name not in ours
    assert hub_access.hub_uses(ours) == hub_access.hub_uses(parsed)
