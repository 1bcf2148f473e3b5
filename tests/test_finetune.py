"""``hf-superoffload finetune MODEL MODE``: the recipe launcher's logic (examples/finetune_*.sh
call it; tests/test_recipes.py runs those wrappers). In-process, with --dry-run: the run
directory it writes, the ratio it chooses, the command it would launch, and its refusals, each
pointing at a command that explains it."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest
import yaml

from hf_superoffload.cli import finetune
from hf_superoffload.cli import main as cli_main
from hf_superoffload.recipes import arguments
from hf_superoffload.recipes.hub_access import choose_offline_mode
from hf_superoffload.zero3.loss_memory import trl_loss_bytes

REPO = Path(__file__).resolve().parents[1]


def finetune_cli(capsys, tmp_path, *args: str) -> tuple[int, str, str]:
    code = cli_main(["finetune", "--runs-dir", str(tmp_path / "runs"), *args])
    out, err = capsys.readouterr()
    return code, out, err


def cli_output(capsys, *args: str) -> tuple[int, str, str]:
    code = cli_main([*args, "--json"])
    out, err = capsys.readouterr()
    return code, out, err


def _run_dir(tmp_path: Path) -> Path:
    (run_dir,) = (tmp_path / "runs").iterdir()
    return run_dir


def _command(run_dir: Path) -> list[str]:
    return shlex.split((run_dir / "command.sh").read_text().splitlines()[-1])


def test_a_dry_run_writes_the_configs_and_a_command_that_parses(capsys, tmp_path):
    code, out, _ = finetune_cli(
        capsys, tmp_path, "phi-4", "superoffload", "--dry-run", "--ratio", "0.9",
        "--batch", "2", "--", "--max_steps", "5",
    )  # fmt: skip
    assert code == 0
    run_dir = _run_dir(tmp_path)
    assert run_dir.name.startswith("phi-4_superoffload_b2_")
    assert f"run directory: {run_dir}" in out
    offload = json.loads((run_dir / "deepspeed.json").read_text())["zero_optimization"]
    assert offload["offload_optimizer"] == {**offload["offload_optimizer"], "ratio": 0.9}
    assert offload["offload_optimizer"]["super_offload"] == "hf_superoffload"
    accelerate = yaml.safe_load((run_dir / "accelerate.yaml").read_text())
    assert accelerate["num_processes"] == 1
    assert accelerate["deepspeed_config"]["deepspeed_config_file"] == str(
        run_dir / "deepspeed.json"
    )
    command = _command(run_dir)
    assert command[:4] == [
        "accelerate",
        "launch",
        "--config_file",
        str(run_dir / "accelerate.yaml"),
    ]
    assert command[4] == str(REPO / "examples" / "sft.py")
    _, training = arguments.parse("sft", [*command[5:], "--bf16", "false"])
    assert training.per_device_train_batch_size == 2 and training.max_steps == 5
    assert not (run_dir / "plan.json").exists()  # a given ratio is not planned


def test_script_arguments_pass_through_with_or_without_the_separator(capsys, tmp_path):
    code, _, _ = finetune_cli(
        capsys, tmp_path, "qwen3-14b", "zerooffload", "--dry-run", "--max_steps", "7",
        "--save_model", "false",
    )  # fmt: skip
    assert code == 0
    command = _command(_run_dir(tmp_path))
    assert command[-4:] == ["--max_steps", "7", "--save_model", "false"]
    assert command[command.index("--optimizer") + 1] == "adamw"  # the baseline's optimizer
    recipe, _ = arguments.parse("sft", [*command[5:], "--bf16", "false"])
    assert recipe.save_model is False


def test_random_init_trains_the_bundled_data_offline(capsys, tmp_path):
    code, _, _ = finetune_cli(
        capsys, tmp_path, "llama-3.1-8b", "superoffload", "--dry-run", "--random-init",
        "--ratio", "1.0",
    )  # fmt: skip
    assert code == 0
    run_dir = _run_dir(tmp_path)
    # The script goes offline by itself (nothing from the Hub): no variable forced here.
    assert "HF_HUB_OFFLINE" not in (run_dir / "command.sh").read_text()
    environ: dict[str, str] = {}
    assert choose_offline_mode(_command(run_dir)[5:], environ)
    assert environ == {"HF_HUB_OFFLINE": "1"}
    recipe, training = arguments.parse("sft", [*_command(run_dir)[5:], "--bf16", "false"])
    assert recipe.random_init_from_config == "llama-3.1-8b"
    assert recipe.dataset_path == str(REPO / "examples" / "data" / "arithmetic_sft.jsonl")
    assert training.packing is False  # each row fills max_length (recipes/data.fill_sequences)


def test_ratio_auto_writes_the_plans_ratio_and_keeps_the_plan(capsys, tmp_path):
    code, out, _ = finetune_cli(
        capsys, tmp_path, "llama-3.1-8b", "superoffload", "--dry-run",
        "--hardware", "h100", "--cpu-mem", "512",
    )  # fmt: skip
    assert code == 0
    assert "RATIO=auto: ratio 0.7" in out
    run_dir = _run_dir(tmp_path)
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["run"]["ratio"] == 0.7 and plan["fits"]
    offload = json.loads((run_dir / "deepspeed.json").read_text())["zero_optimization"]
    assert offload["offload_optimizer"]["ratio"] == 0.7


@pytest.mark.parametrize("liger", [False, True], ids=["plain", "use_liger_kernel"])
def test_ratio_auto_counts_trls_fused_head_not_the_full_logits(capsys, tmp_path, liger):
    """examples/sft.py computes the loss through TRL's fused LM head, with or without
    --use_liger_kernel (TRL refuses Liger's fused cross-entropy beside it): the plan counts that
    head, not a batch's full logits, and so keeps more optimizer state on the GPU (Llama-3.1-8B
    on an H100: ratio 0.7 where the full logits leave room for 0.85 only)."""
    script = ["--", "--use_liger_kernel", "true"] if liger else []
    machine = ("--hardware", "h100", "--cpu-mem", "512")
    code, _, _ = finetune_cli(
        capsys, tmp_path, "llama-3.1-8b", "superoffload", "--dry-run", *machine, *script
    )
    assert code == 0
    plan = json.loads((_run_dir(tmp_path) / "plan.json").read_text())
    assert plan["run"]["fused_cross_entropy"] == "trl"
    head = trl_loss_bytes(4 * 4096, 4096, 128256, 2)
    assert plan["gpu_bytes_per_rank"]["logits_and_loss"] == head
    code, out, _ = cli_output(capsys, "plan", "llama-3.1-8b", *machine, "--ratio", "auto")
    full = json.loads(out)
    assert code == 0 and full["run"]["fused_cross_entropy"] is None
    assert full["run"]["ratio"] == 0.85 > plan["run"]["ratio"]


def test_ratio_auto_counts_the_full_logits_of_label_smoothing(capsys, tmp_path):
    """With --label_smoothing_factor, TRL's SFTTrainer (1.16) computes the loss from the
    batch's full logits (transformers' LabelSmoother), not through its fused head: the plan
    counts what the smoother holds of those logits (Llama-3.1-8B at seq 4096, batch 4 in bf16:
    19.6 GiB against 3.6), as the plan of the same recipe setting it does; TRL's "dft" loss
    keeps the fused head."""
    machine = ("--hardware", "h100", "--cpu-mem", "512")
    smoothing = ("--", "--label_smoothing_factor", "0.1")
    code, _, _ = finetune_cli(
        capsys, tmp_path, "llama-3.1-8b", "superoffload", "--dry-run", *machine, *smoothing
    )
    assert code == 0
    plan = json.loads((_run_dir(tmp_path) / "plan.json").read_text())
    assert plan["run"]["fused_cross_entropy"] is None and plan["run"]["label_smoothing"]
    logits = plan["gpu_bytes_per_rank"]["logits_and_loss"]
    assert logits / 2**30 == pytest.approx(19.57, abs=0.01)
    assert logits > 5 * trl_loss_bytes(4 * 4096, 4096, 128256, 2)
    code, out, _ = cli_output(
        capsys, "plan", "llama-3.1-8b", *machine, "--ratio", "auto", "--loss", "smoothed",
        "--cast", "auto",
    )  # fmt: skip
    by_option = json.loads(out)
    assert code == 0 and plan["run"] == by_option["run"]
    recipe = tmp_path / "llama-3.1-8b.yaml"
    recipes = Path(__file__).resolve().parents[1] / "examples" / "recipes"
    recipe.write_text((recipes / "llama-3.1-8b.yaml").read_text() + "label_smoothing_factor: 0.1\n")
    code, out, _ = cli_output(capsys, "plan", str(recipe), *machine, "--ratio", "auto")
    by_recipe = json.loads(out)
    assert code == 0 and by_recipe["run"] == plan["run"]
    assert any("label_smoothing_factor 0.1" in note for note in by_recipe["notes"])
    dft = (*smoothing, "--loss_type", "dft")
    code, _, _ = finetune_cli(
        capsys, tmp_path / "dft", "llama-3.1-8b", "superoffload", "--dry-run", *machine, *dft
    )
    plan = json.loads((_run_dir(tmp_path / "dft") / "plan.json").read_text())
    assert code == 0 and plan["run"]["fused_cross_entropy"] == "trl"


def test_a_run_that_fits_at_no_ratio_names_the_plan_that_explains_it(capsys, tmp_path):
    code, _, err = finetune_cli(
        capsys, tmp_path, "qwen3-14b", "superoffload", "--dry-run", "--hardware", "h100"
    )
    assert code == 1 and "host: needs" in err, err
    assert not (tmp_path / "runs").exists()  # nothing written
    quoted = re.search(r"`hf-superoffload (plan [^`]*)`", err)
    assert quoted, err
    assert cli_main(shlex.split(quoted.group(1))) == 1  # the plan that explains it: no fit
    assert "does not fit, because host" in capsys.readouterr().out


def test_too_few_gpus_names_a_plan_command_that_runs(capsys, tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    code, _, err = finetune_cli(capsys, tmp_path, "llama-3.3-70b", "superoffload")
    assert code == 1 and "llama-3.3-70b runs on 4 GPU(s); this machine has 1" in err, err
    quoted = re.search(r"`hf-superoffload (plan [^`]*)`", err)
    assert quoted and "--gpus 4" in quoted.group(1), err
    assert cli_main(shlex.split(quoted.group(1))) in (0, 1)  # a plan, not a usage error
    assert "per GPU" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["qwen3-14b", "superoffload", "--ratio", "1.5"], "RATIO must be 'auto' or a number"),
        (["qwen3-14b", "zerooffload", "--ratio", "0.9"], "RATIO applies to superoffload mode"),
        (["qwen3-14b", "zerooffload", "--hardware", "h100"], "plan superoffload runs"),
        (["qwen9-1t", "superoffload"], "the recipes are gpt-oss-20b"),
        (
            ["qwen3-14b", "superoffload", "--gpus", "0", "--ratio", "1.0"],
            "--gpus must be at least 1",
        ),
    ],
)
def test_bad_input_exits_2_and_writes_nothing(capsys, tmp_path, args, message):
    code, _, err = finetune_cli(capsys, tmp_path, *args, "--dry-run")
    assert code == 2 and message in err, err
    assert not (tmp_path / "runs").exists()


def test_a_bad_mode_or_batch_is_a_usage_error(capsys, tmp_path):
    for args, message in (
        (["phi-4", "fastoffload"], "invalid choice: 'fastoffload'"),
        (["phi-4", "superoffload", "--batch", "four"], "batch_size must be a positive integer"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            finetune_cli(capsys, tmp_path, *args)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_a_launch_runs_the_command_and_keeps_its_log(capsys, tmp_path, monkeypatch):
    """Without --dry-run the written command runs from the checkout, its output shown and kept
    in train.log, its exit code returned (the command replaced: accelerate would train)."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the launcher forces none
    prepare = finetune.prepare

    def prepared(args):
        run_dir, _, variables = prepare(args)
        script = "import os; print('trained', os.getcwd(), os.getenv('HF_HUB_OFFLINE')); exit(3)"
        return run_dir, [sys.executable, "-c", script], variables

    monkeypatch.setattr(finetune, "prepare", prepared)
    code, out, _ = finetune_cli(
        capsys, tmp_path, "phi-4", "superoffload", "--ratio", "1.0", "--random-init"
    )
    assert code == 3
    assert f"trained {REPO} None" in out  # offline mode is the script's decision
    assert (_run_dir(tmp_path) / "train.log").read_text() == f"trained {REPO} None\n"


