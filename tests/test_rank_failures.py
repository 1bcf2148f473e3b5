"""One rank's failure ends every rank promptly, with that error, not at the collective timeout.

Two gloo processes; rank 1 fails (in the optimizer's constructor, or in a CPU Adam task on the
worker) while rank 0 goes on training into the next collective. Each rank records what it
raised and when, then leaves as a crashed process does (``os._exit``, no clean shutdown), so
the test sees what a launcher would. The process group's timeout is 60 s; rank 0 must end
within ``PROMPT_S`` of rank 1's failure, and the whole test is bounded by ``spawn_ranks``'s
timeout, so a hang fails instead of blocking CI.
"""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
import traceback

import pytest
import torch
import torch.distributed as dist
from ranks import spawn_ranks

PROMPT_S = 5.0
GROUP_TIMEOUT = datetime.timedelta(seconds=60)
WORLD = 2


def _record(out_dir: str, rank: int, outcome: dict) -> None:
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(outcome, f)


def _mark_failure(out_dir: str) -> None:
    with open(os.path.join(out_dir, "failed_at"), "w") as f:
        f.write(repr(time.time()))


def _run_rank(rank: int, body, out_dir: str) -> None:
    """``body()`` on this rank; record how it ended, then exit as a crashed process would."""
    outcome = {"finished": False}
    try:
        body()
        outcome["finished"] = True
    except BaseException as error:
        from hf_superoffload.engine.replicas import latest_generation, published_failures

        outcome.update(
            type=type(error).__name__,
            message=str(error),
            cause=repr(error.__cause__),
            at=time.time(),
            published_by_others=published_failures(latest_generation()),
            traceback=traceback.format_exc(),
            # Failure watches still running (a failed constructor must have stopped its own).
            watches=[t.name for t in threading.enumerate() if "failure-watch" in t.name],
        )
    _record(out_dir, rank, outcome)
    os._exit(0)  # sockets close as the process goes, as when an exception ends a rank


def _outcomes(out_dir) -> tuple[dict, dict, float]:
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]
    failed_at = float((out_dir / "failed_at").read_text())
    return ranks[0], ranks[1], failed_at


def _assert_prompt(rank0: dict, failed_at: float) -> None:
    assert not rank0["finished"], "rank 0 trained on as if rank 1 were there"
    late = rank0["at"] - failed_at
    assert late < PROMPT_S, f"rank 0 ended {late:.1f} s after rank 1 failed\n{rank0['traceback']}"


# --- the replicas path (SuperOffloadOptimizer over a process group) ----------------------------


def _replicas_rank(rank: int, rendezvous: str, out_dir: str, where: str) -> None:
    from engine_reference import RunConfig, build_model, make_batches, make_engine

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD,
        timeout=GROUP_TIMEOUT,
    )  # fmt: skip
    cfg = RunConfig(max_grad_norm=1e6)
    batches = make_batches(cfg, 4)

    def body() -> None:
        from hf_superoffload.engine import layout
        from hf_superoffload.engine.host_steps import HostSteps

        model = build_model(cfg)
        if rank == 1 and where == "constructor":
            # A failure of this rank's own resources once the group is formed (as a GPU with
            # less free memory refusing gpu_tail would).
            def refuse(*args, **kwargs):
                _mark_failure(out_dir)
                raise RuntimeError("injected: this rank's device cannot hold the tail buckets")

            layout.choose_device_buckets = refuse
        opt = make_engine(model, cfg, gpu_tail=0)
        for step in range(4):
            if rank == 1 and where == "worker" and step == 1:

                def fail(*args, **kwargs):
                    _mark_failure(out_dir)
                    raise RuntimeError("injected CPU Adam failure")

                HostSteps._pass = fail
            x = batches[step]
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()

    _run_rank(rank, body, out_dir)


def _spawn_replicas(tmp_path, where: str):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    rendezvous = str(tmp_path / "rendezvous")
    spawn_ranks(_replicas_rank, (rendezvous, str(out_dir), where), WORLD, timeout=120)
    return _outcomes(out_dir)


def test_a_worker_failure_on_one_replica_ends_both_with_its_error(tmp_path):
    rank0, rank1, failed_at = _spawn_replicas(tmp_path, "worker")
    assert rank1["type"] == "WorkerError" and "injected CPU Adam failure" in rank1["message"]
    _assert_prompt(rank0, failed_at)
    assert rank0["type"] == "PeerRankError", rank0["traceback"]
    assert rank0["message"].startswith(
        "rank 1 failed with RuntimeError: injected CPU Adam failure. Rank 0 stopped with it"
    )
    assert "restart every rank" in rank0["message"]


@pytest.mark.slow
def test_a_constructor_failure_on_one_replica_ends_both_promptly(tmp_path):
    """Until SuperOffloadOptimizer's constructor publishes its failures (``shares_failures``,
    see docs/troubleshooting.md), rank 0 learns that rank 1 ended, not why."""
    rank0, rank1, failed_at = _spawn_replicas(tmp_path, "constructor")
    assert rank1["type"] == "RuntimeError" and "injected: this rank's device" in rank1["message"]
    _assert_prompt(rank0, failed_at)
    assert rank0["type"] == "PeerRankError", rank0["traceback"]
    assert rank0["watches"] == rank1["watches"] == [], (rank0["watches"], rank1["watches"])
    assert "rank 1 failed with RuntimeError: injected" in rank0["message"] or (
        "Another rank most likely failed" in rank0["message"]
    )


# --- the ZeRO-3 path ---------------------------------------------------------------------------


