"""The gradient arrival part (engine/grad_arrival.py) on its own: no model, no optimizer;
and the forward waits (engine/forward_waits.py) over stand-in buckets.

Six params in three buckets of two, gradients fed one param at a time through the part's own
post-accumulate-grad hooks (``(param * grad).sum().backward()``), a real STV core on the CPU
that records what it is handed, and a stand-in forward watch (the ``ForwardWatch`` protocol).
What is checked: which buckets the part launches and when (the moment the last gradient of a
bucket arrives, in the order they complete), that the watch is on before any launch, the
global norm it reports, and the exact fp32 gradients (or sums of them) each bucket hands on.
"""

from __future__ import annotations

import pytest
import torch
from engine_reference import ROLLBACK_ATOL, ROLLBACK_RTOL

from hf_superoffload import ops
from hf_superoffload.engine.arrival_counts import ArrivalCounts
from hf_superoffload.engine.bucket import Bucket
from hf_superoffload.engine.buckets import plan_buckets
from hf_superoffload.engine.cast_policy import CastPlan
from hf_superoffload.engine.forward_waits import ForwardWaits
from hf_superoffload.engine.grad_arrival import GradArrival
from hf_superoffload.engine.link import Link
from hf_superoffload.engine.replicas import Replicas
from hf_superoffload.engine.stv import Stv, validate

SIZES = (3, 5, 4, 2, 6, 1)  # bucket_size 8 makes buckets [p5, p4], [p3, p2], [p1, p0]
BUCKET_SIZE = 8
NORM_RTOL = 1e-6  # per-bucket norms summed vs one norm of everything: fp32 summation order


class Watch:
    """A ForwardWatch that only says whether it is on."""

    def __init__(self):
        self.on = False

    def start(self) -> None:
        self.on = True

    def stop(self) -> None:
        self.on = False


class RecordingStv(Stv):
    """The real core, noting each launch as (bucket, whether the watch was on, speculate) and
    each retraction of a speculation."""

    def __init__(self, watch: Watch, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.watch, self.launches, self.retracted = watch, [], []

    def launch(self, part, d2h_event, speculate: bool = True) -> None:
        self.launches.append((part.index, self.watch.on, speculate))
        super().launch(part, d2h_event, speculate)

    def retract(self, part) -> None:
        if part.speculated_with is not None:
            self.retracted.append(part.index)
        super().retract(part)


class Rig:
    def __init__(self, accumulation_steps: int = 1, speculate: bool = False, tail: int = 0):
        generator = torch.Generator().manual_seed(0)
        self.params = [torch.nn.Parameter(torch.randn(n, generator=generator)) for n in SIZES]
        self.index_of = {id(p): i for i, p in enumerate(self.params)}
        group = {"params": self.params, "lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8}
        group["weight_decay"] = 0.0
        link = Link(torch.device("cpu"), pinned=False)
        cast = CastPlan(True, True, "fp32 params")
        plans = plan_buckets([group], BUCKET_SIZE)
        # The last ``tail`` buckets are tail buckets (on the CPU, stepped by torch's AdamW).
        self.buckets = [Bucket(p, link, p.index >= len(plans) - tail, cast) for p in plans]
        slot = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.plan.params)}
        self.watch = Watch()
        self.stv = RecordingStv(self.watch, link, lambda: [group], 3, speculate=speculate)
        self.arrival = GradArrival(
            params=self.params,
            buckets=self.buckets,
            slot=slot,
            link=link,
            replicas=Replicas(None, link.device),
            stv=self.stv,
            cast=cast,
            accumulation_steps=accumulation_steps,
            watch=self.watch,
        )
        self.masters = [b.master.clone() for b in self.buckets]
        self._generator = torch.Generator().manual_seed(1)

    def feed(self, index: int) -> torch.Tensor:
        """A gradient for param ``index``, through its hook; returns the gradient."""
        param = self.params[index]
        grad = torch.randn(param.shape, generator=self._generator)
        (param * grad).sum().backward()
        assert param.grad is None  # the bucket took it
        return grad

    def launched(self) -> list[int]:
        return [index for index, _, _ in self.stv.launches]

    def finish_step(self) -> None:
        """What step() does after the arrival part: validate, conclude, end the step."""
        result = validate(self.arrival.total_norm(), None)
        self.stv.conclude(result, self.buckets)
        self.stv.synchronize(self.buckets)
        self.arrival.end_step()

    def close(self) -> None:
        for handle in self.arrival.handles:
            handle.remove()
        self.stv.close()


