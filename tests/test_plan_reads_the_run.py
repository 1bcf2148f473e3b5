"""``hf-superoffload plan`` counts the run that will train: a recipe's settings that change
memory (accumulation, moments, cast, the checkpointed inputs' offload, saving, TRL's loss) as
examples/sft.py reads them, HF_SUPEROFFLOAD_MOMENTS as the trainer reads it, an option over
either; and this machine's host memory as the optimizer's start-up check counts it."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from cgroup_files import write_host

from hf_superoffload.cli import main
from hf_superoffload.engine import host_memory

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "examples" / "recipes").glob("*.yaml"))
GiB = 2**30
MACHINE = ("--gpus", "1", "--gpu-mem", "80", "--cpu-mem", "128")
# What a recipe's plan is compared on: everything but the model's name and the notes.
FIGURES = ("run", "gpu_bytes_per_rank", "host_bytes_per_rank", "gpu_need_bytes", "host_need_bytes")


def plan(capsys, *args: str) -> tuple[int, dict | None, str]:
    """(exit code, the JSON or None, stderr) of one plan."""
    try:
        code = main(["plan", *args, "--json"])
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    out, err = capsys.readouterr()
    return code, json.loads(out) if code in (0, 1) else None, err


def _figures(found: dict) -> dict:
    return {key: found[key] for key in FIGURES}


@pytest.fixture
def no_variables(monkeypatch):
    for name in ("MOMENTS", "CAST", "HOST_MEMORY_GIB"):
        monkeypatch.delenv(f"HF_SUPEROFFLOAD_{name}", raising=False)


def _recipe(tmp_path: Path, extra: str) -> Path:
    """The shipped Qwen3-14B recipe with ``extra`` settings after it (the last one wins)."""
    recipe = tmp_path / "qwen3-14b.yaml"
    shipped = (ROOT / "examples" / "recipes" / "qwen3-14b.yaml").read_text()
    recipe.write_text(shipped + extra)
    return recipe


MEMORY_SETTINGS = """gradient_accumulation_steps: 8
superoffload_moments: compact
superoffload_cast: cpu
activation_checkpoint_offload: true
save_model: false
"""
THE_SAME_OPTIONS = (
    "--gradient-accumulation-steps", "8", "--moments", "compact", "--cast", "cpu",
    "--activation-checkpoint-offload", "--no-save", "--loss", "trl",
)  # fmt: skip


@pytest.mark.usefixtures("no_variables")
def test_a_recipes_settings_plan_as_the_options_that_say_the_same(capsys, tmp_path):
    code, by_recipe, err = plan(capsys, str(_recipe(tmp_path, MEMORY_SETTINGS)), *MACHINE)
    assert code in (0, 1), err
    _, by_options, _ = plan(capsys, "qwen3-14b", *MACHINE, *THE_SAME_OPTIONS)
    assert _figures(by_recipe) == _figures(by_options)
    run, host = by_recipe["run"], by_recipe["host_bytes_per_rank"]
    assert run["gradient_accumulation"] == 8 and host["accumulation"] > 0
    assert run["compact_moments"] and run["cast"] == "cpu" and not run["saves_model"]
    assert host["offloaded_layer_inputs"] > 0 and run["fused_cross_entropy"] == "trl"
    # Without them (the shipped recipe): the recipe's own run, TRL's loss and the cast auto.
    _, shipped, _ = plan(capsys, str(_recipe(tmp_path, "")), *MACHINE)
    _, plain, _ = plan(capsys, "qwen3-14b", *MACHINE, "--loss", "trl", "--cast", "auto")
    assert _figures(shipped) == _figures(plain)
    assert by_recipe["host_bytes_per_param"] != shipped["host_bytes_per_param"]


@pytest.mark.usefixtures("no_variables")
def test_an_option_wins_over_the_recipe(capsys, tmp_path):
    undo = (
        "--gradient-accumulation-steps", "1", "--moments", "fp32", "--cast", "auto",
        "--no-activation-checkpoint-offload", "--save", "--loss", "full",
    )  # fmt: skip
    _, by_recipe, _ = plan(capsys, str(_recipe(tmp_path, MEMORY_SETTINGS)), *MACHINE, *undo)
    _, by_options, _ = plan(capsys, "qwen3-14b", *MACHINE, *undo)
    assert _figures(by_recipe) == _figures(by_options)
    assert by_recipe["host_bytes_per_rank"]["accumulation"] == 0


def test_the_moments_variable_is_the_default(capsys, monkeypatch, no_variables, tmp_path):
    """HF_SUPEROFFLOAD_MOMENTS=compact, which the plan's own advice says to export, is what the
    trainer keeps unless told otherwise; --moments and a recipe's superoffload_moments win."""
    _, fp32, _ = plan(capsys, "qwen3-14b", *MACHINE)
    monkeypatch.setenv("HF_SUPEROFFLOAD_MOMENTS", "compact")
    _, by_variable, _ = plan(capsys, "qwen3-14b", *MACHINE)
    _, by_option, _ = plan(capsys, "qwen3-14b", *MACHINE, "--moments", "compact")
    assert by_variable["run"]["compact_moments"] is True
    assert _figures(by_variable) == _figures(by_option)
    assert by_variable["host_bytes_per_rank"]["moments"] < fp32["host_bytes_per_rank"]["moments"]
    _, told, _ = plan(capsys, "qwen3-14b", *MACHINE, "--moments", "fp32")
    assert _figures(told) == _figures(fp32)
    recipe = _recipe(tmp_path, "superoffload_moments: fp32\n")
    _, by_recipe, _ = plan(capsys, str(recipe), *MACHINE)
    assert by_recipe["run"]["compact_moments"] is False
    _, by_recipe, _ = plan(capsys, str(_recipe(tmp_path, "")), *MACHINE)
    assert by_recipe["run"]["compact_moments"] is True
    monkeypatch.setenv("HF_SUPEROFFLOAD_MOMENTS", "Compact")  # the trainer refuses it
    code, _, err = plan(capsys, "qwen3-14b", *MACHINE)
    assert code == 2 and "moments must be 'fp32'" in err and "'Compact'" in err, err


