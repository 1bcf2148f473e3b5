"""Resuming the ZeRO-3 path fits the host that trained: the rank's optimizer file (12 bytes per
param) is not read beside the live state, and the resume's extra host memory is what
``checkpoint_memory.resume_extra_host_bytes`` says, for a file mapped from disk (torch's zip
format, DeepSpeed's default) and for one in torch's legacy format (read whole).

Measured on one rank as the process's resident memory (anonymous and file-backed pages alike)
above what it held when ``load_checkpoint`` began: sampled every millisecond, and read at the
entry and exit of the optimizer's ``load_state_dict``, where a file read whole is all resident.
The model has 10.6M params, so a second copy of the state (127 MB) stands far above the noise.
"""

from __future__ import annotations

import ctypes
import os
import threading

import pytest
import torch
from ranks import spawn_ranks
from zero3_reference import (
    Zero3Case,
    build_model,
    free_port,
    init_rank,
    make_engine,
    optimizer_state,
    train,
)

SLACK = 16 * 2**20  # the process's own churn (Python objects, the model states file, libraries)


def _model(seed: int):
    return build_model(
        seed, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=8,
    )  # fmt: skip


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Peak:
    """The highest resident memory seen while it runs, sampled and at ``mark()``."""

    def __init__(self):
        self.peak, self._stop = _resident(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self):
        while not self._stop.wait(0.001):
            self.mark()

    def mark(self):
        self.peak = max(self.peak, _resident())

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.mark()


def _marking_load_state_dict(optimizer, peak_ref: list) -> None:
    """Mark the peak at entry and exit of this optimizer's load_state_dict."""
    load = optimizer.load_state_dict

    def marked(*args, **kwargs):
        peak_ref[0].mark()
        load(*args, **kwargs)
        peak_ref[0].mark()

    optimizer.load_state_dict = marked


def _resume_on_rank(rank, world, port, case, out_dir) -> None:
    init_rank(rank, world, port)
    torch.set_num_threads(1)
    import hf_superoffload  # noqa: F401

    checkpoint = os.path.join(out_dir, "checkpoint")
    engine, optimizer = make_engine(case, True, world, model_builder=_model)
    train(engine, case, rank, range(2))
    engine.save_checkpoint(checkpoint, tag="zip")
    engine.checkpoint_engine.zipfile_serialization = False  # the same state in the legacy format
    engine.save_checkpoint(checkpoint, tag="legacy")
    saved = optimizer_state(engine)
    flats = [m.numel() for m in optimizer.fp32_partitioned_groups_flat]
    engine.destroy()

    results = {"saved": saved, "partition_numel": sum(flats), "largest": max(flats)}
    for tag in ("zip", "legacy"):
        engine, optimizer = make_engine(case, True, world, model_seed=1, model_builder=_model)
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # what the first engine freed goes back first
        peak_ref = [None]
        _marking_load_state_dict(optimizer, peak_ref)
        before = _resident()
        with _Peak() as peak:
            peak_ref[0] = peak
            engine.load_checkpoint(checkpoint, tag=tag)
        results[tag] = {"extra": peak.peak - before, "at_resume": optimizer_state(engine)}
        engine.destroy()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.slow
def test_resume_reads_the_optimizer_file_mapped_not_beside_the_live_state(tmp_path):
    from hf_superoffload.zero3.checkpoint_memory import resume_extra_host_bytes

    case = Zero3Case(steps=2, sub_group_size=1_000_000, two_groups=True)
    spawn_ranks(_resume_on_rank, (1, free_port(), case, str(tmp_path)), 1)
    result = torch.load(tmp_path / "rank0.pt", weights_only=False)
    n, largest = result["partition_numel"], result["largest"]
    for tag in ("zip", "legacy"):
        at_resume = result[tag]["at_resume"]
        for key in ("master", "exp_avg", "exp_avg_sq"):
            for i, (a, b) in enumerate(zip(at_resume[key], result["saved"][key], strict=True)):
                assert torch.equal(a, b), f"{tag}: {key}[{i}] differs after the resume"
    mapped = resume_extra_host_bytes(n, largest, mapped=True)
    whole = resume_extra_host_bytes(n, largest, mapped=False)
    assert whole == 12 * n and mapped < whole / 4  # a second copy would stand out
    extra = result["zip"]["extra"]
    assert extra <= mapped + SLACK, (
        f"resuming from a mapped file took {extra / 2**20:.1f} MiB above the live state; "
        f"checkpoint_memory says {mapped / 2**20:.1f} MiB (a second copy: {whole / 2**20:.1f})"
    )
    extra = result["legacy"]["extra"]
    assert abs(extra - whole) <= 0.05 * whole + SLACK, (
        f"resuming from a legacy-format file took {extra / 2**20:.1f} MiB above the live state;"
        f" checkpoint_memory says {whole / 2**20:.1f} MiB"
    )
