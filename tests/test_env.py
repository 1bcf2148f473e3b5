"""The package's environment variables: one prefix (``HF_SUPEROFFLOAD_``), every one declared in
hf_superoffload/env.py, and a misspelled one or one of the former prefix (``SUPEROFFLOAD_``)
refused by name with the closest declared one, when the package first reads the environment."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_superoffload import SuperOffloadOptimizer, env
from hf_superoffload.cli import main as cli_main
from hf_superoffload.integrations.plugin import ENV_PREFIX, SuperOffloadOptions

REPO = Path(__file__).resolve().parents[1]
OPTIONS = {ENV_PREFIX + f.name.upper() for f in dataclasses.fields(SuperOffloadOptions)}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """No option variable of the calling shell leaks into these tests (the build cache's may
    stay: it changes where the CPU Adam is found, not what it computes)."""
    for name in list(os.environ):
        if name in OPTIONS or name.startswith(env.FORMER_PREFIX):
            monkeypatch.delenv(name)


def test_a_misspelled_variable_is_refused_naming_the_closest_declared_one(monkeypatch):
    monkeypatch.setenv("HF_SUPEROFFLOAD_GPU_TAL", "2")
    message = "HF_SUPEROFFLOAD_GPU_TAL: did you mean HF_SUPEROFFLOAD_GPU_TAIL?"
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        SuperOffloadOptions()
    assert "HF_SUPEROFFLOAD_CPU_THREADS" in str(error.value)  # the declared ones are listed
    # The optimizer too: it reads the host memory override before allocating.
    with pytest.raises(ValueError, match=re.escape(message)):
        SuperOffloadOptimizer(torch.nn.Linear(4, 4).parameters(), gpu_tail=0)


def test_the_former_prefix_is_refused_saying_the_new_name(monkeypatch):
    monkeypatch.setenv("SUPEROFFLOAD_CPU_THREADS", "3")
    with pytest.raises(
        ValueError,
        match=re.escape("SUPEROFFLOAD_CPU_THREADS: hf_superoffload's variables are named "
                        "HF_SUPEROFFLOAD_*; it is now HF_SUPEROFFLOAD_CPU_THREADS"),
    ):  # fmt: skip
        SuperOffloadOptions()
    monkeypatch.delenv("SUPEROFFLOAD_CPU_THREADS")
    monkeypatch.setenv("SUPEROFFLOAD_GPU_TAL", "2")  # the old prefix and a typo
    with pytest.raises(ValueError, match="did you mean HF_SUPEROFFLOAD_GPU_TAIL"):
        SuperOffloadOptions()


def test_variables_of_other_names_are_not_ours(monkeypatch):
    monkeypatch.setenv("MY_SUPEROFFLOAD_THING", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    SuperOffloadOptions()


def test_every_declared_variable_is_accepted_and_read(monkeypatch):
    values = {
        "HF_SUPEROFFLOAD_GPU_TAIL": "1",
        "HF_SUPEROFFLOAD_BUCKET_SIZE": "64",
        "HF_SUPEROFFLOAD_CPU_THREADS": "1",
        "HF_SUPEROFFLOAD_SPECULATE": "1",
        "HF_SUPEROFFLOAD_SPECULATE_AFTER_CLIP": "0",
        "HF_SUPEROFFLOAD_CAST": "cpu",
        "HF_SUPEROFFLOAD_MOMENTS": "compact",
        "HF_SUPEROFFLOAD_GPU_TAIL_CAP": "8",
        "HF_SUPEROFFLOAD_SAVE_DTYPE": "float32",
        "HF_SUPEROFFLOAD_PEAK_TFLOPS": "1.0",
        "HF_SUPEROFFLOAD_HOST_MEMORY_GIB": "240",
        "HF_SUPEROFFLOAD_VERBOSE_BUILD": "0",
        "HF_SUPEROFFLOAD_DEEPSPEED": "1",
    }
    assert OPTIONS <= set(values) <= set(env.VARIABLES)
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    options = SuperOffloadOptions()
    assert (options.gpu_tail, options.bucket_size, options.cast) == (1, 64, "cpu")
    assert options.gpu_tail_cap == 8.0 and options.cpu_threads == 1
    assert options.moments == "compact"
    assert env.read("HF_SUPEROFFLOAD_HOST_MEMORY_GIB") == "240"
    with pytest.raises(KeyError, match="not declared"):
        env.read("HF_SUPEROFFLOAD_NOT_A_THING")


def _names_in(folders: list[str], pattern: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for folder in folders:
        for path in (REPO / folder).rglob("*"):
            if path.suffix in (".py", ".sh", ".yaml", ".json", ".md") and path.is_file():
                for name in re.findall(pattern, path.read_text()):
                    found.setdefault(name, set()).add(str(path.relative_to(REPO)))
    return found


CODE = ["hf_superoffload", "examples", "benchmarks", "scripts", "dev", "accelerate_configs"]


def test_every_variable_the_code_names_is_declared_and_every_declared_one_is_read():
    named = _names_in(CODE, r"HF_SUPEROFFLOAD_[A-Z_]*[A-Z]")
    undeclared = {n: where for n, where in named.items() if n not in env.VARIABLES}
    assert not undeclared, undeclared
    # Read: named by the module that reads it (env.py, which declares them all, aside); the
    # options' are read as ENV_PREFIX + the field's name.
    named_by_readers = {
        name
        for name, where in _names_in(["hf_superoffload"], r"HF_SUPEROFFLOAD_[A-Z_]*[A-Z]").items()
        if where - {"hf_superoffload/env.py"}
    }
    assert set(env.VARIABLES) - OPTIONS <= named_by_readers, set(env.VARIABLES) - OPTIONS


def test_no_code_names_the_former_prefix():
    former = _names_in(CODE, r"(?<![A-Z_])SUPEROFFLOAD_[A-Z][A-Z_]*")
    assert not former, former


IMPORT_WITH_A_TYPO = """
import hf_superoffload  # the DeepSpeed switch is read, the rest is not checked yet
try:
    hf_superoffload.integrations.plugin.SuperOffloadOptions()
except ValueError as error:
    print("REFUSED", error)
"""


def test_importing_reads_nothing_and_the_first_read_refuses():
    variables = {**os.environ, "HF_SUPEROFFLOAD_CPU_THREDS": "2", "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_WITH_A_TYPO],
        env=variables, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "REFUSED unknown environment variable HF_SUPEROFFLOAD_CPU_THREDS: did you mean " \
           "HF_SUPEROFFLOAD_CPU_THREADS?" in result.stdout  # fmt: skip


def test_the_command_line_refuses_a_misspelled_variable(monkeypatch, capsys):
    monkeypatch.setenv("HF_SUPEROFFLOAD_CAST_", "cpu")
    code = cli_main(["plan", "llama-3.1-8b", "--hardware", "h100"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "HF_SUPEROFFLOAD_CAST_: did you mean HF_SUPEROFFLOAD_CAST?" in err
