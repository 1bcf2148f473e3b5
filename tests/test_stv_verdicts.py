"""The STV core's verdicts, one table row each (engine/stv.py; both engines drive this core).

A row is one optimizer step over two host partitions, driven the way the engines drive it:
``launch`` each partition as its gradients land (partition 0 first), then ``validate`` the
global norm and ``conclude``. Its inputs: the gradient scale against ``max_grad_norm``, a
non-finite value and where, whether the core may speculate, a change of lr between backward
and step(), or the step's gradients discarded before validation (``abandon``, as zero_grad()
does). Its outputs: the ``Verdict``; the CPU passes each partition ran (``HostSteps``:
speculate, complete, replay, rollback, step); the counters (``StvStats``); and the
partitions' masters, both moments and step counts against torch's AdamW +
``clip_grad_norm_`` (no step at all when the norm is non-finite or the step was abandoned).
Every rollback or replay must undo the speculation with its own record: the hyperparameters
and gradient scale the speculative pass used.

How the rows map to the core: commit = ``Verdict.COMMIT`` (speculated updates stand); replay =
``Verdict.CLIP`` (``HostSteps.replay``); skip = ``Verdict.SKIP`` after a speculation ran
(``HostSteps.rollback``); poisoned = ``Verdict.SKIP`` with the non-finite value in the first
partition, so nothing speculated (``SpeculationRound.poisoned``); withheld = the norm seen so
far already exceeds ``clip_threshold / scale``, so nothing speculated (``speculations_withheld``);
hyperparameters changed = the redo (rollback, then step with the new lr); rollback before
validation = ``Stv.abandon`` (``rollbacks_accumulation``).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from engine_reference import (
    EXP_AVG_SQ_TOL,
    EXP_AVG_TOL,
    PARAM_TOL,
    ROLLBACK_ATOL,
    ROLLBACK_RTOL,
)

from hf_superoffload import ops
from hf_superoffload.engine.link import Link
from hf_superoffload.engine.partition import HostPartition
from hf_superoffload.engine.stv import Stv, Verdict, validate

NUMEL = 48
STEPS_BEFORE = 3  # each partition has 3 updates behind it: moments and bias corrections matter
LR, NEW_LR = 2e-3, 5e-3
HYPER = {"betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.05}
COUNTERS = (
    "steps",
    "speculative_steps",
    "speculations_applied",
    "speculations_withheld",
    "replays",
    "rollbacks_clip",
    "rollbacks_nonfinite",
    "rollbacks_hparams",
    "rollbacks_accumulation",
)


@dataclasses.dataclass(frozen=True)
class Row:
    grad_scale: tuple[float, float]  # each partition's gradients: randn * this
    max_grad_norm: float | None
    verdict: Verdict | None  # None: abandoned before validation
    passes: tuple[tuple[str, ...], tuple[str, ...]]  # HostSteps passes run, per partition
    counters: dict  # the nonzero StvStats counters after the step; the others stay 0
    untouched: tuple[int, ...] = ()  # partitions left bit-exact (nothing ran on them)
    nonfinite_in: int | None = None  # the partition whose gradients hold a NaN
    speculate: bool = True
    clip_threshold: float | None = None  # the last validation's threshold (engines set it)
    predicted_coef: float = 1.0  # the last step's clip coefficient
    lr_at_step: float | None = None  # lr changed between backward and step()
    abandon: bool = False


ROWS = {
    "commit": Row(
        (0.01, 0.01), 1.0, Verdict.COMMIT,
        (("speculate", "complete"), ("speculate", "complete")),
        {"steps": 1, "speculative_steps": 1, "speculations_applied": 2},
        clip_threshold=1.0,
    ),
    "replay": Row(
        # Partition 0's norm alone stays under the threshold: it speculates and is replayed;
        # with partition 1 the norm seen so far exceeds it: that one is withheld.
        (0.1, 10.0), 1.0, Verdict.CLIP,
        (("speculate", "replay"), ("speculate", "replay")),
        {"steps": 1, "speculative_steps": 1, "speculations_applied": 1,
         "speculations_withheld": 1, "replays": 1, "rollbacks_clip": 1},
        clip_threshold=1.0,
    ),
    "replay-with-no-threshold-known": Row(
        (1.0, 1.0), 1.0, Verdict.CLIP,
        (("speculate", "replay"), ("speculate", "replay")),
        {"steps": 1, "speculative_steps": 1, "speculations_applied": 2, "replays": 2,
         "rollbacks_clip": 1},
    ),
    "withheld": Row(
        (10.0, 10.0), 1.0, Verdict.CLIP,
        (("speculate", "replay"), ("speculate", "replay")),
        {"steps": 1, "speculative_steps": 1, "speculations_withheld": 2},
        clip_threshold=1.0,
    ),
    "skip": Row(
        (0.01, 0.01), 1.0, Verdict.SKIP,
        (("speculate", "rollback"), ("speculate", "rollback")),
        {"steps": 1, "speculative_steps": 1, "speculations_applied": 1,
         "rollbacks_nonfinite": 1},
        untouched=(1,), nonfinite_in=1, clip_threshold=1.0,
    ),
    "poisoned": Row(
        (0.01, 0.01), 1.0, Verdict.SKIP,
        (("speculate", "rollback"), ("speculate", "rollback")),
        {"steps": 1, "speculative_steps": 1, "rollbacks_nonfinite": 1},
        untouched=(0, 1), nonfinite_in=0, clip_threshold=1.0,
    ),
    "hyperparameters-changed": Row(
        (0.01, 0.01), 1.0, Verdict.COMMIT,
        (("speculate", "rollback", "step"), ("speculate", "rollback", "step")),
        {"steps": 1, "speculative_steps": 1, "speculations_applied": 2,
         "rollbacks_hparams": 1},
        clip_threshold=1.0, lr_at_step=NEW_LR,
    ),
    "rollback-before-validation": Row(
        (0.01, 0.01), 1.0, None,
        (("speculate", "rollback"), ("speculate", "rollback")),
        {"speculations_applied": 2, "rollbacks_accumulation": 2},
        clip_threshold=1.0, abandon=True,
    ),
    "not-speculating": Row(
        (1.0, 1.0), 1.0, Verdict.CLIP, (("step",), ("step",)), {"steps": 1},
        speculate=False, clip_threshold=1.0,
    ),
    "after-a-clipped-step": Row(
        # speculate_after_clip=False: the last step clipped, so this one waits for validation.
        (0.01, 0.01), 1.0, Verdict.COMMIT, (("step",), ("step",)), {"steps": 1},
        clip_threshold=1.0, predicted_coef=0.5,
    ),
}  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _kernel():
    ops.prepare()  # the CPU Adam, built or loaded once


def _recording(stv: Stv) -> list[tuple]:
    """Wrap the core's CPU passes: each pass the core submits is recorded as (pass,
    partition, hyper, scale) (for a replay the scale is the old one); passes one of them runs
    inside (a withheld speculation's step) are not."""
    calls: list[tuple] = []
    host, depth = stv.host, [0]
    for name in ("speculate", "complete", "replay", "rollback", "step"):
        real = getattr(host, name)

        def record(part, hyper, scale, *args, _name=name, _real=real):
            if depth[0] == 0:
                calls.append((_name, part.index, hyper, scale))
            depth[0] += 1
            try:
                return _real(part, hyper, scale, *args)
            finally:
                depth[0] -= 1

        setattr(host, name, record)
    return calls


def _initial_state(seed: int) -> list[dict]:
    """Two partitions' masters, moments (from 3 earlier updates) and this step's gradients."""
    generator = torch.Generator().manual_seed(seed)
    states = []
    for _ in range(2):
        states.append(
            {
                "master": torch.randn(NUMEL, generator=generator),
                "exp_avg": torch.randn(NUMEL, generator=generator) * 1e-2,
                "exp_avg_sq": torch.rand(NUMEL, generator=generator) * 1e-4,
                "grad": torch.randn(NUMEL, generator=generator),
            }
        )
    return states


def _reference(states: list[dict], row: Row) -> list[dict]:
    """torch's AdamW + clip_grad_norm_ from the same state: what a validated step must give."""
    params = [torch.nn.Parameter(s["master"].clone()) for s in states]
    lr = row.lr_at_step if row.lr_at_step is not None else LR
    adamw = torch.optim.AdamW(params, lr=lr, foreach=False, **HYPER)
    for param, state in zip(params, states, strict=True):
        param.grad = state["grad"].clone()
        adamw.state[param] = {
            "step": torch.tensor(float(STEPS_BEFORE)),
            "exp_avg": state["exp_avg"].clone(),
            "exp_avg_sq": state["exp_avg_sq"].clone(),
        }
    norm = torch.nn.utils.clip_grad_norm_(params, row.max_grad_norm or math.inf)
    if math.isfinite(norm) and not row.abandon:
        adamw.step()
    return [
        {"master": p.detach(), **{k: adamw.state[p][k] for k in ("exp_avg", "exp_avg_sq")}}
        for p in params
    ]


@pytest.mark.parametrize("row", ROWS.values(), ids=ROWS.keys())
def test_verdict(row: Row):
    states = _initial_state(seed=7)
    for i, state in enumerate(states):
        state["grad"] *= row.grad_scale[i]
        if row.nonfinite_in == i:
            state["grad"][NUMEL // 2] = math.nan
    group = {"lr": LR, **HYPER}
    link = Link(torch.device("cpu"), pinned=False)
    stv = Stv(link, lambda: [group], 2, speculate=row.speculate)
    stv.clip_threshold, stv.predicted_coef = row.clip_threshold, row.predicted_coef
    calls = _recording(stv)
    parts = []
    for i, state in enumerate(states):
        master, grad = state["master"].clone(), state["grad"].clone()
        moments = state["exp_avg"].clone(), state["exp_avg_sq"].clone()
        part = HostPartition(i, 0, master, *moments, grad, None, master.clone())
        part.step = STEPS_BEFORE
        stv.host_sq_norms[i] = grad.square().sum()  # the engines' per-partition norm
        stv.launch(part, link.record())
        parts.append(part)

    result = None
    if row.abandon:
        stv.abandon(parts)
    else:
        if row.lr_at_step is not None:
            group["lr"] = row.lr_at_step
        total = torch.linalg.vector_norm(torch.cat([s["grad"] for s in states]))
        result = validate(total, row.max_grad_norm)
        stv.conclude(result, parts)
    stv.synchronize(parts)
    stv.close()

    assert (result.verdict if result is not None else None) is row.verdict
    if row.verdict in (Verdict.COMMIT, Verdict.CLIP):  # the next step speculates with these
        assert (stv.predicted_coef, stv.clip_threshold) == (result.clip_coef, row.max_grad_norm)
    else:  # a skipped or abandoned step teaches nothing
        assert (stv.predicted_coef, stv.clip_threshold) == (row.predicted_coef, row.clip_threshold)
    for i in range(2):
        assert tuple(c[0] for c in calls if c[1] == i) == row.passes[i], f"partition {i}"
    counters = dataclasses.asdict(stv.stats)
    assert {k: counters[k] for k in COUNTERS} == {k: row.counters.get(k, 0) for k in COUNTERS}
    _assert_undone_with_their_own_records(calls)

    want = _reference(states, row)
    stepped = row.verdict in (Verdict.COMMIT, Verdict.CLIP)
    for i, part in enumerate(parts):
        assert part.step == STEPS_BEFORE + stepped
        assert part.speculated_with is None  # the undo record is spent with the step
        got = {"master": part.master, "exp_avg": part.exp_avg, "exp_avg_sq": part.exp_avg_sq}
        for key, tol in (("master", PARAM_TOL), ("exp_avg", EXP_AVG_TOL),
                         ("exp_avg_sq", EXP_AVG_SQ_TOL)):  # fmt: skip
            if i in row.untouched:
                tol = {"rtol": 0.0, "atol": 0.0}
            elif not stepped:  # undone: within the rollback's rounding
                tol = {"rtol": ROLLBACK_RTOL, "atol": ROLLBACK_ATOL[key]}
            torch.testing.assert_close(got[key], want[i][key], **tol, msg=lambda m, k=key: k + m)
        torch.testing.assert_close(part.flat_param, part.master, rtol=0, atol=0)  # sent back


def _assert_undone_with_their_own_records(calls: list[tuple]) -> None:
    """A rollback or replay of a partition uses the hyperparameters and scale its speculative
    pass used (``HostPartition.speculated_with`` / ``speculated_scale``)."""
    speculated = {c[1]: (c[2], c[3]) for c in calls if c[0] == "speculate"}
    for name, index, hyper, scale in calls:
        if name in ("rollback", "replay"):
            assert (hyper, scale) == speculated[index], f"{name} of partition {index}"


@pytest.mark.parametrize(
    ("norm", "max_grad_norm", "verdict"),
    [
        (0.5, 1.0, Verdict.COMMIT),
        (4.0, 1.0, Verdict.CLIP),
        (1.0, 1.0, Verdict.CLIP),  # torch scales by 1 / (1 + 1e-6) at the threshold
        (4.0, None, Verdict.COMMIT),
        (4.0, 0.0, Verdict.COMMIT),  # 0: no clipping
        (math.inf, 1.0, Verdict.SKIP),
        (math.nan, None, Verdict.SKIP),
    ],
    ids=["under", "over", "at-threshold", "no-threshold", "zero-threshold", "inf", "nan"],
)
def test_validate(norm, max_grad_norm, verdict):
    """The verdict from the global norm, and a clip coefficient that scales a gradient to the
    bit as torch's clip_grad_norm_ does."""
    result = validate(torch.tensor(norm), max_grad_norm)
    assert result.verdict is verdict
    assert result.max_grad_norm == (max_grad_norm or None)
    assert result.total_norm == norm or not math.isfinite(norm)
    if verdict is Verdict.SKIP:
        assert result.clip_coef == 0.0 and not math.isfinite(result.total_norm)
        return
    param = torch.nn.Parameter(torch.zeros(1))
    param.grad = torch.tensor([norm])
    torch.nn.utils.clip_grad_norm_([param], max_grad_norm or math.inf)
    assert torch.equal(torch.tensor([norm]) * result.clip_coef, param.grad)
    assert (result.clip_coef < 1.0) is (verdict is Verdict.CLIP)
