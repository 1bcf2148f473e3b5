"""Data parallelism by replicas, on CPU with gloo (and, marked multi_gpu, on two GPUs with
NCCL). Two ranks, each on half of every batch, must follow one process on the whole batch
(torch.optim.AdamW + clip_grad_norm_) tensor by tensor, and stay bit-identical to each other:
the same averaged gradients, the same kernels, the same verdicts. Rank 1 starts from other
random weights, so the first broadcast is tested too.
"""

from __future__ import annotations

import dataclasses
import datetime

import pytest
import torch
import torch.distributed as dist
from engine_reference import (
    RunConfig,
    TrainResult,
    assert_same_trajectory,
    build_model,
    clip_threshold,
    collect_engine_result,
    engine_do_step,
    make_batches,
    make_engine,
    make_scheduler,
    run_reference,
    train_loop,
)
from ranks import spawn_ranks

from hf_superoffload import SuperOffloadOptimizer
from hf_superoffload.engine.replicas import Replicas

WORLD = 2


def _config(**changes) -> RunConfig:
    cfg = RunConfig(steps=12).replace(**changes)
    return cfg.replace(max_grad_norm=clip_threshold(cfg, "some"))  # clips on some steps


def _train_on_rank(rank, rendezvous, cfg, options, inject_on_rank, out_dir, backend) -> None:
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    _join_group(backend, rendezvous, rank)
    try:
        model = build_model(cfg.replace(model_seed=cfg.model_seed + rank), device)
        share = cfg.batch_size // WORLD
        batches = [b[rank * share : (rank + 1) * share] for b in make_batches(cfg, device=device)]
        local = cfg if rank == inject_on_rank else cfg.replace(inject=())
        with make_engine(model, cfg, **options) as opt:
            scheduler = make_scheduler(cfg, opt)  # None without cfg.schedule
            records = train_loop(
                local, model, opt, batches, engine_do_step(opt), scheduler=scheduler
            )
            result = collect_engine_result(opt, model, records)
        torch.save(dataclasses.asdict(result), out_dir / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _join_group(backend: str, rendezvous: str, rank: int) -> None:
    # A short timeout: if one rank dies, the other fails in minutes instead of hanging CI.
    dist.init_process_group(
        backend, init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip


def _run_ranks(tmp_path, cfg, options, inject_on_rank=None, backend="gloo") -> list[dict]:
    rendezvous = str(tmp_path / "rendezvous")
    spawn_ranks(
        _train_on_rank, (rendezvous, cfg, options, inject_on_rank, tmp_path, backend), WORLD
    )
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _assert_replicas_identical(results: list[dict]) -> None:
    first = results[0]
    for other in results[1:]:
        for key in ("params", "master", "exp_avg", "exp_avg_sq"):
            for name, tensor in first[key].items():
                assert torch.equal(tensor, other[key][name]), f"ranks differ in {key}[{name}]"
        norms = [torch.tensor(r["grad_norms"]) for r in (first, other)]
        torch.testing.assert_close(*norms, rtol=0, atol=0, equal_nan=True)
        assert first["skipped"] == other["skipped"]


def _as_one_process(results: list[dict]) -> TrainResult:
    """Rank 0's result with the whole batch's loss (the mean of the ranks' equal halves)."""
    got = dict(results[0])
    per_rank = [r["losses"] for r in results]
    got["losses"] = [sum(step) / WORLD for step in zip(*per_rank, strict=True)]
    return TrainResult(**got)


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [{"gpu_tail": 0}, {"gpu_tail": 2}, {"gpu_tail": "auto"}],
    ids=lambda o: f"gpu_tail={o['gpu_tail']}",
)
def test_two_ranks_on_half_batches_follow_one_process_on_the_whole(tmp_path, options):
    cfg = _config()
    results = _run_ranks(tmp_path, cfg, options)
    _assert_replicas_identical(results)
    assert_same_trajectory(_as_one_process(results), run_reference(cfg))
    assert results[0]["stats"]["rollbacks_clip"] + results[0]["stats"]["speculative_steps"] > 0


@pytest.mark.slow
def test_a_nan_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    cfg = _config(inject=((5, "lm_head.weight", "nan"),))
    results = _run_ranks(tmp_path, cfg, {"gpu_tail": 2}, inject_on_rank=1)
    _assert_replicas_identical(results)
    assert results[0]["skipped"][5] and sum(results[0]["skipped"]) == 1
    assert_same_trajectory(_as_one_process(results), run_reference(cfg))


def test_accumulation_and_param_groups_with_a_schedule(tmp_path):
    cfg = _config(accum=2, two_groups=True, schedule="warmup_decay")
    results = _run_ranks(tmp_path, cfg, {"gpu_tail": 2})
    _assert_replicas_identical(results)
    assert_same_trajectory(_as_one_process(results), run_reference(cfg))


@pytest.mark.multi_gpu
@pytest.mark.parametrize("options", [{"gpu_tail": 2}, {"gpu_tail": "auto"}], ids=str)
def test_two_gpus_with_nccl_follow_one_gpu_on_the_whole_batch(tmp_path, options):
    if torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} CUDA GPUs")
    cfg = _config()
    results = _run_ranks(tmp_path, cfg, options, backend="nccl")
    _assert_replicas_identical(results)
    assert_same_trajectory(_as_one_process(results), run_reference(cfg, device="cuda:0"))
    assert results[0]["stats"]["bytes_d2h"] > 0


