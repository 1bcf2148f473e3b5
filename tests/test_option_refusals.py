"""Options that would be accepted and then not act are refused, saying what to change, before
anything is built; values the user wrote are used as written.

- The recipes' ``--optimizer adamw`` runs TRL's own trainer: ``superoffload_*`` arguments given
  with it (command line or recipe YAML) are refused; the demo's own bucket default is not set.
- ``HF_SUPEROFFLOAD_DEEPSPEED=0`` (DeepSpeed builds its own SuperOffload): the engine's options,
  as arguments or variables, are refused, and the model card reports none of them.
- ``HF_SUPEROFFLOAD_CPU_THREADS`` and the config's ``cpuadam_cores_perc`` at once are refused.
- A ``sub_group_size`` or ``reduce_bucket_size`` the DeepSpeed config writes is used as written,
  DeepSpeed's default value included; only a key left out takes this path's size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from ranks import spawn_ranks
from zero3_reference import Zero3Case, build_model, ds_config, free_port, init_rank

from hf_superoffload.engine.optimizer import DEFAULT_BUCKET_SIZE
from hf_superoffload.integrations.model_card import superoffload_options
from hf_superoffload.integrations.plugin import SuperOffloadOptions
from hf_superoffload.recipes import arguments
from hf_superoffload.zero3.config import export_zero3_options
from hf_superoffload.zero3.options import resolve_options

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


# ------------------------------------------------------------------ recipes: --optimizer adamw


@pytest.mark.parametrize(
    "given",
    [
        ["--superoffload_moments", "compact"],
        ["--superoffload_cpu_threads", "2", "--superoffload_save_dtype", "bfloat16"],
    ],
)
def test_adamw_recipe_refuses_superoffload_arguments(given, tmp_path):
    argv = ["--optimizer", "adamw", "--output_dir", str(tmp_path), *given]
    with pytest.raises(ValueError, match="--optimizer adamw runs TRL's own trainer") as error:
        arguments.parse("sft", argv)
    for flag in given[::2]:
        assert flag in str(error.value)
    assert "use --optimizer superoffload" in str(error.value)


def test_adamw_recipe_refuses_superoffload_keys_of_the_recipe_yaml(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("superoffload_cast: cpu\nlearning_rate: 0.001\n")
    argv = ["--config", str(recipe), "--optimizer", "adamw", "--output_dir", str(tmp_path)]
    with pytest.raises(ValueError, match="does not read --superoffload_cast"):
        arguments.parse("dpo", argv)


def test_defaults_do_not_count_as_given(tmp_path):
    """The demo with --optimizer adamw parses (no superoffload_* is set, the demo's bucket
    size neither); with SuperOffload the arguments and the demo's bucket size stay."""
    _, args = arguments.parse("sft", ["--optimizer", "adamw", "--output_dir", str(tmp_path)])
    assert args.superoffload_bucket_size is None
    assert arguments.superoffload_arguments_given(args) == []
    _, args = arguments.parse(
        "sft", ["--superoffload_moments", "compact", "--output_dir", str(tmp_path)]
    )
    assert args.superoffload_moments == "compact"
    assert args.superoffload_bucket_size == arguments.DEMO_BUCKET_SIZE


# ------------------------------------------------------ HF_SUPEROFFLOAD_DEEPSPEED=0: the opt-out

_OPT_OUT_SCRIPT = textwrap.dedent(
    """
    import json, os, types
    import hf_superoffload
    from hf_superoffload.integrations.model_card import superoffload_options
    from hf_superoffload.zero3.config import export_zero3_options

    def refusal(options):
        try:
            export_zero3_options(options)
        except ValueError as error:
            return str(error)
        return None

    out = {"nothing": refusal({})}
    out["arguments"] = refusal({"moments": "compact", "cast": None, "speculate": False})
    out["exported"] = sorted(k for k in os.environ if k.startswith("HF_SUPEROFFLOAD_"))
    os.environ["HF_SUPEROFFLOAD_SPECULATE"] = "false"
    out["variable"] = refusal({})
    trainer = types.SimpleNamespace(
        _on_deepspeed=True, _stv_optimizer=None, _explicit_options=lambda: {"moments": "compact"}
    )
    out["card"] = superoffload_options(trainer)
    print(json.dumps(out))
    """
)


