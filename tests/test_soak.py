"""Soak (``pytest -m slow``): 2,000 tiny CPU steps on each engine path, with a clip forced every
7th step and a NaN gradient every 13th, in a fresh process each; resident memory, open file
descriptors and OS threads must stay flat after warm-up, and every skip must be counted.

Flat means: between step ``WARMUP`` and the last step, RSS grows by less than
``RSS_GROWTH_LIMIT`` (2 MiB: a leak of 1.2 KiB per step would exceed it, while the allocator's
own noise after warm-up stayed under 0.5 MiB here), and the open file descriptors and the
process's thread count (``/proc/self/status``) are equal. The figures measured on the 2-core
CPU sandbox are in docs/troubleshooting.md ("Long runs").
"""

from __future__ import annotations

import gc
import json
import os
import time

import pytest
import torch
from engine_reference import worker_threads
from fuzz_reference import FuzzCase, GroupSpec, ParamBag, backward, make_engine, make_targets
from ranks import spawn_ranks

pytestmark = pytest.mark.slow

STEPS = 2_000
WARMUP = 200
CLIP_EVERY = 7
NAN_EVERY = 13
RSS_GROWTH_LIMIT = 2 * 2**20


def process_figures() -> dict[str, int]:
    """This process's resident memory (bytes), open file descriptors and OS threads."""
    gc.collect()
    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            status[key] = value.split()
    return {
        "rss": int(status["VmRSS"][0]) * 1024,
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": int(status["Threads"][0]),
    }


def run_and_sample(one_step, optimizer) -> dict:
    """``one_step(step)`` for every step, sampling the process after ``WARMUP`` steps and at
    the end (once ``optimizer``'s work in flight is done); also the wall time and its stats."""
    started = time.perf_counter()
    figures = {}
    for step in range(STEPS):
        one_step(step)
        if step + 1 == WARMUP:
            figures["warm"] = process_figures()
    optimizer.synchronize()
    figures["end"] = process_figures()
    figures["seconds"] = time.perf_counter() - started
    figures["stats"] = dict(optimizer.stats)
    return figures


def nan_steps() -> int:
    return len(range(0, STEPS, NAN_EVERY))


def forced_clips() -> int:
    """Steps scaled to clip that are not also NaN steps (those are skipped)."""
    return sum(1 for s in range(0, STEPS, CLIP_EVERY) if s % NAN_EVERY)


# ---------------------------------------------------------------------------------------------
# Standalone engine

# Four params in two groups, buckets of at most 512 elements (three buckets, the last to get
# gradients a device-tail bucket stepped by torch's AdamW), two declared accumulation passes.
SOAK_CASE = FuzzCase(
    shapes=((32, 16), (16,), (8, 8, 4), ()),
    group_of=(0, 1, 0, 1),
    groups=(
        GroupSpec(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1),
        GroupSpec(lr=2e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0),
    ),
    steps=1,  # targets are drawn one step at a time (`_step_targets`)
    accumulation=2,
    bucket_size=512,
    gpu_tail=1,
)
NORMAL_NORM = 28.0  # ~sqrt(801 elements) at target scale 1, plus the pull towards zero
CLIP_SCALE = 3.0  # every CLIP_EVERY-th step: norm ~84 against max_grad_norm 56


def _step_targets(step: int):
    scale = CLIP_SCALE if step % CLIP_EVERY == 0 else 1.0
    nonfinite = ((0, 1, 2, "nan"),) if step % NAN_EVERY == 0 else ()
    case = SOAK_CASE.replace(seed=step, grad_scales=(scale,), nonfinite=nonfinite)
    return make_targets(case)