def _agree_on_rank(rank, rendezvous, out_dir) -> None:
    _join_group("gloo", rendezvous, rank)
    try:
        replicas = Replicas(None, torch.device("cpu"))
        found = {
            "size": replicas.size,
            "min": replicas.agree(10 + rank, "min"),
            "max": replicas.agree(10 + rank, "max"),
            "rank0": replicas.from_rank0([rank, 5.0 + rank]),
        }
        grads = torch.full((3,), float(rank + 1), dtype=torch.bfloat16)
        replicas.average_(grads)
        found["average"] = grads.tolist()
        torch.save(found, out_dir / f"agree{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_replicas_agree_on_local_decisions_and_average(tmp_path):
    """What keeps placement and cast plan one across ranks: the min/max of local values and
    rank 0's values, the same on every rank."""
    spawn_ranks(_agree_on_rank, (str(tmp_path / "rendezvous"), tmp_path), WORLD)
    for rank in range(WORLD):
        found = torch.load(tmp_path / f"agree{rank}.pt")
        assert found == {
            "size": 2, "min": 10.0, "max": 11.0, "rank0": [0.0, 5.0], "average": [1.5] * 3,
        }  # fmt: skip


class _ThreeLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x, use_b: bool):
        x = torch.tanh(self.a(x))
        if use_b:
            x = torch.tanh(self.b(x))
        return self.c(x).pow(2).mean()


_UNUSED_STEPS = 4


def _unused_on_rank(rank, rendezvous, out_dir) -> None:
    torch.set_num_threads(1)
    _join_group("gloo", rendezvous, rank)
    try:
        torch.manual_seed(0)
        model = _ThreeLayers()
        data = torch.randn(_UNUSED_STEPS, WORLD, 8, generator=torch.Generator().manual_seed(1))
        options = {"lr": 1e-2, "weight_decay": 0.0, "max_grad_norm": 1.0, "bucket_size": 72}
        with SuperOffloadOptimizer(model.parameters(), gpu_tail=0, model=model, **options) as opt:
            for step in range(_UNUSED_STEPS):
                model(data[step, rank], use_b=rank == 0).backward()  # rank 1 never uses b
                opt.step()
                opt.zero_grad()
            opt.synchronize()
            torch.save({n: p.detach().clone() for n, p in model.named_parameters()},
                       out_dir / f"unused{rank}.pt")  # fmt: skip
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_param_unused_on_one_rank_keeps_the_ranks_in_step(tmp_path):
    """Rank 1's batch skips layer b: its bucket completes only at step() there, so the launch
    order (and with it the collectives) would differ without the in-order rule."""
    spawn_ranks(_unused_on_rank, (str(tmp_path / "rendezvous"), tmp_path), WORLD)
    ranks = [torch.load(tmp_path / f"unused{r}.pt") for r in range(WORLD)]
    torch.manual_seed(0)
    model = _ThreeLayers()
    data = torch.randn(_UNUSED_STEPS, WORLD, 8, generator=torch.Generator().manual_seed(1))
    reference = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for step in range(_UNUSED_STEPS):
        loss = sum(model(data[step, r], use_b=r == 0) for r in range(WORLD)) / WORLD
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        reference.step()
        reference.zero_grad()
    for name, param in model.named_parameters():
        assert torch.equal(ranks[0][name], ranks[1][name]), name
        torch.testing.assert_close(ranks[0][name], param.detach(), rtol=1e-5, atol=1e-6)


