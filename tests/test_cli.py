"""The ``hf-superoffload`` command line: ``env`` reports without building anything, ``plan``
gives the paper's fit answers for its models on GH200 and ours on the H100/H200 benchmark
machines, and bad input exits 2 with a message that says what to change."""

from __future__ import annotations

import configparser
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from hf_superoffload import env
from hf_superoffload.cli import main, model_source, ratio_auto
from hf_superoffload.ops import _build
from hf_superoffload.zero3.loss_memory import LOGIT_BYTES, liger_loss_bytes, trl_loss_bytes
from hf_superoffload.zero3.memory_plan import HOST_HEADROOM
from hf_superoffload.zero3.sub_group_cut import device_sub_group_count

ROOT = Path(__file__).resolve().parents[1]

# Published total parameter counts (model cards / papers), in billions.
PUBLISHED_PARAMS = {
    "gpt-oss-20b": 20.91,
    "qwen3-14b": 14.8,
    "phi-4": 14.7,
    "llama-3.1-8b": 8.03,
    "seed-oss-36b": 36.15,
    "qwen3-30b-a3b": 30.5,
    "llama-3.3-70b": 70.6,
}
# The paper's examples (seed README): the fewest GH200 superchips each model is fine-tuned on,
# at its settings of seq 4096 and batch 4 per GPU.
GH200_GPUS = {
    "gpt-oss-20b": 1,
    "qwen3-14b": 1,
    "phi-4": 1,
    "seed-oss-36b": 2,
    "qwen3-30b-a3b": 2,
    "llama-3.3-70b": 4,
}


def cli(capsys, *args: str) -> tuple[int, str, str]:
    try:
        code = main(list(args))
    except SystemExit as exit_:  # argparse's own errors and --help
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def plan_json(capsys, *args: str) -> tuple[int, dict]:
    code, out, err = cli(capsys, "plan", *args, "--json")
    assert code in (0, 1), err
    return code, json.loads(out)


# ----------------------------------------------------------------------------- env


