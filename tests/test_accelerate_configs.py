"""Every shipped accelerate config is accepted by accelerate and names the command that runs it."""

from __future__ import annotations

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


SINGLE_PROCESS = [p for p in CONFIGS if load_config_from_file(str(p)).num_processes == 1]


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


MULTI_PROCESS = [p for p in CONFIGS if load_config_from_file(str(p)).num_processes > 1]


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