class _SharedInCheckpoints(torch.nn.Module):
    """One weight in two reentrant-checkpointed segments: its gradient hook fires twice in one
    backward, the second time after the rest of its bucket is in."""

    def __init__(self):
        super().__init__()
        self.inp, self.shared, self.head = (torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        x = torch.tanh(self.inp(x))  # the checkpointed segments' input needs a gradient
        for _ in range(2):
            x = torch.utils.checkpoint.checkpoint(self._block, x, use_reentrant=True)
        return self.head(x).pow(2).mean()

    def _block(self, x):
        return x + torch.tanh(self.shared(x))


_LEARNING_STEPS = 4


def _learning_on_rank(rank, rendezvous, out_dir, passes) -> None:
    torch.set_num_threads(1)
    _join_group("gloo", rendezvous, rank)
    try:
        torch.manual_seed(0)
        model = _SharedInCheckpoints()
        data = _learning_data(passes)
        options = {"lr": 1e-2, "weight_decay": 0.0, "max_grad_norm": 0.5, "bucket_size": 150}
        with SuperOffloadOptimizer(model.parameters(), gpu_tail=0, model=model, **options) as opt:
            fired = []
            model.shared.weight.register_post_accumulate_grad_hook(lambda p: fired.append(1))
            for step in range(_LEARNING_STEPS):
                for micro in range(passes):  # undeclared accumulation when passes > 1
                    (model(data[step, micro, rank]) / passes).backward()
                opt.step()
                opt.zero_grad()
            opt.synchronize()
            found = {n: p.detach().clone() for n, p in model.named_parameters()}
            record = {"params": found, "stats": opt.stats, "fired": len(fired)}
            torch.save(record, out_dir / f"learning{rank}.pt")
    finally:
        dist.destroy_process_group()


def _learning_data(passes: int) -> torch.Tensor:
    shape = (_LEARNING_STEPS, passes, WORLD, 2, 8)
    return torch.randn(shape, generator=torch.Generator().manual_seed(2))


@pytest.mark.slow
@pytest.mark.parametrize("passes", [1, 2], ids=["hook-fires-twice", "and-undeclared-accumulation"])
def test_replicas_learn_extra_arrivals_in_their_first_step(tmp_path, passes):
    """A hook firing twice in one backward (and a second backward nobody declared) cannot
    reopen a bucket already averaged with the other ranks: replicas launch every bucket at
    step() in their first step, count the arrivals, and from then on launch each bucket after
    its last one. The ranks stay identical and follow AdamW + clip_grad_norm_ on the whole
    batch, with no rollback."""
    spawn_ranks(_learning_on_rank, (str(tmp_path / "rendezvous"), tmp_path, passes), WORLD)
    ranks = [torch.load(tmp_path / f"learning{r}.pt") for r in range(WORLD)]
    torch.manual_seed(0)
    model = _SharedInCheckpoints()
    data = _learning_data(passes)
    reference = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for step in range(_LEARNING_STEPS):
        for micro in range(passes):
            sum(model(data[step, micro, r]) for r in range(WORLD)).div(WORLD * passes).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        reference.step()
        reference.zero_grad()
    for name, param in model.named_parameters():
        assert torch.equal(ranks[0]["params"][name], ranks[1]["params"][name]), name
        torch.testing.assert_close(ranks[0]["params"][name], param.detach(), rtol=1e-5, atol=1e-6)
    assert ranks[0]["fired"] == 2 * passes * _LEARNING_STEPS  # the case at hand
    assert ranks[0]["stats"]["rollbacks_accumulation"] == 0