def test_env_json_reports_every_section_and_builds_nothing(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_SUPEROFFLOAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(_build, "_module", None)  # as in a fresh process

    def no_build(*_, **__):
        raise AssertionError("env must not build the CPU Adam without --build")

    monkeypatch.setattr(_build, "prepare", no_build)
    monkeypatch.setattr(_build, "_build", no_build)
    code, out, _ = cli(capsys, "env", "--json")
    assert code == 0
    facts = json.loads(out)
    assert set(facts) >= {
        "hf_superoffload", "python", "platform", "packages", "torch", "cpu", "cpu_adam",
        "gpus", "numa", "host_memory", "resctrl", "deepspeed",
    }  # fmt: skip
    assert set(facts["packages"]) >= {"torch", "transformers", "accelerate", "trl", "deepspeed"}
    assert facts["torch"]["version"] == torch.__version__
    assert facts["cpu"]["logical_cores"] >= 1 and isinstance(facts["cpu"]["features"], list)
    kernel = facts["cpu_adam"]
    assert kernel["status"] in ("not built", "cannot build")
    assert kernel["isa"] in ("avx512", "avx2", "sve", "neon", "scalar")
    assert not (tmp_path / "cache").exists()
    assert all({"node", "cpus", "memory_bytes"} <= set(node) for node in facts["numa"])
    assert {"kernel_support", "mounted", "status"} <= set(facts["resctrl"])
    assert facts["deepspeed"]["zero3_path"].split(":")[0] in ("active", "inactive")
    if not torch.cuda.is_available():
        assert facts["gpus"] == [] and facts["torch"]["gpu_count"] == 0


def test_env_text_names_its_sections(capsys):
    code, out, _ = cli(capsys, "env", "--no-bandwidth")
    assert code == 0
    for section in (
        "packages",
        "CPU Adam kernel",
        "GPUs",
        "NUMA nodes",
        "host memory",
        "DeepSpeed",
        "environment",
    ):
        assert f"\n{section}" in out


def test_env_lists_the_variables_set_and_its_help_all_of_them(capsys, monkeypatch):
    for name in env.VARIABLES:  # only the one set here (a test run may set HF_SUPEROFFLOAD_CACHE)
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_SUPEROFFLOAD_CPU_THREADS", "6")
    code, out, _ = cli(capsys, "env", "--no-bandwidth")
    assert code == 0 and "  HF_SUPEROFFLOAD_CPU_THREADS=6: threads of the CPU Adam" in out
    code, out, _ = cli(capsys, "env", "--no-bandwidth", "--json")
    assert json.loads(out)["environment"] == {"HF_SUPEROFFLOAD_CPU_THREADS": "6"}
    code, out, _ = cli(capsys, "env", "--help")
    help_text = " ".join(out.split())
    for name in env.VARIABLES:
        assert name in help_text


# ---------------------------------------------------------------------- shipped configs


def test_shipped_configs_build_on_meta_at_their_published_size():
    assert set(model_source.shipped_configs()) == set(PUBLISHED_PARAMS)
    for name, published in PUBLISHED_PARAMS.items():
        config = model_source.resolve(name).config
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        params = sum(p.numel() for p in model.parameters()) / 1e9
        assert params == pytest.approx(published, rel=0.01), name


# ----------------------------------------------------------------------------- plan


def _training_fits(plan: dict) -> bool:
    """The GPU and the host while training fit (a resume may need more host memory: with
    DeepSpeed's whole-file load of the optimizer state, memory_plan.resume_extra_host_bytes)."""
    gpu_short = any(r.startswith("GPU") for r in plan["reasons"])
    per_host = plan["host_training_bytes_per_rank"] * plan["run"]["ranks_per_host"]
    return not gpu_short and per_host * (1 + HOST_HEADROOM) <= plan["hardware"]["host_memory_bytes"]


def _fits_unless_resuming(plan: dict) -> None:
    assert _training_fits(plan), plan["reasons"]
    if not plan["fits"]:  # then only a resume's or a save's peak does not
        assert plan["host_peak"] in ("resume", "save"), plan["reasons"]
        (reason,) = plan["reasons"]
        assert reason.startswith("host: needs")
        assert "while a checkpoint is loaded" in reason or "while the model is saved" in reason


@pytest.mark.parametrize("model", sorted(GH200_GPUS))
def test_plan_agrees_with_the_paper_on_gh200(capsys, model):
    gpus = GH200_GPUS[model]
    code, plan = plan_json(capsys, model, "--hardware", "gh200", "--gpus", str(gpus))
    assert code == (0 if plan["fits"] else 1)
    _fits_unless_resuming(plan)  # the paper trains it there
    assert plan["run"]["ranks_per_host"] == 1  # each superchip its own memory
    if gpus > 1:  # and on half as many it does not
        code, fewer = plan_json(capsys, model, "--hardware", "gh200", "--gpus", str(gpus // 2))
        assert code == 1 and not fewer["fits"]
        assert fewer["reasons"][0].startswith("GPU: needs")
        if plan["fits"]:
            assert any(s.startswith(f"--gpus {gpus} ") for s in fewer["suggestions"])


def test_llama_8b_trains_on_one_h100_and_one_h200(capsys):
    # Measured: 43.1 GiB GPU and 107.1 GiB host on the H100 (docs/benchmarks.md, "Memory plan").
    for hardware in ("h100", "h200"):
        code, plan = plan_json(capsys, "llama-3.1-8b", "--hardware", hardware)
        _fits_unless_resuming(plan)
        assert code == (0 if plan["fits"] else 1)
        _, out, _ = cli(capsys, "plan", "llama-3.1-8b", "--hardware", hardware)
        assert "param_partition" in out and "moments" in out and "resume" in out


def test_a_save_or_resume_that_does_not_fit_the_host_is_a_shortfall(capsys):
    # The same run on a host that holds training but not its save (rank 0's shard of the
    # 16-bit model) or its resume (saved sub groups mapped beside the live state). On one
    # rank a host the resume is the peak; on four (1 per host) the partition is small beside
    # the save's 5 GB shard, and the save is.
    phases = (
        ("1", "resume", "while a checkpoint is loaded"),
        ("4", "save", "while the model is saved"),
    )
    for gpus, phase, why in phases:
        run = ("llama-3.1-8b", "--hardware", "h100", "--gpus", gpus)
        _, plan = plan_json(capsys, *run, "--cpu-mem", "1000")
        training = plan["host_training_bytes_per_rank"] * (1 + HOST_HEADROOM) / 2**30
        peak_bytes = max(plan["host_resume_bytes_per_rank"], plan["host_save_bytes_rank0"])
        assert plan["host_total_bytes_per_rank"] == peak_bytes
        peak = peak_bytes * (1 + HOST_HEADROOM) / 2**30
        assert peak > training + 1
        code, short = plan_json(capsys, *run, "--cpu-mem", f"{(training + peak) / 2:.1f}")
        assert code == 1 and short["host_peak"] == plan["host_peak"] == phase
        (reason,) = short["reasons"]
        assert reason.startswith("host: needs") and why in reason


def test_a_run_that_does_not_fit_says_why_and_what_to_change(capsys):
    # Twice the batch: the logits outgrow the H100; halving it back fits (a host of 512 GiB:
    # the GPU alone decides).
    code, out, _ = cli(
        capsys, "plan", "llama-3.1-8b", "--hardware", "h100", "--batch", "8", "--cpu-mem", "512"
    )
    assert code == 1
    assert "does not fit, because GPU: needs" in out and "change: --batch 4 fits" in out
    # Qwen3-14B's 14 B/param of host state is more than the H100 host's 125 GiB.
    code, plan = plan_json(capsys, "qwen3-14b", "--hardware", "h100")
    assert code == 1 and plan["reasons"][0].startswith("host: needs")
    assert plan["host_need_bytes"] > plan["hardware"]["host_memory_bytes"]


def _host_need_gib(capsys, *args: str) -> float:
    return plan_json(capsys, *args, "--json")[1]["host_need_bytes"] / 2**30


def test_ratio_auto_picks_the_lowest_ratio_that_fits_with_gpu_room(capsys):
    # Llama-3.1-8B on one H100 (a host that holds it, 512 GiB): 0.85 ran (65.4 GiB allocated;
    # 0.75 ran out of GPU memory; docs/benchmarks.md); 0.8 is planned beyond the card.
    h100 = ("llama-3.1-8b", "--hardware", "h100", "--cpu-mem", "512")
    code, plan = plan_json(capsys, *h100, "--ratio", "auto")
    assert code == 0 and plan["fits"] and plan["run"]["ratio"] == 0.85
    assert plan["gpu_need_bytes"] <= ratio_auto.GPU_SHARE * plan["hardware"]["gpu_memory_bytes"]
    assert any(n.startswith("--ratio auto chose 0.85") for n in plan["notes"])
    _, lower = plan_json(capsys, *h100, "--ratio", "0.8")
    assert not lower["fits"] and lower["reasons"][0].startswith("GPU: needs")
    # Where the host cannot hold all the state, a lower ratio is what makes it fit.
    h200 = ("qwen3-14b", "--hardware", "h200")
    host = _host_need_gib(capsys, *h200, "--ratio", "0.9", "--cpu-mem", "1000") + 0.1
    code, plan = plan_json(capsys, *h200, "--cpu-mem", f"{host:.1f}", "--ratio", "auto")
    _, full = plan_json(capsys, *h200, "--cpu-mem", f"{host:.1f}")
    assert code == 0 and plan["run"]["ratio"] <= 0.9 and not full["fits"]
    # Nothing fits: the plan at 1.0, saying so.
    code, plan = plan_json(capsys, "qwen3-14b", "--hardware", "h100", "--ratio", "auto")
    assert code == 1 and plan["run"]["ratio"] == 1.0
    assert any("no ratio from 1.0 down to 0.5 fits" in n for n in plan["notes"])
    assert not any(s.startswith("--ratio") for s in plan["suggestions"])
    # Only a ratio without the GPU margin fits: auto does not choose it but names it. A host
    # that holds 0.85 but not 0.9, a card on which 0.85 fits with under 5% to spare.
    tight = ("llama-3.1-8b", "--hardware", "h100", "--gpu-mem", "76")
    host = _host_need_gib(capsys, *tight, "--ratio", "0.85", "--cpu-mem", "1000") + 0.1
    code, plan = plan_json(capsys, *tight, "--cpu-mem", f"{host:.1f}", "--ratio", "auto")
    assert code == 1 and plan["run"]["ratio"] == 1.0
    assert any(s.startswith("--ratio 0.85 fits, with under 5%") for s in plan["suggestions"])


def test_plan_follows_the_sub_group_size(capsys):
    # Smaller sub groups (the larger matrices alone): ratio 0.9 keeps a tenth of more of them.
    args = ("llama-3.1-8b", "--hardware", "h100", "--ratio", "0.9")
    _, shipped = plan_json(capsys, *args)
    _, small = plan_json(capsys, *args, "--sub-group-size", str(1 << 23))
    assert shipped["sub_groups"]["count"] == 163 and shipped["sub_groups"]["on_gpu"] == 16
    assert small["sub_groups"]["count"] > 163
    assert small["sub_groups"]["on_gpu"] == device_sub_group_count(
        0.9, small["sub_groups"]["count"]
    )
    assert "param_numels" not in shipped["model"]  # the per-param lists stay out of the output


class _Scripted:
    def __init__(self, fits, gpu_need, gpu_memory=100):
        self.fits, self.gpu_need, self.gpu_memory = fits, gpu_need, gpu_memory


@pytest.mark.parametrize(
    ("host_fits_below", "gpu_need_at", "expected"),
    [
        (1.01, lambda r: 52 + 200 * (1 - r), 0.8),  # below 0.8 the need passes 95% of the GPU
        (1.01, lambda r: 97, 1.0),  # 1.0 needs no room to spare; below it, none is left
        (0.71, lambda r: 52 + 200 * (1 - r), None),  # the host needs <= 0.7, the GPU >= 0.85
        (0.91, lambda r: 10, 0.5),  # plenty of GPU: down to the floor
    ],
)
def test_lowest_fitting_ratio_on_scripted_plans(host_fits_below, gpu_need_at, expected):
    def judge(ratio):
        need = gpu_need_at(ratio)
        return _Scripted(fits=ratio < host_fits_below and need <= 100, gpu_need=need)

    assert ratio_auto.lowest_fitting_ratio(judge) == expected


GIB = 2**30
GRACE = 480 * 10**9  # LPDDR5X per Grace CPU, decimal GB


@pytest.mark.parametrize(
    ("hardware", "gpus", "per_host", "host_bytes", "gpu_gib"),
    [
        ("h100-sxm-8", 2, 2, 2000 * GIB, 79.18),  # the ranks on a node share its 2 TiB
        ("h100-sxm-8", 8, 8, 2000 * GIB, 79.18),
        ("h200-sxm-8", 16, 8, 2000 * GIB, 139.9),  # two nodes of 8
        ("gb200", 4, 2, GRACE, 186 * 0.99),  # each Grace's memory is its 2 GPUs'
        ("gb200", 2, 2, GRACE, 186 * 0.99),
        ("gh200", 4, 1, GRACE, 95.1),  # each superchip its own Grace
        ("gh200-144gb", 1, 1, GRACE, 144 * 0.99),
        ("h100", 2, 1, 125 * GIB, 79.18),  # two one-GPU VMs
    ],
)
def test_node_presets_share_host_memory_between_the_ranks_on_it(
    capsys, hardware, gpus, per_host, host_bytes, gpu_gib
):
    _, plan = plan_json(capsys, "llama-3.1-8b", "--hardware", hardware, "--gpus", str(gpus))
    assert plan["run"]["ranks"] == gpus and plan["run"]["ranks_per_host"] == per_host
    assert plan["hardware"]["host_memory_bytes"] == host_bytes
    assert plan["hardware"]["gpu_memory_bytes"] == int(gpu_gib * GIB)


def test_an_eight_gpu_node_plans_what_one_gpu_vm_cannot(capsys):
    """Qwen3-14B does not fit one H100 VM's 128 GiB host, and fits 2 GPUs of a DGX H100."""
    code, _ = plan_json(capsys, "qwen3-14b", "--hardware", "h100")
    assert code == 1
    code, plan = plan_json(capsys, "qwen3-14b", "--hardware", "h100-sxm-8", "--gpus", "2")
    assert code == 0, plan["reasons"]
    _, out, _ = cli(capsys, "plan", "qwen3-14b", "--hardware", "h100-sxm-8", "--gpus", "2")
    assert "hardware: h100-sxm-8: 79.2 GiB per GPU, 2000.0 GiB per host of 2 GPU(s)" in out


def test_no_save_leaves_out_the_save_and_is_suggested_where_it_fits(capsys):
    # Four ranks, one a host: rank 0's save (a 5 GB shard and one param) is the host's peak,
    # and a 28 GiB host holds training and a resume but not it.
    run = ("llama-3.1-8b", "--hardware", "h100", "--gpus", "4")
    code, saved = plan_json(capsys, *run, "--ratio", "0.8", "--cpu-mem", "28")
    assert code == 1 and saved["host_peak"] == "save"
    assert any(s.startswith("--no-save fits") for s in saved["suggestions"]), saved
    code, unsaved = plan_json(capsys, *run, "--ratio", "0.8", "--cpu-mem", "28", "--no-save")
    assert code == 0 and unsaved["host_save_bytes_rank0"] == 0
    assert unsaved["host_training_bytes_per_rank"] == saved["host_training_bytes_per_rank"]
    _, auto = plan_json(capsys, *run, "--ratio", "auto", "--cpu-mem", "21")
    assert "--no-save: --ratio auto chooses 0.5 (a run that saves nothing" in " ".join(
        auto["suggestions"]
    )


def test_explicit_sizes_correct_a_preset(capsys):
    _, plan = plan_json(
        capsys, "llama-3.1-8b", "--hardware", "gb200", "--gpus", "4", "--gpu-mem", "180",
        "--cpu-mem", "400",
    )  # fmt: skip
    assert plan["hardware"]["gpu_memory_bytes"] == 180 * GIB
    assert plan["hardware"]["host_memory_bytes"] == 400 * GIB
    assert plan["run"]["ranks_per_host"] == 2  # the preset's domains stay


def test_plans_a_local_directory_or_config_file_with_explicit_sizes(capsys, tmp_path):
    config = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        vocab_size=1000,
    )  # fmt: skip
    config.save_pretrained(tmp_path)
    for spec in (str(tmp_path), str(tmp_path / "config.json")):
        code, plan = plan_json(capsys, spec, "--gpu-mem", "16", "--cpu-mem", "32", "--seq", "128")
        assert code == 0 and plan["model"]["model_type"] == "llama"
        assert plan["hardware"]["name"] == "custom"
        assert plan["gpu_total_bytes"] == sum(plan["gpu_bytes_per_rank"].values())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["no/such/model"], "shipped:"),
        (["llama-3.1-8b", "--hardware", "tpu"], "choose one of h100-sxm-8, h200-sxm-8, h100"),
        (["llama-3.1-8b", "--hardware", "h100", "--gpus", "0"], "--gpus must be at least 1"),
        (["llama-3.1-8b", "--hardware", "h100", "--ratio", "1.5"], "--ratio must be 'auto' or"),
        (["llama-3.1-8b", "--hardware", "h100", "--ratio", "most"], "--ratio must be 'auto' or"),
        (["llama-3.1-8b", "--hardware", "h100", "--gpu-mem", "-1"], "--gpu-mem must be"),
        (["llama-3.1-8b", "--hardware", "h100", "--gpus-per-host", "0"], "--gpus-per-host must"),
    ],
)
def test_bad_input_exits_2_saying_what_to_change(capsys, args, message):
    code, out, err = cli(capsys, "plan", *args)
    assert code == 2 and out == ""
    assert message in err and err.startswith("hf-superoffload plan: error:")