def test_a_dry_run_without_a_gpu_or_a_machine_writes_ratio_1(capsys, tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = finetune_cli(capsys, tmp_path, "phi-4", "superoffload", "--dry-run")
    assert code == 0 and "no GPU here to plan for, so this dry run writes ratio 1.0" in err
    offload = json.loads((_run_dir(tmp_path) / "deepspeed.json").read_text())
    assert offload["zero_optimization"]["offload_optimizer"]["ratio"] == 1.0


def test_a_run_that_saves_nothing_is_planned_without_the_save(capsys, tmp_path):
    """Llama-3.1-8B on 4 GPUs with 21 GiB of host each fits only when nothing is saved (the
    save holds a 5 GB shard of the 16-bit model on rank 0's host): the refusal says so, and
    --save_model false (the recipe's save_strategy is no) plans without it."""
    args = ("llama-3.1-8b", "superoffload", "--dry-run", "--gpus", "4", "--hardware", "h100")
    args = (*args, "--cpu-mem", "21")
    code, _, err = finetune_cli(capsys, tmp_path, *args)
    assert code == 1 and "while the model is saved" in err, err
    assert "change: --no-save: --ratio auto chooses 0.5" in err
    assert "saves nothing when given --save_model false" in err
    code, out, _ = finetune_cli(capsys, tmp_path, *args, "--", "--save_model", "false")
    assert code == 0 and "RATIO=auto: ratio 0.5" in out
    plan = json.loads((_run_dir(tmp_path) / "plan.json").read_text())
    assert plan["run"]["saves_model"] is False and plan["host_save_bytes_rank0"] == 0
    assert _command(_run_dir(tmp_path))[-2:] == ["--save_model", "false"]
    # A run that still writes checkpoints saves: planned with the save.
    code, _, _ = finetune_cli(
        capsys, tmp_path / "steps", *args, "--", "--save_model", "false", "--save_strategy", "steps"
    )
    assert code == 1


@pytest.mark.parametrize("gpus", [4, 8])
def test_any_gpu_count_runs_the_shipped_settings_on_that_many_processes(capsys, tmp_path, gpus):
    code, _, _ = finetune_cli(
        capsys, tmp_path, "llama-3.1-8b", "superoffload", "--dry-run", "--gpus", str(gpus),
        "--ratio", "1.0",
    )  # fmt: skip
    assert code == 0
    accelerate = yaml.safe_load((_run_dir(tmp_path) / "accelerate.yaml").read_text())
    assert accelerate["num_processes"] == gpus and accelerate["distributed_type"] == "DEEPSPEED"


def test_compact_moments_are_planned_from_the_script_arguments(capsys, tmp_path):
    """--superoffload_moments compact (passed to examples/sft.py) plans compact moments: Phi-4
    on one H200 with a 128 GiB host fits at ratio 0.5 with them and at none without; and a plan
    that does not fit for the host names --moments compact when it would."""
    machine = ("--hardware", "h200")
    code, _, err = finetune_cli(capsys, tmp_path, "phi-4", "superoffload", "--dry-run", *machine)
    assert code == 1 and "--moments compact fits at --ratio 0.5" in err, err
    script = ("--", "--superoffload_moments", "compact")
    code, _, _ = finetune_cli(
        capsys, tmp_path, "phi-4", "superoffload", "--dry-run", *machine, *script
    )
    assert code == 0
    plan = json.loads((_run_dir(tmp_path) / "plan.json").read_text())
    assert plan["run"]["compact_moments"] is True and plan["run"]["ratio"] == 0.5
    assert "--superoffload_moments compact" in (_run_dir(tmp_path) / "command.sh").read_text()


def test_ratio_auto_plans_a_run_without_activation_checkpointing(capsys, tmp_path):
    """--activation_checkpointing false (or gradient_checkpointing, either in the recipe) is
    planned with every layer's saved tensors on the GPU: Llama-3.1-8B at batch 4 then fits an
    H100 at no ratio, and the refusal names checkpointing; at batch 1 it fits."""
    args = ("llama-3.1-8b", "superoffload", "--dry-run", "--hardware", "h100")
    off = ("--", "--activation_checkpointing", "false")
    code, _, err = finetune_cli(capsys, tmp_path / "b4", *args, *off)
    assert code == 1 and "largest part: layer_activations" in err, err
    assert "change: --activation-checkpointing on fits" in err
    assert "--activation-checkpointing off" in err  # the plan command it names
    code, out, _ = finetune_cli(capsys, tmp_path, *args, "--batch", "1", *off)
    assert code == 0 and "RATIO=auto: ratio" in out
    plan = json.loads((_run_dir(tmp_path) / "plan.json").read_text())
    assert plan["run"]["activation_checkpointing"] is False
    assert "layer_activations" in plan["gpu_bytes_per_rank"]
    assert "layer_inputs" not in plan["gpu_bytes_per_rank"]


@pytest.mark.parametrize(
    ("model", "script_args", "message"),
    [
        ("phi-4", [], "'phi3' layers save other tensors"),
        (
            "llama-3.1-8b",
            ["--activation_checkpoint_offload"],
            "--activation_checkpoint_offload moves the inputs activation checkpointing keeps",
        ),
    ],
)
def test_ratio_auto_refuses_what_it_cannot_plan_without_checkpointing(
    capsys, tmp_path, model, script_args, message
):
    code, _, err = finetune_cli(
        capsys, tmp_path, model, "superoffload", "--dry-run", "--hardware", "h100",
        "--", "--activation_checkpointing", "false", *script_args,
    )  # fmt: skip
    assert code == 2 and message in err, err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry_run", "launch"])
@pytest.mark.parametrize(
    "script", [["--", "--superoffload_moments", "compact"], ["--superoffload_cast=cpu"]]
)
def test_zerooffload_refuses_superoffload_arguments_before_writing(
    capsys, tmp_path, dry_run, script
):
    """zerooffload launches the recipe with --optimizer adamw, whose parser refuses
    superoffload_* arguments; finetune refuses them with its check before the run directory is
    written (a launch too, where the GPU check would otherwise stop it first)."""
    flags = ["--dry-run"] if dry_run else []
    code, _, err = finetune_cli(capsys, tmp_path, "llama-3.1-8b", "zerooffload", *flags, *script)
    assert code == 2, err
    name = script[-1].split("=")[0] if "=" in script[-1] else script[-2]
    assert f"which does not read {name}: drop them" in err, err
    assert "zerooffload (the baseline" in err and "or run superoffload mode" in err
    assert not (tmp_path / "runs").exists()


def test_zerooffload_refuses_engine_variables_before_writing(capsys, tmp_path, monkeypatch):
    """zerooffload's DeepSpeed config asks for no SuperOffload, so the launched run would
    refuse the engine's variables (after loading the model): refused here, before the run
    directory is written; the package's other variables pass."""
    monkeypatch.setenv("HF_SUPEROFFLOAD_CPU_THREADS", "14")
    monkeypatch.setenv("HF_SUPEROFFLOAD_MOMENTS", "compact")
    monkeypatch.setenv("HF_SUPEROFFLOAD_HOST_MEMORY_GIB", "64")
    code, _, err = finetune_cli(capsys, tmp_path, "llama-3.1-8b", "zerooffload", "--dry-run")
    assert code == 2, err
    assert "reads none of HF_SUPEROFFLOAD_CPU_THREADS, HF_SUPEROFFLOAD_MOMENTS (" in err, err
    assert "Unset them for this run" in err and "or run superoffload mode" in err
    assert not (tmp_path / "runs").exists()
    monkeypatch.delenv("HF_SUPEROFFLOAD_CPU_THREADS")
    monkeypatch.delenv("HF_SUPEROFFLOAD_MOMENTS")
    code, _, err = finetune_cli(capsys, tmp_path, "llama-3.1-8b", "zerooffload", "--dry-run")
    assert code == 0, err


def test_zerooffload_passes_other_script_arguments_through(capsys, tmp_path):
    code, _, err = finetune_cli(
        capsys, tmp_path, "llama-3.1-8b", "zerooffload", "--dry-run", "--", "--max_steps", "3"
    )
    assert code == 0, err
    assert _command(_run_dir(tmp_path))[-2:] == ["--max_steps", "3"]


@pytest.mark.parametrize(
    ("env", "script", "cast"),
    [
        (None, [], "auto"),
        ("cpu", [], "cpu"),
        ("cpu", ["--", "--superoffload_cast", "gpu"], "gpu"),
    ],
)
def test_ratio_auto_plans_the_runs_cast(capsys, tmp_path, monkeypatch, env, script, cast):
    """The launched run's cast (its superoffload_cast, else HF_SUPEROFFLOAD_CAST, else auto) is
    known, so the plan counts the copy-out ring it makes, not the ring at its most."""
    if env is None:
        monkeypatch.delenv("HF_SUPEROFFLOAD_CAST", raising=False)
    else:
        monkeypatch.setenv("HF_SUPEROFFLOAD_CAST", env)
    machine = ("--hardware", "h100", "--cpu-mem", "512")
    code, _, err = finetune_cli(
        capsys, tmp_path, "llama-3.1-8b", "superoffload", "--dry-run", *machine, *script
    )
    assert code == 0, err
    plan = json.loads((_run_dir(tmp_path) / "plan.json").read_text())
    assert plan["run"]["cast"] == cast and plan["upper_bounds"] == []
    assert (plan["host_bytes_per_rank"]["param_copy_out"] == 0) == (cast != "cpu")