@pytest.fixture(scope="module", autouse=True)
def _kernel():
    ops.prepare()  # the CPU Adam, built or loaded once


@pytest.fixture
def rig(request):
    made = []

    def make(**kwargs) -> Rig:
        made.append(Rig(**kwargs))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _norm(grads) -> torch.Tensor:
    return torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads]))


def test_the_planned_buckets(rig):
    r = rig()
    by_bucket = [[r.index_of[id(p)] for p in b.plan.params] for b in r.buckets]
    assert by_bucket == [[5, 4], [3, 2], [1, 0]]


def test_a_bucket_launches_when_its_last_gradient_arrives_in_the_order_they_complete(rig):
    r = rig(speculate=True)
    grads, seen = {}, []
    for index in (1, 5, 3, 0, 4, 2):
        grads[index] = r.feed(index)
        seen.append(r.launched())
    assert seen == [[], [], [], [2], [2, 0], [2, 0, 1]]
    assert all(watch_on and speculate for _, watch_on, speculate in r.stv.launches)
    assert r.arrival.any_arrived
    for bucket in r.buckets:  # on the CPU the host buffer is the staging buffer: exact
        for i, param in enumerate(bucket.plan.params):
            assert torch.equal(bucket.views(bucket.host_grad, i), grads[r.index_of[id(param)]])
        assert bucket.present == [True, True]
    norm = r.arrival.total_norm()
    torch.testing.assert_close(norm, _norm(grads.values()), rtol=NORM_RTOL, atol=0)
    assert r.launched() == [2, 0, 1]  # nothing left to flush
    r.finish_step()
    assert not r.watch.on and not r.arrival.any_arrived
    assert not any(b.launched for b in r.buckets)


def test_a_param_without_gradient_is_flushed_at_step_and_not_updated(rig):
    r = rig(speculate=True)
    grads = [r.feed(index) for index in (5, 4, 3, 2, 1)]  # p0 gets none
    assert r.launched() == [0, 1]
    norm = r.arrival.total_norm()  # step()'s flush launches bucket 2 as it is
    assert r.stv.launches[-1] == (2, True, False)  # flushed: it steps after validation
    torch.testing.assert_close(norm, _norm(grads), rtol=NORM_RTOL, atol=0)
    last = r.buckets[2]
    assert last.present == [True, False]
    assert last.update_runs() == [(0, SIZES[1], 1)]  # p1 only: p0 is not stepped at all
    p0_master = last.views(last.master, 1).clone()
    r.finish_step()
    assert torch.equal(last.views(last.master, 1), p0_master)
    assert last.param_steps == [1, 0]


def test_declared_accumulation_launches_each_bucket_once_with_the_exact_fp32_sum(rig):
    r = rig(accumulation_steps=2, speculate=True)
    first = {index: r.feed(index) for index in range(6)}
    assert r.launched() == []  # each round went to the bucket's host sum
    second = {}
    for index in (5, 4, 3, 2, 1, 0):
        second[index] = r.feed(index)
    assert r.launched() == [0, 1, 2]
    sums = {index: first[index] + second[index] for index in range(6)}
    norm = r.arrival.total_norm()
    torch.testing.assert_close(norm, _norm(sums.values()), rtol=NORM_RTOL, atol=0)
    r.stv.worker.wait()
    for bucket in r.buckets:
        for i, param in enumerate(bucket.plan.params):
            got = bucket.views(bucket.grad_for_kernel(), i)
            assert torch.equal(got, sums[r.index_of[id(param)]])
    assert r.stv.retracted == []


