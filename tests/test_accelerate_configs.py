"""Every shipped accelerate config is accepted by accelerate, names the command that runs it,
and says what the script needs. A config named ``*_superoffload.yaml`` trains through
SuperOffload with a plain TRL ``SFTTrainer`` script (plus ``import hf_superoffload``): it points
at a DeepSpeed ZeRO-3 JSON with ``"super_offload": true``. The others name no optimizer and say
so, since a plain script launched with them trains with AdamW."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from accelerate.commands.config.config_args import load_config_from_file
from launched import ONE_PROCESS, QUICK, SEVERAL_PROCESSES, run_launched

from hf_superoffload import env
from hf_superoffload.integrations.arguments import SuperOffloadArgumentsMixin

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "accelerate_configs").glob("*.yaml"))
# Options the ZeRO-3 path takes from the DeepSpeed JSON instead (refused as arguments there).
NOT_ON_ZERO3 = {
    "superoffload_gpu_tail",
    "superoffload_bucket_size",
    "superoffload_gpu_tail_cap",
}


def test_configs_are_shipped():
    assert CONFIGS, "accelerate_configs/ holds no config"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads_and_starts_with_its_command(path):
    config = load_config_from_file(str(path))
    assert config.num_processes >= 1
    first = path.read_text().splitlines()[0]
    assert first.startswith(
        "# Run: accelerate launch --config_file accelerate_configs/" + path.name
    )


def _is_deepspeed(path: Path) -> bool:
    return str(load_config_from_file(str(path)).distributed_type) in (
        "DEEPSPEED",
        "DistributedType.DEEPSPEED",
    )


def _header(path: Path) -> str:
    return "\n".join(line for line in path.read_text().splitlines() if line.startswith("#"))


def _deepspeed_json(path: Path) -> dict:
    config = load_config_from_file(str(path))
    return json.loads((REPO / config.deepspeed_config["deepspeed_config_file"]).read_text())


SUPEROFFLOAD_NAMED = [p for p in CONFIGS if p.name.endswith("_superoffload.yaml")]


@pytest.mark.parametrize("path", SUPEROFFLOAD_NAMED, ids=lambda p: p.name)
def test_a_config_named_superoffload_carries_the_setting(path):
    """accelerate passes no optimizer setting of its own: only a DeepSpeed JSON can carry it,
    so a *_superoffload.yaml launched under a plain SFTTrainer script must not give AdamW."""
    assert _is_deepspeed(path), f"{path.name} is not a DeepSpeed config"
    zero = _deepspeed_json(path)["zero_optimization"]
    assert zero["stage"] == 3
    assert zero["offload_optimizer"]["device"] == "cpu"
    assert zero["offload_optimizer"]["super_offload"] == "hf_superoffload"  # ours, or refused
    assert "import hf_superoffload" in _header(path)  # the one line a plain script needs


@pytest.mark.parametrize("path", [p for p in CONFIGS if not _is_deepspeed(p)], ids=lambda p: p.name)
def test_a_config_without_the_setting_says_what_the_script_must_do(path):
    assert not path.name.endswith("_superoffload.yaml")
    header = _header(path)
    assert "SuperOffloadOptimizer" in header and "SuperOffloadSFTTrainer" in header, header
    assert "AdamW" in header, header  # what a plain script gets instead


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_header_names_only_options_that_exist(path):
    header = _header(path)
    arguments = set(re.findall(r"--(superoffload_\w+)", header))
    fields = {f.name for f in dataclasses.fields(SuperOffloadArgumentsMixin)}
    assert arguments <= fields, arguments - fields
    if _is_deepspeed(path):
        assert not arguments & NOT_ON_ZERO3, arguments & NOT_ON_ZERO3
    env_names = set(re.findall(r"[A-Z_]*SUPEROFFLOAD_[A-Z_]*[A-Z]", header))
    assert env_names <= set(env.VARIABLES), env_names - set(env.VARIABLES)


def test_one_name_per_config():
    """No config is shipped twice under two names, and the names follow one scheme:
    ``<machine>[x<GPUs>]_superoffload[_sp<N>].yaml`` for DeepSpeed ZeRO-3 with SuperOffload (any
    script), ``..._superoffload_trainers.yaml`` for the standalone engine's trainers."""
    seen = {}
    for path in CONFIGS:
        machine = re.sub(r"x\d$", "", path.name.split("_")[0])  # gh200 and x86 share settings
        settings = machine + json.dumps(load_config_from_file(str(path)).to_dict(), sort_keys=True)
        assert settings not in seen, f"{path.name} repeats {seen.get(settings)}"
        seen[settings] = path.name
        if path.name != "single_gpu.yaml":
            assert re.fullmatch(
                r"(gh200|x86)(x[248])?_superoffload(_trainers|_sp[248])?\.yaml", path.name
            )


PLAIN = [p for p in CONFIGS if not _is_deepspeed(p)]
SINGLE_PROCESS = [p for p in PLAIN if load_config_from_file(str(p)).num_processes == 1]


