"""``hf-superoffload plan RECIPE.yaml`` and ``finetune``'s RATIO=auto plan the weights the run
trains (``bf16 false``: fp32 weights, 4 bytes each) and refuse what they do not count: fp16,
which the ZeRO-3 path refuses, and ``optimizer adamw``, the Trainer's own AdamW."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_superoffload.cli import main

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

ROOT = Path(__file__).resolve().parents[1]
MACHINE = ("--gpus", "1", "--gpu-mem", "80", "--cpu-mem", "256")
FIGURES = ("run", "gpu_bytes_per_rank", "host_bytes_per_rank", "gpu_need_bytes", "host_need_bytes")


@pytest.fixture(autouse=True)
def no_variables(monkeypatch):
    for name in ("MOMENTS", "CAST", "HOST_MEMORY_GIB"):
        monkeypatch.delenv(f"HF_SUPEROFFLOAD_{name}", raising=False)


def plan(capsys, *args: str) -> tuple[int, dict | None, str]:
    code = main(["plan", *args, "--json"])
    out, err = capsys.readouterr()
    return code, json.loads(out) if code in (0, 1) else None, err


def _recipe(tmp_path: Path, extra: str) -> Path:
    recipe = tmp_path / "qwen3-14b.yaml"
    shipped = (ROOT / "examples" / "recipes" / "qwen3-14b.yaml").read_text()
    recipe.write_text(shipped + extra)
    return recipe


def test_a_recipe_of_fp32_weights_plans_fp32_weights(capsys, tmp_path):
    code, fp32, err = plan(capsys, str(_recipe(tmp_path, "bf16: false\n")), *MACHINE)
    assert code in (0, 1), err
    assert fp32["run"]["dtype_bytes"] == 4
    # The same plan as the option that says it, and not the bf16 one.
    options = ("qwen3-14b", *MACHINE, "--loss", "trl", "--cast", "auto")
    _, by_option, _ = plan(capsys, *options, "--dtype", "fp32")
    assert {k: fp32[k] for k in FIGURES} == {k: by_option[k] for k in FIGURES}
    _, bf16, _ = plan(capsys, str(_recipe(tmp_path, "bf16: true\n")), *MACHINE)
    _, default, _ = plan(capsys, *options)
    assert bf16["run"]["dtype_bytes"] == default["run"]["dtype_bytes"] == 2
    assert bf16["gpu_need_bytes"] == default["gpu_need_bytes"]
    # Twice the bytes a param on the GPU (its partition) and in the host's gradients.
    assert fp32["gpu_bytes_per_rank"]["param_partition"] == (
        2 * bf16["gpu_bytes_per_rank"]["param_partition"]
    )
    assert fp32["host_need_bytes"] > bf16["host_need_bytes"]
    # An option wins over the recipe.
    _, back, _ = plan(capsys, str(_recipe(tmp_path, "bf16: false\n")), *MACHINE, "--dtype", "bf16")
    assert {k: back[k] for k in FIGURES} == {k: bf16[k] for k in FIGURES}


@pytest.mark.parametrize(
    "setting, message",
    [
        ("fp16: true\n", "refuses fp16"),
        ("optimizer: adamw\n", "optimizer adamw trains with the Trainer's own AdamW"),
    ],
)
def test_what_the_plan_does_not_count_in_a_recipe_is_refused(capsys, tmp_path, setting, message):
    code, _, err = plan(capsys, str(_recipe(tmp_path, setting)), *MACHINE)
    assert code == 2 and message in err, err
    assert "qwen3-14b.yaml" in err


def finetune(capsys, runs: Path, *args: str) -> tuple[int, str, str]:
    code = main(["finetune", "--runs-dir", str(runs), *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_ratio_auto_plans_the_scripts_fp32_weights(capsys, tmp_path):
    runs = tmp_path / "runs"
    args = ("llama-3.1-8b", "superoffload", "--dry-run", "--gpu-mem", "80", "--cpu-mem", "512")
    code, _, err = finetune(capsys, runs, *args, "--", "--bf16", "false")
    assert code == 0, err
    (run_dir,) = runs.iterdir()
    written = json.loads((run_dir / "plan.json").read_text())
    assert written["run"]["dtype_bytes"] == 4
    same = ("llama-3.1-8b", "--gpu-mem", "80", "--cpu-mem", "512", "--loss", "trl")
    same += ("--cast", "auto")
    _, planned, _ = plan(capsys, *same, "--dtype", "fp32", "--ratio", "auto")
    assert planned["run"] == written["run"]
    assert planned["gpu_need_bytes"] == written["gpu_need_bytes"]
    # The bf16 run's plan is another: fp32 weights keep more of the state on the host.
    _, bf16, _ = plan(capsys, *same, "--ratio", "auto")
    assert bf16["run"]["ratio"] < written["run"]["ratio"]


@pytest.mark.parametrize(
    "script, message",
    [
        (("--optimizer", "adamw"), "RATIO=auto plans SuperOffload runs"),
        (("--fp16", "true", "--bf16", "false"), "refuses fp16"),
    ],
)
def test_ratio_auto_refuses_what_it_does_not_plan(capsys, tmp_path, script, message):
    runs = tmp_path / "runs"
    args = ("qwen3-14b", "superoffload", "--dry-run", "--gpu-mem", "80", "--cpu-mem", "512")
    code, _, err = finetune(capsys, runs, *args, "--", *script)
    assert code == 2 and message in err, err
    assert not runs.exists()


def test_deepspeeds_gradient_accumulation_dtype_is_an_option(capsys):
    """A DeepSpeed config with data_types.grad_accum_dtype fp32 keeps the host gradients (and
    DeepSpeed's accumulation buffer, and the compact moments' gradient slots) in fp32: planned
    as the ZeRO-3 optimizer allocates them (memory_plan.gradient_dtype, checked against
    DeepSpeed in tests/test_zero3_compact.py's bf16-fp32-gradients case)."""
    from hf_superoffload.cli.model_source import resolve
    from hf_superoffload.zero3.memory_plan import Zero3Run, zero3_memory_plan

    run = ("--seq", "4096", "--batch", "4", "--moments", "compact", "--ratio", "1.0")
    _, default, _ = plan(capsys, "qwen3-14b", *MACHINE, *run, "--gradient-accumulation-steps", "2")
    code, fp32, err = plan(
        capsys, "qwen3-14b", *MACHINE, *run, "--gradient-accumulation-steps", "2",
        "--grad-accum-dtype", "fp32",
    )  # fmt: skip
    assert code in (0, 1), err
    assert fp32["run"]["grad_accum_dtype"] == "fp32" and default["run"]["grad_accum_dtype"] is None
    host, base = fp32["host_bytes_per_rank"], default["host_bytes_per_rank"]
    for key in ("gradients", "accumulation", "grad_slots"):
        assert host[key] == 2 * base[key] > 0, key
    config = resolve("qwen3-14b").config
    expected = zero3_memory_plan(
        config,
        Zero3Run(
            seq=4096, batch=4, compact_moments=True, gradient_accumulation=2,
            grad_accum_dtype="fp32", fused_cross_entropy=fp32["run"]["fused_cross_entropy"],
        ),
    )  # fmt: skip
    assert host["gradients"] == expected.host["gradients"]
    with pytest.raises(SystemExit) as refused:  # fp16: refused on the ZeRO-3 path anyway
        main(["plan", "qwen3-14b", *MACHINE, "--grad-accum-dtype", "fp16"])
    assert refused.value.code == 2 and "invalid choice" in capsys.readouterr().err
