"""``hf-superoffload plan --cast``: the run's cast decides whether the ZeRO-3 optimizer makes
its host copy-out ring (zero3/host_parts.copy_out_ring_dtype). Given (or read from
HF_SUPEROFFLOAD_CAST as the engine reads it), the plan counts the ring exactly; not given, it
counts the ring at its most and says so, in the text and in the JSON."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from hf_superoffload.cli import main, model_source
from hf_superoffload.engine.copy_out import COPY_OUT_PIECE, COPY_OUT_SLOTS
from hf_superoffload.zero3.memory_plan import Zero3Run, zero3_memory_plan

MODEL = ("llama-3.1-8b", "--hardware", "h100")
RING_AT_MOST = COPY_OUT_SLOTS * COPY_OUT_PIECE * 2  # bf16


def plan(capsys, *args: str) -> tuple[dict, str]:
    """(the JSON, the text) of one plan."""
    assert main(["plan", *MODEL, *args, "--json"]) in (0, 1)
    found = json.loads(capsys.readouterr().out)
    assert main(["plan", *MODEL, *args]) in (0, 1)
    return found, capsys.readouterr().out


def _same_as_the_memory_plan(found: dict) -> None:
    """The figures are zero3_memory_plan's for the run the output names."""
    config = model_source.resolve(MODEL[0]).config
    expected = zero3_memory_plan(config, Zero3Run(**found["run"]))
    assert found["host_bytes_per_rank"] == expected.host
    assert found["gpu_bytes_per_rank"] == expected.gpu
    assert found["host_total_bytes_per_rank"] == expected.host_bytes
    assert found["gpu_total_bytes"] == expected.gpu_bytes


@pytest.mark.parametrize("cast", ["gpu", "auto"])
def test_a_cast_on_the_gpu_counts_no_ring_and_no_bound(capsys, monkeypatch, cast):
    monkeypatch.delenv("HF_SUPEROFFLOAD_CAST", raising=False)
    found, text = plan(capsys, "--cast", cast)
    assert found["run"]["cast"] == cast and found["run"]["device_type"] == "cuda"
    assert found["host_bytes_per_rank"]["param_copy_out"] == 0
    assert found["upper_bounds"] == []
    assert "at most" not in text and f"cast {cast}" in text
    _same_as_the_memory_plan(found)


def test_a_cast_on_the_host_counts_the_ring_exactly(capsys, monkeypatch):
    monkeypatch.delenv("HF_SUPEROFFLOAD_CAST", raising=False)
    found, text = plan(capsys, "--cast", "cpu")
    assert found["host_bytes_per_rank"]["param_copy_out"] == RING_AT_MOST
    assert found["upper_bounds"] == [] and "at most" not in text
    _same_as_the_memory_plan(found)


def test_without_a_cast_the_ring_is_an_upper_bound_the_json_names(capsys, monkeypatch):
    monkeypatch.delenv("HF_SUPEROFFLOAD_CAST", raising=False)
    found, text = plan(capsys)
    assert found["run"]["cast"] is None
    assert found["host_bytes_per_rank"]["param_copy_out"] == RING_AT_MOST
    (bound,) = found["upper_bounds"]
    assert bound["part"] == "param_copy_out" and bound["counted_in"] == "host_bytes_per_rank"
    assert bound["bytes"] == RING_AT_MOST and "none with cast 'auto' or 'gpu'" in bound["why"]
    assert any("Give --cast the run's cast" in note for note in found["notes"])
    assert "param_copy_out             0.09 GiB (at most: " in text and "cast not given" in text
    _same_as_the_memory_plan(found)
    # The bound is what --cast gpu leaves out, and nothing else changes.
    exact, _ = plan(capsys, "--cast", "gpu")
    assert found["host_training_bytes_per_rank"] - exact["host_training_bytes_per_rank"] == (
        RING_AT_MOST
    )
    assert found["gpu_bytes_per_rank"] == exact["gpu_bytes_per_rank"]


@pytest.mark.parametrize(("value", "ring"), [("gpu", 0), ("cpu", RING_AT_MOST)])
def test_the_default_is_the_environments_cast(capsys, monkeypatch, value, ring):
    """HF_SUPEROFFLOAD_CAST set: the run's cast, as the engine reads it."""
    monkeypatch.setenv("HF_SUPEROFFLOAD_CAST", value)
    found, _ = plan(capsys)
    assert found["run"]["cast"] == value and found["upper_bounds"] == []
    assert found["host_bytes_per_rank"]["param_copy_out"] == ring
    # --cast wins over the environment.
    other = "cpu" if value == "gpu" else "gpu"
    assert plan(capsys, "--cast", other)[0]["run"]["cast"] == other


def test_a_bad_cast_in_the_environment_exits_2_as_the_engine_refuses_it(capsys, monkeypatch):
    monkeypatch.setenv("HF_SUPEROFFLOAD_CAST", "host")
    assert main(["plan", *MODEL]) == 2
    assert "cast must be one of" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *MODEL, "--cast", "host"])
    assert exit_info.value.code == 2


@pytest.mark.parametrize(("value", "cast"), [(None, "auto"), ("gpu", "gpu"), ("cpu", "cpu")])
def test_the_benchmarks_plan_takes_the_runs_cast(monkeypatch, value, cast):
    """benchmarks/train_step.py's planned(): the ZeRO-3 run's cast, as its optimizer resolved
    it (HF_SUPEROFFLOAD_CAST, else auto), so a run's host memory is compared with the ring it
    made, not the ring at its most."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import train_step

    if value is None:
        monkeypatch.delenv("HF_SUPEROFFLOAD_CAST", raising=False)
    else:
        monkeypatch.setenv("HF_SUPEROFFLOAD_CAST", value)
    config = model_source.resolve(MODEL[0]).config
    args = SimpleNamespace(system="superoffload_zero3", seq=4096, batch=4, ratio=1.0)
    found = train_step.planned(args, config, 1)
    run = Zero3Run(
        seq=4096, batch=4, ratio=1.0, decay_groups=False, persistence_threshold=100_000, cast=cast
    )
    expected = zero3_memory_plan(config, run)
    assert found == {
        "gpu_gib": round(expected.gpu_bytes / 2**30, 2),
        "host_gib": round(expected.host_bytes_without_resume / 2**30, 2),
    }
    assert (expected.host["param_copy_out"] == 0) == (cast != "cpu")


def test_with_compact_moments_the_ring_is_made_under_every_cast_and_is_no_bound(
    capsys, monkeypatch
):
    monkeypatch.delenv("HF_SUPEROFFLOAD_CAST", raising=False)
    found, text = plan(capsys, "--moments", "compact")
    assert found["run"]["cast"] is None and found["run"]["compact_moments"]
    assert found["host_bytes_per_rank"]["param_copy_out"] == RING_AT_MOST
    assert found["upper_bounds"] == [] and "at most" not in text
    _same_as_the_memory_plan(found)