@pytest.mark.parametrize("path", SINGLE_PROCESS, ids=lambda p: p.name)
def test_single_process_config_launches_the_example(tmp_path, path):
    # With no GPU visible accelerate runs the one process on the CPU (CPU affinity is a no-op).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(path),
        str(REPO / "examples" / "sft.py"),
        "--max-steps", "10", "--output-dir", str(tmp_path / "out"),
    ]  # fmt: skip
    result = run_launched(cmd, timeout=ONE_PROCESS, env=env)
    assert result.returncode in (0, 1), result.stderr[-3000:]  # 1: loss did not fall in 4 steps
    assert (tmp_path / "out" / "config.json").exists(), (
        result.stdout[-2000:] + result.stderr[-2000:]
    )


MULTI_PROCESS = [p for p in PLAIN if load_config_from_file(str(p)).num_processes > 1]


@pytest.mark.slow
@pytest.mark.parametrize("path", MULTI_PROCESS, ids=lambda p: p.name)
def test_data_parallel_config_launches_the_example_on_cpu_processes(tmp_path, path):
    # --cpu turns MULTI_GPU into MULTI_CPU (gloo), the same code path as the GPUs' NCCL one.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(path), "--cpu",
        str(REPO / "examples" / "sft.py"),
        "--max-steps", "6", "--output-dir", str(tmp_path / "out"),
    ]  # fmt: skip
    result = run_launched(cmd, timeout=SEVERAL_PROCESSES, env=env)
    assert result.returncode == 0, result.stderr[-3000:]  # the loss falls within 6 steps
    assert (tmp_path / "out" / "config.json").exists(), result.stderr[-3000:]
    # The example's summary has a speculation line only when SuperOffload trained.
    assert "steps speculated" in result.stdout, result.stdout[-2000:]


DEEPSPEED = [p for p in CONFIGS if _is_deepspeed(p)]
# Launched on CPU processes: the one-GPU configs and a two-GPU one (the others differ from these
# only in num_processes and their header). On CPU several processes need the script's
# --use_cpu true: without it accelerate finds no device backend and counts every rank as
# process 0 of 1 (tests/test_zero3_trainer_two_ranks.py pins that down).
LAUNCHED_DEEPSPEED = [
    "x86_superoffload.yaml",
    "gh200_superoffload.yaml",
    "x86x2_superoffload.yaml",
]


def test_deepspeed_configs_name_an_existing_super_offload_config():
    assert DEEPSPEED, "no DeepSpeed ZeRO-3 config shipped"
    for path in DEEPSPEED:
        ds = _deepspeed_json(path)
        assert ds["zero_optimization"]["stage"] == 3, path.name
        offload = ds["zero_optimization"]["offload_optimizer"]
        assert offload["super_offload"] == "hf_superoffload", path.name