@pytest.mark.usefixtures("no_variables")
def test_what_the_plan_cannot_count_in_a_recipe_is_refused(capsys, tmp_path):
    recipe = _recipe(tmp_path, "sequence_parallel_size: 2\n")
    code, _, err = plan(capsys, str(recipe), "--gpus", "2", "--hardware", "h100")
    assert code == 2, err
    assert f"recipe {recipe}: sequence_parallel_size 2 splits each sequence" in err
    recipe = _recipe(tmp_path, "gradient_accumulation_steps: 0\n")
    code, _, err = plan(capsys, str(recipe), *MACHINE)
    assert code == 2 and "gradient_accumulation_steps must be at least 1, got 0" in err, err


# --- this machine's host memory --------------------------------------------------------------


@pytest.fixture
def host_files(tmp_path, monkeypatch):
    """/proc/meminfo and a cgroup v2 job below the mount's root, as files of the test's."""

    def write(mem_available: int, cgroup_limit: int, cgroup_usage: int) -> Path:
        limits = {"job": (cgroup_limit, cgroup_usage)}
        mount = write_host(tmp_path, monkeypatch, mem_available, cgroup="/job", limits=limits)
        return mount / "job" / "memory.max"

    return write


@pytest.mark.usefixtures("no_variables")
def test_this_hosts_memory_is_what_the_start_up_check_counts(capsys, host_files, monkeypatch):
    """A job's cgroup limited to 100 GiB, 4 used, on a 1 TiB host: the plan has 96 GiB, as
    the optimizer's start-up check (host_memory_available) has, not MemTotal; Llama-3.1-8B's
    112 GiB then does not fit where MemTotal would say it does."""
    limit_file = host_files(mem_available=900 * GiB, cgroup_limit=100 * GiB, cgroup_usage=4 * GiB)
    this_host = ("llama-3.1-8b", "--gpu-mem", "80")
    code, found, err = plan(capsys, *this_host)
    assert found["hardware"]["host_memory_bytes"] == 96 * GiB == host_memory.host_bytes_available()
    assert code == 1 and "host" in found["reasons"][0], found["reasons"]
    assert f"here cgroup limit {limit_file} 100.00 GiB" in found["hardware"]["source"]
    code, _, _ = plan(capsys, *this_host, "--cpu-mem", "1024")
    assert code == 0
    monkeypatch.setenv("HF_SUPEROFFLOAD_HOST_MEMORY_GIB", "300")  # the job's figure, as there
    code, found, _ = plan(capsys, *this_host)
    assert code == 0 and found["hardware"]["host_memory_bytes"] == 300 * GiB
    monkeypatch.setenv("HF_SUPEROFFLOAD_HOST_MEMORY_GIB", "lots")
    code, _, err = plan(capsys, *this_host)
    assert code == 2 and "HF_SUPEROFFLOAD_HOST_MEMORY_GIB='lots'" in err, err


# --- the figures the recipes and docs/recipes.md quote ----------------------------------------