def _zero3_rank(rank: int, port: int, out_dir: str, where: str) -> None:
    from zero3_reference import Zero3Case, batch, init_rank, make_engine

    init_rank(rank, WORLD, port)
    torch.set_num_threads(1)
    import hf_superoffload  # noqa: F401  (activates the ZeRO-3 path)
    from hf_superoffload.engine import host_memory
    from hf_superoffload.engine.host_steps import HostSteps

    case = Zero3Case(steps=4, max_grad_norm=1e6, schedule=False)

    def body() -> None:
        if rank == 1 and where == "constructor":

            def short_host() -> tuple[int, str]:
                _mark_failure(out_dir)
                return 100_000, "a test's figure"  # bytes: too few for this rank's partition

            host_memory.host_memory_available = short_host
        engine, _ = make_engine(case, True, WORLD)
        for step in range(case.steps):
            if rank == 1 and where == "worker" and step == 1:

                def fail(*args, **kwargs):
                    _mark_failure(out_dir)
                    raise RuntimeError("injected CPU Adam failure")

                HostSteps._pass = fail
            ids = batch(case, step, 0, rank, engine.device)
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        engine.optimizer.synchronize()

    _run_rank(rank, body, out_dir)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["constructor", "worker"])
def test_a_failure_on_one_zero3_rank_ends_both_promptly(tmp_path, where):
    """Rank 0 waits in a DeepSpeed collective: in our constructor, a backward reduce-scatter or
    step's norm all-reduce it ends with PeerRankError quoting rank 1's error; in a forward
    all-gather (none of ours) with gloo's broken connection. Either way promptly, with rank
    1's error published for it to read."""
    from zero3_reference import free_port

    out_dir = tmp_path / "out"
    out_dir.mkdir()
    spawn_ranks(_zero3_rank, (free_port(), str(out_dir), where), WORLD, timeout=180)
    rank0, rank1, failed_at = _outcomes(out_dir)
    expected = {
        "constructor": ("HostMemoryError", "the optimizer's host state needs"),
        "worker": ("WorkerError", "injected CPU Adam failure"),
    }[where]
    assert (rank1["type"], expected[1] in rank1["message"]) == (expected[0], True), rank1
    _assert_prompt(rank0, failed_at)
    assert expected[1] in rank0["published_by_others"]["1"], rank0
    if where == "constructor":  # rank 0 is still in its own constructor's collectives
        assert rank0["type"] == "PeerRankError", rank0["traceback"]
        assert rank0["watches"] == rank1["watches"] == [], (rank0["watches"], rank1["watches"])
        assert rank0["message"].startswith(f"rank 1 failed with {expected[0]}: {expected[1]}")


# --- a failure the failing rank catches and handles ------------------------------------------


def _handling_rank(rank: int, rendezvous: str, out_dir: str) -> None:
    """Rank 1's constructor fails after its collectives (caught: rank 0 drops its optimizer
    too); both build another and train; at step 1 rank 1's step() fails before its collectives
    (caught, retried after long enough for rank 0's watch to see it). Neither may end."""
    import logging

    from engine_reference import RunConfig, build_model, make_batches, make_engine

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD,
        timeout=GROUP_TIMEOUT,
    )  # fmt: skip
    cfg = RunConfig(max_grad_norm=1e6)
    batches = make_batches(cfg, 4)
    log: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: log.append(record.getMessage())
    logging.getLogger("hf_superoffload").addHandler(handler)
    outcome: dict = {"handled": []}
    try:
        from hf_superoffload.engine import layout

        model = build_model(cfg)
        real_check = layout.check_host_memory
        if rank == 1:

            def refuse(*args, **kwargs):
                raise RuntimeError("injected: this rank's host memory check failed")

            layout.check_host_memory = refuse
        try:
            make_engine(model, cfg, gpu_tail=0).close()
        except RuntimeError as error:
            outcome["handled"].append(str(error))
        layout.check_host_memory = real_check
        opt = make_engine(model, cfg, gpu_tail=0)  # a later optimizer: starts with no failure
        for step in range(3):
            x = batches[step]
            model(input_ids=x, labels=x).loss.backward()
            if rank == 1 and step == 1:
                real = opt._check_params_attached

                def fail_once(real=real):
                    opt._check_params_attached = real
                    raise RuntimeError("injected: caught by the training loop")

                opt._check_params_attached = fail_once
                try:
                    opt.step()
                except RuntimeError as error:
                    outcome["handled"].append(str(error))
                time.sleep(2.5)  # rank 0's watch (0.5 s polls) sees it meanwhile
            opt.step()
            opt.zero_grad()
            time.sleep(1.5)  # a watch that fired would have by the next step's collectives
        opt.synchronize()
        outcome["params"] = [float(p.double().sum()) for p in model.parameters()]
        outcome["watch_failure"] = opt._replicas.failure_watch.failure
        outcome["finished"] = True
    except BaseException as error:
        outcome.update(type=type(error).__name__, message=str(error),
                       traceback=traceback.format_exc())  # fmt: skip
    outcome["log"] = log
    _record(out_dir, rank, outcome)
    os._exit(0)


@pytest.mark.slow
def test_a_failure_the_failing_rank_handles_is_withdrawn_and_ends_no_rank(tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    rendezvous = str(tmp_path / "rendezvous")
    spawn_ranks(_handling_rank, (rendezvous, str(out_dir)), WORLD, timeout=180)
    rank0, rank1 = (json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD))
    for rank in (rank0, rank1):
        assert rank.get("finished"), rank.get("traceback", rank)
        assert rank["watch_failure"] is None
    assert [m.split(":")[1].strip() for m in rank1["handled"]] == [
        "this rank's host memory check failed",
        "caught by the training loop",
    ]
    assert rank0["params"] == rank1["params"]  # the replicas stayed in step
    # Rank 0's watch saw the step failure while rank 1 handled it, and forgot it when withdrawn.
    assert any("withdrew its failure" in m and "caught by the training" in m for m in rank0["log"])