@pytest.mark.slow
@pytest.mark.parametrize("name", LAUNCHED_DEEPSPEED)
def test_deepspeed_config_launches_the_example_through_our_zero3_optimizer(tmp_path, name):
    # DeepSpeed's CPU accelerator and gloo stand in for the GPUs and NCCL.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu"}
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", f"accelerate_configs/{name}",
        "examples/sft.py", "--max-steps", "6", "--output-dir", str(tmp_path / "out"),
    ]  # fmt: skip
    processes = load_config_from_file(str(REPO / "accelerate_configs" / name)).num_processes
    if processes > 1:
        cmd += ["--use_cpu", "true"]
    timeout = SEVERAL_PROCESSES if processes > 1 else ONE_PROCESS
    result = run_launched(cmd, timeout=timeout, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "SuperOffload on ZeRO-3 runs in place of DeepSpeed's" in output, output[-3000:]
    # How long the optimizer took to build, and DeepSpeed's share.
    built = re.search(
        r"built in ([0-9.]+) s, ([0-9.]+) of them in DeepSpeed's partitioning", output
    )
    assert built and 0 < float(built[2]) <= float(built[1]), output[-3000:]
    summary = json.loads((tmp_path / "out" / "sft_summary.json").read_text())
    assert summary["optimizer"] == "SuperOffloadZero3Optimizer"
    # The optimizer that ran and the bytes its state held on this rank (not 0, as counted from
    # the partitioned model before).
    state = summary["optimizer_state"]
    assert state["optimizer"] == "SuperOffloadZero3Optimizer" and state["host_bytes"] > 0
    assert "optimizer state: SuperOffloadZero3Optimizer" in result.stdout, result.stdout[-2000:]
    card = (tmp_path / "out" / "README.md").read_text()
    row = re.search(
        r"\| optimizer \| `SuperOffloadZero3Optimizer \(DeepSpeed.*host ([\d.]+) MiB", card
    )
    assert row and float(row.group(1)) > 0, card[-3000:]
    # One job of `processes` ranks, not processes that each train the whole job alone.
    assert summary["processes"] == processes
    assert "steps speculated" in result.stdout, result.stdout[-2000:]


def _plain_sft_trainer_on_the_shipped_json(rank, port, out_dir, ds_file) -> None:
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before anything imports DeepSpeed
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(1)
    from test_zero3_trainer import _sft  # a plain TRL SFTTrainer with a DeepSpeed config

    import hf_superoffload  # noqa: F401  (the README's one line)

    result = _sft(f"{out_dir}/run", "trl", json.loads(Path(ds_file).read_text()))
    torch.save(result, f"{out_dir}/result.pt")


def test_plain_sft_trainer_with_the_one_gpu_config_json_builds_our_optimizer(tmp_path):
    """The JSON gh200_superoffload.yaml names, given to a plain TRL SFTTrainer (DeepSpeed's CPU
    accelerator): DeepSpeed builds hf_superoffload's ZeRO-3 optimizer, which trains. The loss
    against DeepSpeed's plain CPU offload is compared in test_zero3_trainer.py."""
    from ranks import spawn_ranks
    from zero3_reference import free_port

    config = load_config_from_file(str(REPO / "accelerate_configs/gh200_superoffload.yaml"))
    assert config.num_processes == 1
    ds_file = REPO / config.deepspeed_config["deepspeed_config_file"]
    spawn_ranks(
        _plain_sft_trainer_on_the_shipped_json, (free_port(), str(tmp_path), str(ds_file)), 1
    )
    result = torch.load(tmp_path / "result.pt", weights_only=False)
    assert result["optimizer"] == "SuperOffloadZero3Optimizer"
    assert result["losses"][-1] < result["losses"][0], result["losses"]


# A plain Trainer script, as a user writes one: it imports hf_superoffload only when asked to.
PLAIN_TRAINER_SCRIPT = """
import json, sys
import torch
if "--import" in sys.argv:
    import hf_superoffload  # noqa: F401
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

args = TrainingArguments(
    output_dir=sys.argv[1], max_steps=3, per_device_train_batch_size=2, learning_rate=1e-3,
    logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, use_cpu=True,
)
torch.manual_seed(0)
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
model = LlamaForCausalLM(config)
ids = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(0))
trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in ids])
trainer.train()
logs = [log for log in trainer.state.log_history if "loss" in log]
print("RESULT " + json.dumps({"optimizer": type(trainer.deepspeed.optimizer).__name__,
                              "keys": sorted(logs[-1])}))
"""


def _launch_plain_trainer(tmp_path, *script_args: str):
    script = tmp_path / "train.py"
    script.write_text(PLAIN_TRAINER_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu"}
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", "accelerate_configs/x86_superoffload.yaml",
        str(script), str(tmp_path / "out"), *script_args,
    ]  # fmt: skip
    return run_launched(cmd, timeout=ONE_PROCESS, env=env, cwd=REPO)


# Without hf_superoffload imported: DeepSpeed reads the shipped JSON as it would at start-up.
READ_WITHOUT_THE_PACKAGE = """
import json, sys
from deepspeed.runtime.zero.config import get_zero_config
get_zero_config(json.load(open(sys.argv[1])))
assert "hf_superoffload" not in sys.modules
"""


def test_deepspeed_alone_rejects_the_shipped_json_naming_the_package():
    ds_file = REPO / "accelerate_configs" / "deepspeed" / "zero3_superoffload.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    cmd = [sys.executable, "-c", READ_WITHOUT_THE_PACKAGE, str(ds_file)]
    result = run_launched(cmd, timeout=QUICK, env=env)
    assert result.returncode != 0
    assert "offload_optimizer.super_offload" in result.stderr, result.stderr[-3000:]
    assert "input_value='hf_superoffload'" in result.stderr, result.stderr[-3000:]


@pytest.mark.slow  # two launches of a plain Trainer script (about 35 s each on 2 busy cores)
def test_a_plain_script_without_the_import_stops_at_start_naming_the_package(tmp_path):
    """A shipped *_superoffload config under a script that never imports hf_superoffload: not
    DeepSpeed's own SuperOffload (an assertion about CUDA on CPU, its slower engine on a GPU)
    but a stop when DeepSpeed reads the config, naming the value only this package reads."""
    result = _launch_plain_trainer(tmp_path)
    assert result.returncode != 0
    assert "offload_optimizer.super_offload" in result.stderr, result.stderr[-3000:]
    assert "input_value='hf_superoffload'" in result.stderr, result.stderr[-3000:]
    assert "RESULT" not in result.stdout


@pytest.mark.slow  # test_zero3_trainer.py checks the same logs in-process, for TRL's trainer
def test_a_plain_trainer_with_the_import_runs_ours_and_logs_its_metrics(tmp_path):
    """The same script with `import hf_superoffload`: the plain Trainer trains through our
    ZeRO-3 optimizer, says so, and logs tokens/s and the stv/ counters as ours does."""
    result = _launch_plain_trainer(tmp_path, "--import")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "SuperOffload on ZeRO-3 runs in place of DeepSpeed's" in result.stdout + result.stderr
    line = next(x for x in result.stdout.splitlines() if x.startswith("RESULT "))
    found = json.loads(line.removeprefix("RESULT "))
    assert found["optimizer"] == "SuperOffloadZero3Optimizer"
    assert "tokens_per_second" in found["keys"], found["keys"]
    assert {"stv/rollbacks_clip", "stv/speculative_steps"} <= set(found["keys"]), found["keys"]