def test_a_tail_bucket_sums_its_arrivals_in_its_own_fp32_gradients_and_is_not_handed_on(rig):
    r = rig(accumulation_steps=2, speculate=True, tail=1)
    first = {index: r.feed(index) for index in range(6)}
    sums = {index: first[index] + r.feed(index) for index in range(6)}
    tail = r.buckets[2]
    assert r.launched() == [1, 0] and tail.launched  # the tail steps on the device, at step()
    for i, param in enumerate(tail.plan.params):
        assert torch.equal(tail.views(tail.grad, i), sums[r.index_of[id(param)]])
    norm = r.arrival.total_norm()
    torch.testing.assert_close(norm, _norm(sums.values()), rtol=NORM_RTOL, atol=0)


@pytest.mark.parametrize("speculate", [False, True], ids=["reopened", "forward-reopened"])
def test_an_undeclared_second_backward_reopens_the_bucket_and_later_steps_expect_two(
    rig, speculate
):
    """A second round of gradients for a launched bucket: without a speculation in it the
    bucket reopens and sums; with one, a forward's wait (``before_forward``, what the forward
    hooks call) rolls it back first. Either way the next step launches each bucket once."""
    r = rig(speculate=speculate)
    grads = {}
    for index in (5, 4, 3, 2, 1, 0):
        grads[index] = [r.feed(index)]
    assert r.launched() == [0, 1, 2]
    if speculate:
        r.arrival.before_forward(r.buckets)
        assert r.stv.retracted == [0, 1, 2] and r.stv.stats.rollbacks_accumulation == 3
    for index in (5, 4, 3, 2, 1, 0):
        grads[index].append(r.feed(index))
    assert r.launched() == [0, 1, 2, 0, 1, 2]
    norm = r.arrival.total_norm()
    torch.testing.assert_close(norm, _norm(sum(g) for g in grads.values()), rtol=NORM_RTOL, atol=0)
    r.finish_step()

    r.stv.launches.clear()
    for index in (5, 4, 3, 2, 1, 0):
        r.feed(index)
    assert r.launched() == []  # learned: two arrivals per step
    for index in (5, 4, 3, 2, 1, 0):
        r.feed(index)
    assert r.launched() == [0, 1, 2]
    assert len(r.stv.retracted) == (3 if speculate else 0)  # none in the second step


def test_a_gradient_after_a_speculation_with_no_forward_between_is_refused_and_undone(rig):
    r = rig(speculate=True)
    r.feed(5)
    r.feed(4)
    assert r.launched() == [0]
    with pytest.raises(RuntimeError, match="The step was refused"):
        r.feed(5)
    assert not r.arrival.any_arrived and not r.watch.on
    assert not any(b.launched for b in r.buckets)
    assert r.stv.stats.rollbacks_accumulation == 1
    bucket = r.buckets[0]
    torch.testing.assert_close(
        bucket.master, r.masters[0], rtol=ROLLBACK_RTOL, atol=ROLLBACK_ATOL["master"]
    )
    assert bucket.param_steps == [0, 0]


def test_an_announced_boundary_launches_in_the_last_pass_only(rig):
    r = rig(speculate=True)
    r.arrival.set_boundary(False)
    first = {index: r.feed(index) for index in range(6)}
    assert r.launched() == [] and not r.watch.on
    r.arrival.set_boundary(True)
    sums = {}
    for index in (5, 4, 1, 0, 3, 2):
        sums[index] = first[index] + r.feed(index)
    assert r.launched() == [0, 2, 1]
    norm = r.arrival.total_norm()
    torch.testing.assert_close(norm, _norm(sums.values()), rtol=NORM_RTOL, atol=0)


def test_zero_grad_discards_what_arrived_and_rolls_back_speculations(rig):
    r = rig(speculate=True)
    for index in (5, 4, 3):
        r.feed(index)
    assert r.launched() == [0]
    r.arrival.discard()
    r.stv.synchronize(r.buckets)
    assert not r.arrival.any_arrived and not r.watch.on
    assert r.stv.retracted == [0]
    assert not any(b.staged[i] for b in r.buckets for i in range(2))
    for bucket, master in zip(r.buckets, r.masters, strict=True):
        torch.testing.assert_close(
            bucket.master, master, rtol=ROLLBACK_RTOL, atol=ROLLBACK_ATOL["master"]
        )
    grads = [r.feed(index) for index in range(6)]  # the next backward starts afresh
    torch.testing.assert_close(r.arrival.total_norm(), _norm(grads), rtol=NORM_RTOL, atol=0)