def test_opt_out_refuses_engine_options_and_the_card_reports_none():
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_SUPEROFFLOAD_")}
    env.update(HF_SUPEROFFLOAD_DEEPSPEED="0", PYTHONPATH=os.pathsep.join([str(REPO), *sys.path]))
    env.pop("ACCELERATE_DEEPSPEED_CONFIG_FILE", None)
    done = subprocess.run(
        [sys.executable, "-c", _OPT_OUT_SCRIPT], env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["nothing"] is None  # nothing given: nothing to refuse
    assert out["arguments"] and "HF_SUPEROFFLOAD_DEEPSPEED=0" in out["arguments"]
    assert "superoffload_moments, superoffload_speculate" in out["arguments"]
    assert "superoffload_cast" not in out["arguments"]
    assert out["exported"] == ["HF_SUPEROFFLOAD_DEEPSPEED"]  # nothing handed to an engine
    assert "does not read HF_SUPEROFFLOAD_SPECULATE" in out["variable"]
    assert out["card"] == {
        "path": "DeepSpeed's own SuperOffload on ZeRO-3 (HF_SUPEROFFLOAD_DEEPSPEED=0)"
    }


def test_card_on_our_zero3_engine_reports_the_options_that_acted(monkeypatch):
    """With superoffload_options every field is given; the ones DeepSpeed's config replaces
    (gpu_tail, bucket_size, gpu_tail_cap) act there, not these values: not reported."""
    monkeypatch.delenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", raising=False)
    options = SuperOffloadOptions(
        gpu_tail="auto", bucket_size=DEFAULT_BUCKET_SIZE, cpu_threads=None, speculate=False,
        speculate_after_clip=False, cast="gpu", moments="fp32", gpu_tail_cap=None,
    )  # fmt: skip
    trainer = type(
        "Trainer",
        (),
        {
            "_on_deepspeed": True,
            "_stv_optimizer": None,
            "_explicit_options": lambda self: options.optimizer_kwargs(),
        },
    )()
    card = superoffload_options(trainer)
    assert card == {
        "speculate": False,
        "speculate_after_clip": False,
        "cast": "gpu",
        "moments": "fp32",
        "path": "DeepSpeed ZeRO-3 (super_offload: true)",
    }


# ------------------------------------------------- cpu_threads and cpuadam_cores_perc together


def test_cpu_threads_and_cores_perc_together_are_refused(monkeypatch):
    monkeypatch.delenv("HF_SUPEROFFLOAD_CPU_THREADS", raising=False)
    assert resolve_options(0.5, CPU).cpu_threads >= 1  # the share alone
    monkeypatch.setenv("HF_SUPEROFFLOAD_CPU_THREADS", "7")  # restored after the test
    assert resolve_options(None, CPU).cpu_threads == 7  # the count alone
    with pytest.raises(ValueError, match="both size the CPU Adam's team") as error:
        resolve_options(0.5, CPU)
    message = str(error.value)
    assert "HF_SUPEROFFLOAD_CPU_THREADS=7" in message and "cpuadam_cores_perc=0.5" in message
    assert "remove cpuadam_cores_perc" in message and "unset HF_SUPEROFFLOAD_CPU_THREADS" in message
    # The trainers' superoffload_cpu_threads arrives the same way.
    monkeypatch.delenv("HF_SUPEROFFLOAD_CPU_THREADS")
    monkeypatch.setenv("HF_SUPEROFFLOAD_CPU_THREADS", "1")
    export_zero3_options({"cpu_threads": 3})
    with pytest.raises(ValueError, match="superoffload_cpu_threads"):
        resolve_options(0.25, CPU)


# ------------------------------------------------------- sizes the DeepSpeed config writes


@pytest.mark.parametrize(
    ("zero", "sizes"),
    [
        ({}, (DEFAULT_BUCKET_SIZE, DEFAULT_BUCKET_SIZE)),  # left out: this path's size
        ({"sub_group_size": 10**9}, (10**9, 5 * 10**8)),  # DeepSpeed's default, written
        ({"reduce_bucket_size": 5 * 10**8}, (DEFAULT_BUCKET_SIZE, 5 * 10**8)),
        ({"sub_group_size": 1000, "reduce_bucket_size": 10**9}, (1000, 10**9)),
    ],
)
def test_sizes_written_in_the_config_are_used_as_written(zero, sizes):
    from hf_superoffload.zero3.options import resolve_sizes

    # DeepSpeed hands the optimizer its defaults for the keys a config leaves out.
    kwargs = {"sub_group_size": 10**9, "reduce_bucket_size": 5 * 10**8, **zero}
    deepspeed_size = kwargs["sub_group_size"]
    assert resolve_sizes(kwargs, {"zero_optimization": {"stage": 3, **zero}}) == deepspeed_size
    assert (kwargs["sub_group_size"], kwargs["reduce_bucket_size"]) == sizes


def _engine_sizes_on_rank(rank, world, port, out_dir) -> None:
    import deepspeed

    init_rank(rank, world, port)
    torch.set_num_threads(1)
    import hf_superoffload  # noqa: F401

    os.environ.pop("HF_SUPEROFFLOAD_CPU_THREADS", None)
    found = {}
    for name, written in (("written", True), ("left_out", False)):
        config = ds_config(Zero3Case(), True, world)
        zero = config["zero_optimization"]
        del zero["sub_group_size"], zero["reduce_bucket_size"]
        if written:  # DeepSpeed's own defaults, as a user may copy them from its docs
            zero.update(sub_group_size=10**9, reduce_bucket_size=5 * 10**8)
        model = build_model(0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        found[name] = (engine.optimizer.sub_group_size, engine.optimizer.reduce_bucket_size)
        engine.destroy()
    # Both thread settings: refused while the optimizer is built, before DeepSpeed's part.
    config = ds_config(Zero3Case(), True, world)
    config["zero_optimization"]["offload_optimizer"]["cpuadam_cores_perc"] = 0.5
    os.environ["HF_SUPEROFFLOAD_CPU_THREADS"] = "1"
    model = build_model(0)
    try:
        deepspeed.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config
        )
        found["refused"] = None
    except ValueError as error:
        found["refused"] = str(error)
    Path(out_dir, "sizes.json").write_text(json.dumps(found))


def test_the_zero3_optimizer_runs_the_sizes_the_config_writes(tmp_path):
    spawn_ranks(_engine_sizes_on_rank, (1, free_port(), str(tmp_path)), 1)
    found = json.loads((tmp_path / "sizes.json").read_text())
    assert found["written"] == [10**9, 5 * 10**8]
    assert found["left_out"] == [DEFAULT_BUCKET_SIZE, DEFAULT_BUCKET_SIZE]
    assert "both size the CPU Adam's team" in found["refused"]
