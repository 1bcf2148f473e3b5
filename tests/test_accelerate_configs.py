"""Every shipped accelerate config is accepted by accelerate and names the command that runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "accelerate_configs").glob("*.yaml"))


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
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode in (0, 1), result.stderr[-3000:]  # 1: loss did not fall in 4 steps
    assert (tmp_path / "out" / "config.json").exists(), (
        result.stdout[-2000:] + result.stderr[-2000:]
    )


MULTI_PROCESS = [p for p in PLAIN if load_config_from_file(str(p)).num_processes > 1]


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
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]  # the loss falls within 6 steps
    assert (tmp_path / "out" / "config.json").exists(), result.stderr[-3000:]
    assert "optimizer superoffload" in result.stdout


DEEPSPEED = [p for p in CONFIGS if _is_deepspeed(p)]
# Launched on a CPU process: the single-process ones (accelerate on DeepSpeed's CPU accelerator
# sizes its own gathers for one process, so several CPU processes fail in TRL's metrics gather
# before our code runs; two ranks of the engine itself are tested in test_zero3.py). The
# multi-process configs differ from these only in num_processes and their header.
LAUNCHED_DEEPSPEED = ["x86_zero3_superoffload.yaml", "gh200_zero3_superoffload.yaml"]


def test_deepspeed_configs_name_an_existing_super_offload_config():
    assert DEEPSPEED, "no DeepSpeed ZeRO-3 config shipped"
    for path in DEEPSPEED:
        config = load_config_from_file(str(path))
        ds_file = REPO / config.deepspeed_config["deepspeed_config_file"]
        ds = json.loads(ds_file.read_text())
        assert ds["zero_optimization"]["stage"] == 3
        assert ds["zero_optimization"]["offload_optimizer"]["super_offload"] is True


@pytest.mark.parametrize("name", LAUNCHED_DEEPSPEED)
def test_deepspeed_config_launches_the_example_through_our_zero3_optimizer(tmp_path, name):
    # DeepSpeed's CPU accelerator and gloo stand in for the GPUs and NCCL.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu"}
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", f"accelerate_configs/{name}",
        "examples/sft.py", "--max-steps", "6", "--output-dir", str(tmp_path / "out"),
    ]  # fmt: skip
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "SuperOffload on ZeRO-3 runs in place of DeepSpeed's" in output, output[-3000:]
    assert "superoffload: " in result.stdout and "steps speculated" in result.stdout