def test_bad_config_files_exit_2(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "alien.json").write_text('{"model_type": "no_such_architecture"}')
    (tmp_path / "wide.json").write_text('{"model_type": "llama", "hidden_size": "wide"}')
    for spec, message in (
        (tmp_path / "empty", "without a config.json"),
        (tmp_path / "broken.json", "cannot read"),
        (tmp_path / "alien.json", "cannot build model_type 'no_such_architecture'"),
        (tmp_path / "wide.json", "a field has a value of the wrong type"),
    ):
        code, _, err = cli(capsys, "plan", str(spec), "--hardware", "h100")
        assert code == 2 and message in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="plans for this machine's GPU here")
def test_without_a_gpu_or_hardware_it_asks_for_one(capsys):
    code, _, err = cli(capsys, "plan", "llama-3.1-8b")
    assert code == 2 and "--hardware h100-sxm-8|h200-sxm-8|h100|h200|gh200|" in err


def test_json_output_parses_when_libraries_print_as_they_load():
    """transformers prints to stdout on import under WANDB_MODE=offline (a common cluster
    setting); the recipe launchers parse `plan --json`, so only the JSON may reach stdout."""
    env = {**os.environ, "WANDB_MODE": "offline"}
    plan = ["plan", "llama-3.1-8b", "--hardware", "h100", "--cpu-mem", "512"]  # fits: exit 0
    for args in (plan, ["env", "--no-bandwidth"]):
        proc = subprocess.run(
            [sys.executable, "-m", "hf_superoffload", *args, "--json"],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert isinstance(json.loads(proc.stdout), dict)


def test_argparse_errors_exit_2(capsys):
    code, _, err = cli(capsys, "plan", "llama-3.1-8b", "--gpus", "two")
    assert code == 2 and "invalid int value" in err


def test_plans_a_recipe_with_its_sequence_length_and_batch(capsys, tmp_path):
    shipped = ROOT / "examples" / "recipes" / "qwen3-30b-a3b.yaml"
    _, by_recipe = plan_json(capsys, str(shipped), "--hardware", "gh200", "--gpus", "2")
    # A recipe's run: TRL's loss, and its cast (auto: neither the recipe nor the variable).
    _, by_name = plan_json(
        capsys, "qwen3-30b-a3b", "--hardware", "gh200", "--gpus", "2", "--loss", "trl",
        "--cast", "auto",
    )  # fmt: skip
    assert by_recipe["gpu_need_bytes"] == by_name["gpu_need_bytes"]
    assert by_recipe["host_need_bytes"] == by_name["host_need_bytes"]
    assert "planned from the shipped config 'qwen3-30b-a3b'" in " ".join(by_recipe["notes"])
    recipe = tmp_path / "short.yaml"
    recipe.write_text(
        "random_init_from_config: llama-3.1-8b\nmax_length: 1024\nper_device_train_batch_size: 2\n"
    )
    _, short = plan_json(capsys, str(recipe), "--hardware", "h100")
    assert (short["run"]["seq"], short["run"]["batch"]) == (1024, 2)
    _, overridden = plan_json(capsys, str(recipe), "--hardware", "h100", "--seq", "2048")
    assert (overridden["run"]["seq"], overridden["run"]["batch"]) == (2048, 2)


def test_plan_counts_the_loss_it_is_told(capsys):
    """--loss: the full logits (the default), TRL's fused LM head or Liger's fused cross-entropy
    decide the GPU bytes of the loss (Qwen3-14B at seq 4096, batch 4: 27.8 GiB of logits and
    their fp32 copies, against about 5 and 2 GiB), and nothing else in the plan."""
    machine = ("--gpu-mem", "139.8", "--cpu-mem", "256", "--gpus", "2")
    _, default = plan_json(capsys, "qwen3-14b", *machine)
    tokens, hidden, vocab = 4 * 4096, 5120, 151936
    expected = {
        "full": LOGIT_BYTES * tokens * vocab,
        "trl": trl_loss_bytes(tokens, hidden, vocab, 2),
        "liger": liger_loss_bytes(tokens, hidden, vocab, 2),
    }
    assert default["gpu_bytes_per_rank"]["logits_and_loss"] == expected["full"]
    for loss, fused in (("full", None), ("trl", "trl"), ("liger", "liger")):
        code, plan = plan_json(capsys, "qwen3-14b", *machine, "--loss", loss)
        assert code == 0 and plan["run"]["fused_cross_entropy"] == fused
        gpu = plan["gpu_bytes_per_rank"]
        assert gpu["logits_and_loss"] == expected[loss], loss
        assert plan["host_bytes_per_rank"] == default["host_bytes_per_rank"]
        others = {k: v for k, v in gpu.items() if k != "logits_and_loss"}
        assert others == {
            k: v for k, v in default["gpu_bytes_per_rank"].items() if k != "logits_and_loss"
        }
    _, out, _ = cli(capsys, "plan", "qwen3-14b", *machine, "--loss", "trl")
    assert "loss: TRL's fused LM head" in out
    # The GPU room the logits leave goes to the optimizer state: on two H100, a lower ratio.
    h100 = ("qwen3-14b", "--hardware", "h100", "--cpu-mem", "256", "--gpus", "2", "--ratio", "auto")
    _, full = plan_json(capsys, *h100)
    _, trl = plan_json(capsys, *h100, "--loss", "trl")
    assert (full["run"]["ratio"], trl["run"]["ratio"]) == (0.9, 0.7)


def test_plan_refuses_liger_for_a_model_it_does_not_patch(capsys):
    code, _, err = cli(capsys, "plan", "seed-oss-36b", "--hardware", "h200", "--loss", "liger")
    assert code == 2 and "no fused cross-entropy for 'seed_oss'" in err and "--loss trl" in err
    code, _, err = cli(capsys, "plan", "qwen3-14b", "--hardware", "h200", "--loss", "fused")
    assert code == 2 and "invalid choice: 'fused'" in err


def test_a_recipe_naming_a_model_plan_cannot_find_exits_2(capsys, tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("model_name_or_path: someone/unknown-7b\n")
    code, _, err = cli(capsys, "plan", str(recipe), "--hardware", "h100")
    assert code == 2 and "pass the model's config.json as MODEL instead" in err


def test_an_argument_env_does_not_know_exits_2(capsys):
    code, _, err = cli(capsys, "env", "--max_steps", "3")
    assert code == 2 and "unrecognized arguments: --max_steps 3" in err


# ------------------------------------------------------------------------ demo, bench


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_demo_and_bench_help(capsys, command):
    code, out, _ = cli(capsys, command, "--help")
    assert code == 0 and f"usage: hf-superoffload {command}" in out
    assert ("--dpo" in out) if command == "demo" else ("--suite-help" in out)


def test_demo_runs_the_main_job_with_the_jobs_own_arguments(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out_dir = tmp_path / "demo"
    code, out, _ = cli(capsys, "demo", "--max_steps", "6", "--output_dir", str(out_dir))
    assert code == 0
    assert "sft: loss" in out and "over 6 steps" in out and "rollbacks:" in out
    summary = json.loads((out_dir / "sft_summary.json").read_text())
    assert summary["steps"] == 6 and summary["optimizer"] == "SuperOffloadOptimizer"
    assert (out_dir / "loss.png").is_file() and (out_dir / "README.md").is_file()


def test_demo_recipe_help_lists_trls_and_superoffload_arguments(capsys):
    code, out, _ = cli(capsys, "demo", "--dpo", "--recipe-help")
    assert code == 0
    for option in ("--beta", "--superoffload_gpu_tail", "--random_init_from_config"):
        assert option in out


def test_bench_runs_the_checkouts_suite(capfd):
    code = main(["bench", "--suite-help"])
    out = capfd.readouterr().out
    assert code == 0 and "--systems" in out and "suite.csv" in out


@pytest.mark.parametrize(
    ("command", "needs"),
    [
        (["bench", "--systems", "no_offload"], "benchmarks/suite.py"),
        (["finetune", "phi-4", "superoffload", "--dry-run"], "examples/recipes"),
    ],
)
def test_outside_a_checkout_says_to_run_from_one(capsys, tmp_path, monkeypatch, command, needs):
    from hf_superoffload.cli import checkout

    monkeypatch.setattr(
        checkout, "__file__", str(tmp_path / "site" / "hf_superoffload" / "cli" / "checkout.py")
    )
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(capsys, *command)
    assert code == 2 and "Run from a checkout" in err and needs in err


# ------------------------------------------------------------------------ entry points


def test_python_dash_m_help():
    result = subprocess.run(
        [sys.executable, "-m", "hf_superoffload", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    for command in ("env", "plan", "demo", "bench"):
        assert command in result.stdout


def test_console_script_points_at_main():
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    scripts = setup["options.entry_points"]["console_scripts"].strip().splitlines()
    name, target = (part.strip() for part in scripts[0].split("="))
    module, attribute = target.split(":")
    assert name == "hf-superoffload"
    assert getattr(importlib.import_module(module), attribute) is main


def test_plan_counts_compact_moments(capsys):
    """--moments compact: the host's moments take 2 B a param and a scale pair a block, the
    GPU tail 10 B a param; the output says so."""
    _, fp32 = plan_json(capsys, "llama-3.1-8b", "--hardware", "h100")
    _, compact = plan_json(capsys, "llama-3.1-8b", "--hardware", "h100", "--moments", "compact")
    assert compact["run"]["compact_moments"] is True and fp32["run"]["compact_moments"] is False
    host, host_fp32 = compact["host_bytes_per_rank"], fp32["host_bytes_per_rank"]
    assert host["master"] == host_fp32["master"]
    assert 2 * host["master"] / 4 < host["moments"] < 2.1 * host["master"] / 4
    assert host_fp32["moments"] == 2 * host_fp32["master"]
    main(["plan", "llama-3.1-8b", "--hardware", "h100", "--moments", "compact"])
    assert "10 bytes per param there" in capsys.readouterr().out


def test_plan_counts_every_saved_activation_without_checkpointing(capsys, tmp_path):
    """A run without activation checkpointing (--activation-checkpointing off, or a recipe's
    activation_checkpointing / gradient_checkpointing false) keeps every layer's saved tensors
    on the GPU: the plan counts activation_memory.decoder_saved_bytes (tested against what
    autograd saves), not the layer inputs of a checkpointed run; Llama-3.1-8B at seq 4096 x
    batch 4 then no longer fits an H100, and turning checkpointing on is the change named."""
    from hf_superoffload.zero3.activation_memory import DecoderWidths, decoder_saved_bytes

    config = model_source.resolve("llama-3.1-8b").config
    saved = decoder_saved_bytes(DecoderWidths.of(config), 4, 4096, 2)
    code, on = plan_json(capsys, "llama-3.1-8b", "--hardware", "h100")
    assert code == 0 and on["run"]["activation_checkpointing"] is True
    assert on["gpu_bytes_per_rank"]["layer_inputs"] == 32 * 4 * 4096 * 4096 * 2
    off_args = ("llama-3.1-8b", "--hardware", "h100", "--activation-checkpointing", "off")
    code, off = plan_json(capsys, *off_args)
    assert code == 1 and off["run"]["activation_checkpointing"] is False
    assert off["gpu_bytes_per_rank"]["layer_activations"] == saved
    assert "layer_inputs" not in off["gpu_bytes_per_rank"]
    assert "largest part: layer_activations" in off["reasons"][0]
    assert off["suggestions"][0].startswith("--activation-checkpointing on fits")
    _, out, _ = cli(capsys, "plan", *off_args)
    assert "no activation checkpointing: every layer's saved tensors on the GPU" in out
    for name in ("activation_checkpointing", "gradient_checkpointing"):
        recipe = tmp_path / f"{name}.yaml"
        recipe.write_text(
            f"random_init_from_config: llama-3.1-8b\n{name}: false\n"
            "max_length: 4096\nper_device_train_batch_size: 4\n"  # the model's plan's
        )
        full_logits = ("--hardware", "h100", "--loss", "full")  # a recipe's default: trl
        _, by_recipe = plan_json(capsys, str(recipe), *full_logits)
        assert by_recipe["gpu_bytes_per_rank"] == off["gpu_bytes_per_rank"], name
        _, overridden = plan_json(
            capsys, str(recipe), *full_logits, "--activation-checkpointing", "on"
        )
        assert overridden["gpu_bytes_per_rank"] == on["gpu_bytes_per_rank"], name
    recipe = tmp_path / "unclear.yaml"
    recipe.write_text("random_init_from_config: llama-3.1-8b\nactivation_checkpointing: maybe\n")
    code, _, err = cli(capsys, "plan", str(recipe), "--hardware", "h100")
    assert code == 2 and f"recipe {recipe}: examples/sft.py would refuse" in err, err
    assert "--activation-checkpointing: Truthy value expected: got maybe" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("phi-4",), "'phi3' layers save other tensors. Train with activation checkpointing on"),
        (("qwen3-30b-a3b",), "'qwen3_moe' layers save other tensors"),
        (
            ("llama-3.1-8b", "--activation-checkpoint-offload"),
            "the run does not checkpoint activations: plan --activation-checkpointing on",
        ),
    ],
)
def test_what_the_plan_cannot_count_without_checkpointing_exits_2(capsys, args, message):
    code, _, err = cli(
        capsys, "plan", *args, "--hardware", "h100", "--activation-checkpointing", "off"
    )
    assert code == 2 and message in err, err
