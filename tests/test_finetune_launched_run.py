"""``hf-superoffload finetune`` plans the run it launches: the script's arguments after ``--``
(``--max_length``, ``--per_device_train_batch_size``, ``--gradient_accumulation_steps``) come
last on the launched command and win there, so RATIO=auto, plan.json, the run directory's name
and command.sh take them as examples/sft.py reads them; what the plan cannot count
(``--sequence_parallel_size`` above 1) is refused before anything is written."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from hf_superoffload.cli import main as cli_main
from hf_superoffload.recipes import arguments

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

MACHINE = ("--gpu-mem", "80", "--cpu-mem", "256")  # an H100 with a 256 GiB host
LONG = ("--max_length", "16384", "--gradient_accumulation_steps", "4")


def finetune(capsys, runs: Path, *args: str) -> tuple[int, str, str]:
    code = cli_main(["finetune", "--runs-dir", str(runs), *args])
    out, err = capsys.readouterr()
    return code, out, err


def plan_json(capsys, *args: str) -> dict:
    code = cli_main(["plan", *args, "--json"])
    out, err = capsys.readouterr()
    assert code in (0, 1), err
    return json.loads(out)


def _only_run_dir(runs: Path) -> Path:
    (run_dir,) = runs.iterdir()
    return run_dir


def _launched(run_dir: Path):
    """(the recipe arguments, the training arguments) examples/sft.py reads from command.sh."""
    command = shlex.split((run_dir / "command.sh").read_text().splitlines()[-1])
    return arguments.parse("sft", [*command[5:], "--bf16", "false"])


@pytest.mark.parametrize(
    "script",
    [
        [*LONG, "--per_device_train_batch_size", "8"],
        ["--max-length=16384", "--gradient-accumulation-steps", "4", "--per-device-train-batch-size", "8"],
    ],
    ids=["underscored", "dashed"],
)  # fmt: skip
def test_ratio_auto_plans_the_scripts_sequence_batch_and_accumulation(capsys, tmp_path, script):
    """Llama-3.1-8B at seq 16384, batch 8, accumulation 4 on an H100: the plan of the recipe's
    seq 4096 x batch 4 chose 0.65 (67.8 GiB of GPU), where the launched run needs far more."""
    args = ("llama-3.1-8b", "superoffload", "--dry-run", *MACHINE, "--", *script)
    code, out, err = finetune(capsys, tmp_path / "runs", *args)
    assert code == 0, err
    run_dir = _only_run_dir(tmp_path / "runs")
    _, training = _launched(run_dir)
    assert (training.max_length, training.per_device_train_batch_size) == (16384, 8)
    assert training.gradient_accumulation_steps == 4
    plan = json.loads((run_dir / "plan.json").read_text())
    run = plan["run"]
    assert (run["seq"], run["batch"], run["gradient_accumulation"]) == (16384, 8, 4)
    assert run_dir.name.startswith("llama-3.1-8b_superoffload_b8_")
    assert "batch 8 per GPU" in (run_dir / "command.sh").read_text()
    # The plan is `plan`'s for the same run, and the ratio written is its choice.
    launched = ("llama-3.1-8b", *MACHINE, "--seq", "16384", "--batch", "8", "--loss", "trl")
    launched += ("--gradient-accumulation-steps", "4", "--cast", "auto")
    same = plan_json(capsys, *launched, "--ratio", "auto")
    assert same["run"] == run and same["gpu_need_bytes"] == plan["gpu_need_bytes"]
    assert plan["host_bytes_per_rank"]["accumulation"] > 0
    deepspeed = json.loads((run_dir / "deepspeed.json").read_text())
    assert deepspeed["zero_optimization"]["offload_optimizer"]["ratio"] == run["ratio"]
    assert f"RATIO=auto: ratio {run['ratio']}," in out
    # The recipe's own seq 4096 x batch 4 leaves room for a lower ratio, which this run's GPU
    # cannot hold.
    recipe = plan_json(capsys, "llama-3.1-8b", *MACHINE, "--ratio", "auto", "--loss", "trl")
    assert recipe["run"]["ratio"] < run["ratio"]
    assert not plan_json(capsys, *launched, "--ratio", str(recipe["run"]["ratio"]))["fits"]


def test_the_last_batch_given_is_the_runs(capsys, tmp_path):
    """--batch (the launchers' second argument) comes before the script's arguments: a
    --per_device_train_batch_size after it wins in the run, and so in the plan and the name."""
    args = ("phi-4", "superoffload", "--dry-run", "--hardware", "h200", "--cpu-mem", "512")
    code, _, err = finetune(
        capsys, tmp_path / "runs", *args, "--batch", "2", "--", "--per_device_train_batch_size", "1"
    )
    assert code == 0, err
    run_dir = _only_run_dir(tmp_path / "runs")
    assert run_dir.name.startswith("phi-4_superoffload_b1_")
    assert _launched(run_dir)[1].per_device_train_batch_size == 1
    assert json.loads((run_dir / "plan.json").read_text())["run"]["batch"] == 1


def test_zerooffload_names_its_run_by_the_launched_batch(capsys, tmp_path):
    code, _, err = finetune(
        capsys, tmp_path / "runs", "qwen3-14b", "zerooffload", "--dry-run",
        "--", "--per_device_train_batch_size", "8",
    )  # fmt: skip
    assert code == 0, err
    run_dir = _only_run_dir(tmp_path / "runs")
    assert run_dir.name.startswith("qwen3-14b_zerooffload_b8_")
    assert _launched(run_dir)[1].per_device_train_batch_size == 8


def test_ratio_auto_refuses_sequence_parallelism_it_cannot_plan(capsys, tmp_path):
    """Ulysses splits each sequence over the ranks; the plan counts whole sequences a rank, so
    RATIO=auto refuses before writing anything, and a given ratio runs."""
    args = ("llama-3.1-8b", "superoffload", "--dry-run", "--gpus", "2", *MACHINE)
    sp = ("--", "--sequence_parallel_size", "2", "--max_length", "32768")
    code, _, err = finetune(capsys, tmp_path / "runs", *args, *sp)
    assert code == 2 and "RATIO=auto cannot plan --sequence_parallel_size 2" in err, err
    assert "give --ratio (RATIO)" in err and not (tmp_path / "runs").exists()
    code, _, err = finetune(capsys, tmp_path / "runs", *args, "--ratio", "1.0", *sp)
    assert code == 0, err
    recipe, _ = _launched(_only_run_dir(tmp_path / "runs"))
    assert recipe.sequence_parallel_size == 2