def _header_claim(recipe: Path) -> tuple[list[str], float, float]:
    """(the plan command, GPU GiB, host GiB) a recipe's header quotes."""
    header = " ".join(
        line.removeprefix("#").strip()
        for line in recipe.read_text().splitlines()
        if line.startswith("#")
    )
    found = re.search(
        r"`hf-superoffload (plan [^`]+)` plans ([\d.]+) GiB of GPU memory and ([\d.]+) GiB of "
        r"host memory",
        header,
    )
    assert found, f"{recipe.name}: no plan figures in its header"
    return shlex.split(found[1]), float(found[2]), float(found[3])


def _docs_table() -> dict[str, tuple[float, float]]:
    """docs/recipes.md's recipe table: recipe file -> (GPU GiB, host GiB)."""
    rows = re.findall(
        r"^\| `([\w.-]+\.yaml)` \|.*\| ([\d.]+) / ([\d.]+) \|$",
        (ROOT / "docs" / "recipes.md").read_text(),
        re.MULTILINE,
    )
    return {name: (float(gpu), float(host)) for name, gpu, host in rows}


@pytest.mark.usefixtures("no_variables")
def test_the_recipes_and_the_docs_quote_what_their_plan_command_prints(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the headers name the recipe by its path in the checkout
    table = _docs_table()
    assert set(table) == {recipe.name for recipe in RECIPES}
    for recipe in RECIPES:
        command, gpu, host = _header_claim(recipe)
        assert command[:2] == ["plan", f"examples/recipes/{recipe.name}"], command
        code, found, err = plan(capsys, *command[1:])
        assert code == 0, err
        printed = (
            round(found["gpu_need_bytes"] / GiB, 1),
            round(found["host_total_bytes_per_host"] / GiB, 1),
        )
        assert (gpu, host) == printed, recipe.name
        assert table[recipe.name] == printed, recipe.name


def _without(tmp_path: Path, *keys: str) -> Path:
    """The shipped Qwen3-14B recipe without ``keys``."""
    shipped = (ROOT / "examples" / "recipes" / "qwen3-14b.yaml").read_text().splitlines()
    recipe = tmp_path / "qwen3-14b.yaml"
    kept = [line for line in shipped if not line.startswith(tuple(f"{k}:" for k in keys))]
    recipe.write_text("\n".join(kept) + "\n")
    return recipe


@pytest.mark.usefixtures("no_variables")
def test_what_a_recipe_leaves_out_is_planned_as_the_script_runs_it(capsys, tmp_path):
    """examples/sft.py runs TRL's SFT config's defaults (read from its fields: batch 8 and
    max_length 1024 in TRL 1.16) where a recipe gives none; the plan counts the same run. A
    model's plan keeps its own 4096 and 4."""
    import dataclasses

    from hf_superoffload.cli.script_arguments import planned_run
    from hf_superoffload.recipes.arguments import KINDS

    defaults = {f.name: f.default for f in dataclasses.fields(KINDS["sft"])}
    seq, batch = defaults["max_length"], defaults["per_device_train_batch_size"]
    assert (seq, batch) == (1024, 8)  # TRL 1.16's, which the recipes' docs quote
    recipe = _without(tmp_path, "max_length", "per_device_train_batch_size")
    code, found, err = plan(capsys, str(recipe), *MACHINE)
    assert code in (0, 1), err
    assert (found["run"]["seq"], found["run"]["batch"]) == (seq, batch)
    assert main(["plan", str(recipe), *MACHINE]) in (0, 1)
    assert f"seq {seq} x batch {batch} per GPU" in capsys.readouterr().out
    _, by_options, _ = plan(
        capsys, "qwen3-14b", *MACHINE, "--seq", str(seq), "--batch", str(batch),
        "--loss", "trl", "--cast", "auto",
    )  # fmt: skip
    assert _figures(found) == _figures(by_options)
    # hf-superoffload finetune RATIO=auto plans the run from the same reading.
    run = planned_run({}, [])
    assert (run.seq, run.batch) == (seq, batch)
    # A model: the plan's own.
    _, model, _ = plan(capsys, "qwen3-14b", *MACHINE)
    assert (model["run"]["seq"], model["run"]["batch"]) == (4096, 4)
    # A recipe without a limit (max_length null) is refused, not planned at some length.
    null = _recipe(tmp_path, "max_length: null\n")
    code, _, err = plan(capsys, str(null), *MACHINE)
    assert code == 2 and "max_length is null" in err and "--seq N" in err, err
    code, given, err = plan(capsys, str(null), *MACHINE, "--seq", "2048")
    assert code in (0, 1) and given["run"]["seq"] == 2048, err