def _standalone_soak(rank: int, out_path: str) -> None:
    case = SOAK_CASE.replace(max_grad_norm=2 * NORMAL_NORM)
    model = ParamBag(case.shapes, seed=0)
    opt = make_engine(case, model)

    def one_step(step: int) -> None:
        backward(case, model, _step_targets(step), 0)
        opt.step()
        opt.zero_grad()

    figures = run_and_sample(one_step, opt)
    figures["finite"] = all(bool(p.isfinite().all()) for p in model.parameters())
    opt.close()
    figures["workers_after_close"] = len(worker_threads())
    with open(out_path, "w") as f:
        json.dump(figures, f)


def _assert_flat(figures: dict) -> None:
    warm, end = figures["warm"], figures["end"]
    growth = end["rss"] - warm["rss"]
    assert growth < RSS_GROWTH_LIMIT, f"RSS grew {growth / 2**20:.2f} MiB after warm-up"
    assert end["fds"] == warm["fds"], f"open fds {warm['fds']} -> {end['fds']}"
    assert end["threads"] == warm["threads"], f"threads {warm['threads']} -> {end['threads']}"


def _report(record_property, name: str, figures: dict) -> None:
    warm, end = figures["warm"], figures["end"]
    line = (
        f"{name}: {STEPS} steps in {figures['seconds']:.1f} s; RSS {warm['rss'] / 2**20:.1f} -> "
        f"{end['rss'] / 2**20:.1f} MiB; fds {warm['fds']} -> {end['fds']}; threads "
        f"{warm['threads']} -> {end['threads']}"
    )
    record_property(name, line)
    print(line)


def test_standalone_engine_soak_stays_flat(tmp_path, record_property):
    out = tmp_path / "figures.json"
    spawn_ranks(_standalone_soak, (str(out),), 1, timeout=900)
    figures = json.loads(out.read_text())
    _report(record_property, "standalone", figures)
    _assert_flat(figures)
    stats = figures["stats"]
    assert stats["steps"] == STEPS
    assert stats["rollbacks_nonfinite"] == nan_steps()  # every skip counted
    assert 0 < stats["rollbacks_clip"] <= forced_clips()  # replays happen on forced clips only
    assert figures["finite"], "a NaN step leaked into the params"
    assert figures["workers_after_close"] == 0, "close() left the worker thread running"


# ---------------------------------------------------------------------------------------------
# ZeRO-3 path

ZERO3_CLIP = 5.0  # the tiny Llama's norms are ~1-2; a forced-clip step multiplies the loss by 20
ZERO3_CLIP_LOSS_SCALE = 20.0


def _zero3_soak(rank: int, port: int, out_path: str) -> None:
    from zero3_reference import Zero3Case, batch, init_rank, make_engine

    init_rank(rank, 1, port)
    torch.set_num_threads(1)
    import hf_superoffload  # noqa: F401  (activates the ZeRO-3 path)

    case = Zero3Case(steps=STEPS, max_grad_norm=ZERO3_CLIP, lr=1e-3, schedule=False)
    engine, optimizer = make_engine(case, True, 1)
    assert type(optimizer).__name__ == "SuperOffloadZero3Optimizer"

    def one_step(step: int) -> None:
        ids = batch(case, step, 0, rank, engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        if step % NAN_EVERY == 0:
            loss = loss * float("nan")
        elif step % CLIP_EVERY == 0:
            loss = loss * ZERO3_CLIP_LOSS_SCALE
        engine.backward(loss)
        engine.step()

    figures = run_and_sample(one_step, optimizer)
    engine.destroy()
    with open(out_path, "w") as f:
        json.dump(figures, f)


def test_zero3_path_soak_stays_flat(tmp_path, record_property):
    from zero3_reference import free_port

    out = tmp_path / "figures.json"
    spawn_ranks(_zero3_soak, (free_port(), str(out)), 1, timeout=900)
    figures = json.loads(out.read_text())
    _report(record_property, "zero3", figures)
    _assert_flat(figures)
    stats = figures["stats"]
    assert stats["steps"] == STEPS
    assert stats["rollbacks_nonfinite"] == nan_steps()
    assert stats["rollbacks_clip"] > 0
