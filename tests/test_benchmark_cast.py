"""The benchmarks' --cast (benchmarks/systems.py run_environment): every SuperOffload system
runs with the cast asked for, the ZeRO-3 ones through HF_SUPEROFFLOAD_CAST (DeepSpeed builds
their optimizer, which resolves its cast from there, as does train_step.py's planned()); the
systems with no cast refuse one other than auto, and the suite passes it to the others only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import suite  # noqa: E402
import systems  # noqa: E402
import train_step  # noqa: E402

from hf_superoffload.cli import model_source  # noqa: E402
from hf_superoffload.zero3.memory_plan import Zero3Run, zero3_memory_plan  # noqa: E402
from hf_superoffload.zero3.options import resolve_options  # noqa: E402

ZERO3 = ("superoffload_zero3", "superoffload_zero3_compact")
NO_CAST = (
    "no_offload",
    "deepspeed_zero_offload",
    "deepspeed_zero3",
    "deepspeed_superoffload",
    "torchao_offload",
)


@pytest.fixture
def environ(monkeypatch):
    """os.environ as train_step.py leaves it before importing the engine: each test's."""
    for name in ("HF_SUPEROFFLOAD_CAST", "HF_SUPEROFFLOAD_MOMENTS", "HF_SUPEROFFLOAD_DEEPSPEED"):
        monkeypatch.delenv(name, raising=False)

    def apply(system: str, cast: str) -> dict[str, str]:
        environment = systems.run_environment(system, cast)
        for name, value in environment.items():
            monkeypatch.setenv(name, value)
        return environment

    return apply


@pytest.mark.parametrize("system", ZERO3)
@pytest.mark.parametrize("cast", ["auto", "gpu", "cpu"])
def test_a_zero3_system_resolves_the_cast_asked_for(environ, system, cast):
    environment = environ(system, cast)
    assert environment[systems.CAST_ENV] == cast
    assert environment[systems.OPT_OUT_ENV] == "1"  # still the system's own variables
    assert resolve_options(None, torch.device("cpu")).cast == cast  # as its optimizer does


def test_the_planned_copy_out_ring_follows_the_cast_asked_for(environ, monkeypatch):
    """superoffload_zero3 in bf16: a cast on the CPU makes the host copy-out ring, one on the
    GPU none, and the plan beside the measured row counts it so."""
    config = model_source.resolve("llama-3.1-8b").config
    args = SimpleNamespace(system="superoffload_zero3", seq=4096, batch=4, ratio=1.0)
    for cast in ("cpu", "gpu"):
        monkeypatch.delenv(systems.CAST_ENV, raising=False)  # one process a run
        environ(args.system, cast)
        run = Zero3Run(
            seq=4096, batch=4, ratio=1.0, decay_groups=False, persistence_threshold=100_000,
            cast=cast,
        )  # fmt: skip
        expected = zero3_memory_plan(config, run)
        assert (expected.host["param_copy_out"] > 0) == (cast == "cpu")
        assert train_step.planned(args, config, 1) == {
            "gpu_gib": round(expected.gpu_bytes / 2**30, 2),
            "host_gib": round(expected.host_bytes_without_resume / 2**30, 2),
        }


def test_the_standalone_system_takes_the_cast_as_its_argument(environ):
    assert systems.CAST_ENV not in environ("superoffload", "cpu")  # SuperOffload(cast=args.cast)


@pytest.mark.parametrize("system", NO_CAST)
def test_a_system_without_a_cast_refuses_one_and_runs_as_it_is_without(environ, system):
    with pytest.raises(ValueError, match=rf"--cast gpu: {system} has no cast to set") as err:
        environ(system, "gpu")
    assert "superoffload_zero3" in str(err.value)  # where a cast acts
    assert systems.CAST_ENV not in environ(system, "auto")


def test_train_step_refuses_a_cast_for_a_system_without_one_before_starting():
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "train_step.py"), "--system", "no_offload", "--cast",
         "cpu"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 1
    assert run.stderr.strip().endswith("run no_offload without --cast, or choose one of "
                                       "['superoffload', 'superoffload_zero3', "
                                       "'superoffload_zero3_compact']"), run.stderr  # fmt: skip


def test_a_cast_variable_other_than_the_flag_is_refused(environ, monkeypatch):
    monkeypatch.setenv(systems.CAST_ENV, "cpu")
    with pytest.raises(ValueError, match="HF_SUPEROFFLOAD_CAST=cpu is set and --cast is gpu"):
        environ("superoffload_zero3", "gpu")
    assert environ("superoffload_zero3", "cpu")[systems.CAST_ENV] == "cpu"


def test_the_suite_passes_the_cast_to_every_system_with_one_and_to_no_other(tmp_path, monkeypatch):
    commands = {}

    def run_logged(cmd, env, timeout, log):
        commands[cmd[cmd.index("--system") + 1]] = cmd
        return 1, "", ""

    monkeypatch.setattr(suite, "run_logged", run_logged)
    args = SimpleNamespace(
        nproc=1, model_config=None, clip_rate=None, superoffload_warmup=20, warmup=3,
        cast="gpu", gpu_memory_cap=None, timeout=60,
        **{flag: 1 for flag in suite.MODEL_FLAGS},
    )  # fmt: skip
    for system in suite.ALL:
        suite.run_system(system, system, "auto", args, tmp_path)
    for system, cmd in commands.items():
        given = cmd[cmd.index("--cast") + 1] if "--cast" in cmd else None
        assert given == ("gpu" if system in ("superoffload", *ZERO3) else None), (system, cmd)
    assert set(commands) == set(suite.ALL)