class _Bucket:
    """What ForwardWaits reads of a bucket: its index and whether it is on the device."""

    def __init__(self, index: int, on_device: bool = False):
        self.index, self.on_device = index, on_device


def _three_layers():
    """Three linear layers; bucket 0 holds the last layer, 1 the middle one and the first
    layer's bias, 2 (a tail bucket) the first layer's weight."""
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(3)))
    buckets = [_Bucket(0), _Bucket(1), _Bucket(2, on_device=True)]
    first, middle, last = model
    owners = {
        last.weight: 0, last.bias: 0, middle.weight: 1, middle.bias: 1, first.bias: 1,
        first.weight: 2,
    }  # fmt: skip
    slot = {id(p): (buckets[b], 0) for p, b in owners.items()}
    return model, buckets, slot


@pytest.mark.parametrize("per_module", [True, False], ids=["model", "watch"])
def test_forward_waits_hand_each_module_its_own_host_buckets(per_module):
    """With the model, every forward waits per module; without it, only between start()
    and stop() (a speculating step), through one global hook."""
    model, buckets, slot = _three_layers()
    seen = []
    waits = ForwardWaits(
        slot=slot,
        before_forward=lambda bs: seen.append([b.index for b in bs]),
        model=model if per_module else None,
    )
    model(torch.randn(2, 4))
    if not per_module:
        assert seen == [] and waits.handles == []
        waits.start()
        waits.start()  # once: one global hook
        assert len(waits.handles) == 1
        model(torch.randn(2, 4))
    # The first layer's tail bucket is left out; the Sequential itself holds no params.
    assert seen == [[1], [1], [0]]
    buckets[2].on_device = False  # "auto" moved it back to the host: waited for now
    seen.clear()
    model(torch.randn(2, 4))
    assert seen == [[1, 2], [1], [0]]
    waits.stop()
    seen.clear()
    model(torch.randn(2, 4))
    assert (seen != []) is per_module
    assert len(waits.handles) == (3 if per_module else 0)  # the watch is gone with stop()
    for handle in waits.handles:
        handle.remove()


def _counts_say(steps: int, script: list) -> list[bool]:
    """Drive ArrivalCounts over one param (key 0): ints are arrivals, ("boundary", b) an
    announcement, "learn" the end of a step that reopened its bucket, "reset" any step end.
    Returns whether each arrival was the param's last of the step."""
    counts, said = ArrivalCounts([0], steps, learning=False), []
    replicas = Replicas(None, torch.device("cpu"))
    for item in script:
        if item == "learn":
            counts.learn(reopened=True, replicas=replicas)
            counts.reset()
        elif item == "reset":
            counts.reset()
        elif isinstance(item, tuple):
            counts.set_boundary(item[1])
        else:
            said += [counts.arrive(0) for _ in range(item)]
    return said


@pytest.mark.parametrize(
    ("steps", "script", "last"),
    [
        (1, [1, "reset", 1], [True, True]),
        (3, [3], [False, False, True]),
        (1, [2, "learn", 2], [True, True, False, True]),  # an undeclared second backward
        (3, [2, "reset", 3], [False, False, False, False, True]),  # the count starts afresh
        (1, [("boundary", False), 2, ("boundary", True), 1], [False, False, True]),
        # A hook firing twice in the announced last pass: learned per boundary pass.
        (1, [("boundary", True), 2, "learn", ("boundary", False), 1, ("boundary", True), 2],
         [True, True, False, False, True]),
    ],
    ids=["one", "declared", "learned", "reset", "boundary", "boundary-learned"],
)  # fmt: skip
def test_which_arrival_is_a_params_last(steps, script, last):
    assert _counts_say(steps, script) == last
