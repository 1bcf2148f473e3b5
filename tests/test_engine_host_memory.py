"""PinnedBuffers' bookkeeping with the CUDA runtime stubbed (CI has no GPU): page-aligned
spans of whole pages, exact sizes, no shared page, unpinning exactly what was pinned. The real
registration runs in tests/test_engine_gpu.py."""

from __future__ import annotations

import gc
import os

import pytest
import torch
from cgroup_files import write_host

from hf_superoffload.engine import host_memory
from hf_superoffload.engine.grad_slots import GRAD_SLOTS
from hf_superoffload.engine.host_memory import PAGE, PinnedBuffers


class FakeCudart:
    def __init__(self):
        self.registered: dict[int, int] = {}  # ptr -> bytes
        self.fail_unregister: set[int] = set()  # ptrs whose unregister reports an error

    def cudaHostRegister(self, ptr, size, flags):
        assert flags == 0 and ptr % PAGE == 0 and size % PAGE == 0
        for other, other_size in self.registered.items():
            assert ptr + size <= other or other + other_size <= ptr, "overlapping ranges"
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr):
        if ptr in self.fail_unregister:
            return 1
        del self.registered[ptr]
        return 0


def _check_error(code):
    if code != 0:
        raise RuntimeError(f"CUDA error {code}")


@pytest.fixture
def cudart(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(host_memory.torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(host_memory.torch.cuda, "check_error", _check_error)
    return fake


@pytest.mark.parametrize("numel", [1, 7, PAGE // 4, PAGE // 4 + 1, 3 * PAGE + 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_buffers_have_the_asked_size_on_whole_registered_pages(cudart, numel, dtype):
    buffers = PinnedBuffers()
    tensor = buffers.empty(numel, dtype)
    assert tensor.dtype == dtype and tensor.numel() == numel and tensor.is_contiguous()
    assert tensor.data_ptr() in cudart.registered
    span = cudart.registered[tensor.data_ptr()]
    assert numel * dtype.itemsize <= span < numel * dtype.itemsize + PAGE
    assert buffers.nbytes == span
    tensor.fill_(3)  # the memory is usable
    assert torch.equal(tensor, torch.full((numel,), 3, dtype=dtype))


def test_release_unpins_that_buffer_only_and_release_all_the_rest(cudart):
    buffers = PinnedBuffers()
    a, b, c = (buffers.empty(1000, torch.float32) for _ in range(3))
    assert len(cudart.registered) == 3  # the FakeCudart also checked they never overlap
    buffers.release(b)
    buffers.release(None)
    assert set(cudart.registered) == {a.data_ptr(), c.data_ptr()}
    assert buffers.nbytes == 2 * PAGE
    with pytest.raises(ValueError, match="did not hand out"):
        buffers.release(torch.empty(10))
    buffers.release_all()
    assert cudart.registered == {} and buffers.nbytes == 0


def test_empty_buffers_are_not_registered_and_release_ignores_them(cudart):
    buffers = PinnedBuffers()
    empty = buffers.empty(0, torch.float32)
    assert empty.numel() == 0 and cudart.registered == {}
    buffers.release(empty)
    assert buffers.nbytes == 0


def test_buffers_still_held_are_unpinned_when_their_owner_is_collected(cudart):
    buffers = PinnedBuffers()
    kept = [buffers.empty(100, torch.float32) for _ in range(3)]
    assert len(cudart.registered) == 3
    del buffers  # e.g. an optimizer whose construction failed half-way
    gc.collect()
    assert cudart.registered == {}
    kept[0].fill_(1)  # the memory itself lives on with its last reference


def test_one_failed_unregister_does_not_stop_the_others(cudart):
    buffers = PinnedBuffers()
    held = [buffers.empty(100, torch.float32) for _ in range(3)]
    cudart.fail_unregister.add(held[1].data_ptr())
    with pytest.raises(RuntimeError, match="CUDA error 1"):
        buffers.release_all()
    assert set(cudart.registered) == {held[1].data_ptr()}  # only the failed one
    assert buffers.nbytes == 0  # and nothing is left to retry on a dead context


# --- refusing a host state that cannot fit ------------------------------------------------------


GiB = 2**30


@pytest.fixture
def host_files(tmp_path, monkeypatch):
    """/proc/meminfo, and a cgroup v2 or v1 mount whose root is this process's cgroup (as a
    container with its own cgroup namespace sees it), as files of the test's."""

    def write(mem_available_kib: int, cgroup_v2=None, cgroup_v1=None):
        version, limit = (1, cgroup_v1) if cgroup_v1 is not None else (2, cgroup_v2)
        limits = {} if limit is None else {"": limit}
        write_host(
            tmp_path / str(len(list(tmp_path.iterdir()))),
            monkeypatch,
            mem_available_kib * 1024,
            version=version,
            limits=limits,
        )

    return write


def test_available_is_memavailable_without_a_container_limit(host_files):
    host_files(64 * 2**20)
    assert host_memory.host_bytes_available() == 64 * GiB
    host_files(64 * 2**20, cgroup_v2=("max", 5 * GiB))
    assert host_memory.host_bytes_available() == 64 * GiB
    host_files(64 * 2**20, cgroup_v1=(2**63 - 4096, 5 * GiB))  # v1's "no limit"
    assert host_memory.host_bytes_available() == 64 * GiB


def test_a_container_limit_caps_what_is_available(host_files):
    host_files(64 * 2**20, cgroup_v2=(16 * GiB, 10 * GiB))
    assert host_memory.host_bytes_available() == 6 * GiB
    host_files(64 * 2**20, cgroup_v1=(16 * GiB, 4 * GiB))
    assert host_memory.host_bytes_available() == 12 * GiB
    host_files(64 * 2**20, cgroup_v2=(16 * GiB, 20 * GiB))  # over the limit already
    assert host_memory.host_bytes_available() == 0


def test_the_user_may_give_the_host_memory_where_memavailable_undercounts(host_files, monkeypatch):
    host_files(31 * 2**20, cgroup_v2=(16 * GiB, 10 * GiB))
    monkeypatch.setenv(host_memory.HOST_MEMORY_ENV, "240")
    assert host_memory.host_bytes_available() == 240 * GiB
    for bad in ("-1", "0", "lots"):
        monkeypatch.setenv(host_memory.HOST_MEMORY_ENV, bad)
        with pytest.raises(ValueError, match="a number above 0"):
            host_memory.host_bytes_available()


def test_the_other_ranks_of_the_host_count(monkeypatch):
    """10 GiB per rank fits 40 GiB for 1..4 ranks of the host, and is refused for 5, naming
    the bytes needed and available and what to change."""
    monkeypatch.setattr(host_memory, "host_memory_available", lambda: (40 * GiB, "a figure"))
    parts = {"master": 4 * GiB, "moments": 6 * GiB, "param_copy_out": 0}
    for ranks in (1, 4):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
        host_memory.check_host_memory(parts, "change something")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "5")
    with pytest.raises(host_memory.HostMemoryError) as err:
        host_memory.check_host_memory(parts, host_memory.STANDALONE_REMEDIES)
    assert str(err.value).startswith(
        "the optimizer's host state needs 10.00 GiB per rank (master 4.00, moments 6.00 GiB) x 5 "
        "rank(s) on this host (LOCAL_WORLD_SIZE) = 50.00 GiB of host memory (pinned and "
        "pageable), but only 40.00 GiB is available"
    )
    assert "fewer GPUs per host" in str(err.value) and "gpu_tail" in str(err.value)
    assert isinstance(err.value, MemoryError)


@pytest.mark.parametrize(
    ("dtype", "grads_on_device", "params_on_device", "accumulating", "per_element", "ring"),
    [
        (torch.float32, True, True, False, 16, False),  # master, moments, fp32 gradients
        (torch.bfloat16, False, False, False, 14, True),  # bf16 gradients, copy-out ring
        (torch.bfloat16, True, True, False, 16, False),  # fp32 gradients, the master crosses
        (torch.bfloat16, True, False, True, 20, True),  # fp32 gradients, ring, fp32 sum
    ],
)
def test_standalone_host_parts_follow_the_bucket_layout(
    dtype, grads_on_device, params_on_device, accumulating, per_element, ring
):
    from hf_superoffload.engine.cast_policy import CastPlan
    from hf_superoffload.engine.copy_out import COPY_OUT_PIECE, COPY_OUT_SLOTS

    cast = CastPlan(grads_on_device, params_on_device, "test")
    n = 4 * COPY_OUT_PIECE  # a model larger than the ring's buffers
    parts = host_memory.standalone_host_parts(n, dtype, cast, accumulating)
    assert parts["master"] == 4 * n and parts["moments"] == 8 * n
    # The rounded params go through one shared ring of a few pieces, not 2 B/param.
    assert parts["param_copy_out"] == (COPY_OUT_SLOTS * COPY_OUT_PIECE * 2 if ring else 0)
    assert sum(parts.values()) - parts["param_copy_out"] == per_element * n


def test_zero3_host_parts_follow_the_optimizers_sub_groups_and_count_a_resume():
    from hf_superoffload.zero3.host_check import zero3_host_parts, zero3_sub_groups
    from hf_superoffload.zero3.memory_plan import resume_extra_host_bytes, start_up_host_bytes

    def param(numel, trainable=True):
        return torch.nn.Parameter(torch.zeros(numel, dtype=torch.bfloat16), trainable)

    big, b, c, norm1, d, norm2 = (param(n) for n in (6000, 1000, 1000, 50, 1000, 50))
    frozen = param(500, trainable=False)
    optimizer = torch.optim.AdamW([{"params": [big, b, c, norm1]}, {"params": [d, norm2, frozen]}])
    kwargs = {
        "offload_ratio": 0.5,
        "gradient_accumulation_dtype": torch.bfloat16,
        "sub_group_size": 2500,
        "param_persistence_threshold": 100,  # the norms persist: sub groups of their own
        "gradient_accumulation_steps": 2,
    }
    # Sub groups (one process: each holds its params whole): [big], [b, c], [norm1] of the
    # first group, [d], [norm2] of the second; ratio 0.5 keeps int(0.5 * 5) = 2 on the
    # device, 8000 of the 9100 elements (an element share would have left 4550 on the host).
    parts = zero3_host_parts(optimizer, kwargs)
    assert parts["master"] == 4 * 1100 and parts["moments"] == 8 * 1100
    assert parts["gradients"] == 2 * 1100 and parts["accumulation"] == 2 * 9100
    assert parts["param_copy_out"] == 3 * 1000 * 2  # three slots of the largest host sub group
    # A resume reads the whole partition's masters and moments beside the live state.
    split = zero3_sub_groups(optimizer, kwargs)
    assert split.numels == (6000, 2000, 50, 1000, 50) and split.device_count == 2
    assert parts["resume_beyond_training"] == resume_extra_host_bytes(split) > 0
    assert parts["start_up_beyond_training"] == 0
    # Compact moments: a code a moment an element, a scale pair a block of each param's
    # partition (norm1 1, d 4, norm2 1 blocks), the copy-out ring in bf16 too, and a resume
    # reads about half of what fp32 moments need.
    compact = zero3_host_parts(optimizer, kwargs, compact=True)
    assert compact["moments"] == 2 * 1100 + 8 * (1 + 4 + 1)
    assert compact["master"] == parts["master"] and compact["param_copy_out"] == 3 * 1000 * 2
    # And GRAD_SLOTS bf16 gradient slots of the largest host sub group (grad_slots.py).
    assert compact["grad_slots"] == GRAD_SLOTS * 1000 * 2 and parts["grad_slots"] == 0
    assert zero3_sub_groups(optimizer, kwargs, compact=True).blocks == (24, 8, 1, 4, 1)
    compact_split = zero3_sub_groups(optimizer, kwargs, compact=True)
    assert (
        0
        < resume_extra_host_bytes(compact_split, compact=True)
        < 0.51 * resume_extra_host_bytes(split)
    )
    # All on the device: nothing while training, and the larger of building the optimizer
    # (DeepSpeed's fp32 masters of the partition, and its accumulation buffer if micro-batches
    # accumulate) and a resume.
    kwargs.update(offload_ratio=0.0)
    resume = resume_extra_host_bytes(zero3_sub_groups(optimizer, kwargs))
    # A config whose script accumulates by hand (managed_gradient_accumulation false) counts
    # as accumulating, as the optimizer then makes the buffer.
    by_hand = {"managed_gradient_accumulation": False}
    for steps, config, start_up in ((2, {}, 6 * 9100), (1, {}, 4 * 9100), (1, by_hand, 6 * 9100)):
        kwargs.update(gradient_accumulation_steps=steps)
        parts = zero3_host_parts(optimizer, kwargs, ds_config=config)
        accumulating = start_up == 6 * 9100
        assert parts["master"] == 0 and parts["accumulation"] == (2 * 9100 if accumulating else 0)
        assert start_up_host_bytes(9100, 2, accumulating) == start_up
        training = parts["accumulation"]  # the only training part with all on the device
        assert sum(parts.values()) == training + max(start_up - training, resume)


def _count_ranks(rank: int, rendezvous: str, out_dir: str) -> None:
    import datetime
    import json
    import time

    import torch.distributed as dist

    from hf_superoffload.engine import checks, host_memory, replicas

    for name in host_memory.LAUNCHER_LOCAL_SIZES:  # as under `deepspeed` or mpirun: no count
        os.environ.pop(name, None)
    os.environ[host_memory.HOST_MEMORY_ENV] = "10"
    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    outcome = {"ranks": host_memory.ranks_on_this_host(), "cores": checks.cores_of_this_rank()}
    try:  # 6 GiB a rank fits the host's 10 for one rank, not for two
        host_memory.check_host_memory({"master": 6 * GiB}, "change something")
    except host_memory.HostMemoryError as error:
        outcome["refused"] = str(error)
    # A peer that failed and said so ends the wait for its host name at once.
    host_memory.HOST_KEY = "test/again/rank{}"
    if rank == 1:
        replicas.publish_failure(RuntimeError("injected before the count"))
        time.sleep(1)  # alive a while, never writing its host name (the store keeps its error)
    else:
        start = time.monotonic()
        try:
            host_memory.ranks_on_this_host()
        except replicas.PeerRankError as error:
            outcome.update(peer=str(error), seconds=time.monotonic() - start)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(outcome, f)


@pytest.mark.slow
def test_ranks_per_host_are_counted_whatever_the_launcher(tmp_path):
    """Two gloo ranks with no launcher count in the environment (LOCAL_WORLD_SIZE unset, as
    under ``deepspeed train.py`` or mpirun): each counts two ranks on its host, sizes the host
    check for both and shares the cores with the other."""
    import json

    from ranks import spawn_ranks

    spawn_ranks(_count_ranks, (str(tmp_path / "rendezvous"), str(tmp_path)), 2, timeout=120)
    outcomes = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    cores = len(os.sched_getaffinity(0))
    for outcome in outcomes:
        assert outcome["ranks"] == 2 and outcome["cores"] == max(1, cores // 2), outcome
        assert "x 2 rank(s) on this host (host names over torch.distributed)" in outcome["refused"]
    assert "rank 1 failed with RuntimeError: injected before the count" in outcomes[0]["peer"]
    assert outcomes[0]["seconds"] < 5


def test_before_torch_distributed_the_launchers_count_is_read(monkeypatch):
    for name in host_memory.LAUNCHER_LOCAL_SIZES:
        monkeypatch.delenv(name, raising=False)
    assert host_memory.ranks_on_this_host() == 1
    monkeypatch.setenv("LOCAL_SIZE", "3")  # the deepspeed launcher's
    assert host_memory.ranks_on_this_host() == 3
    monkeypatch.delenv("LOCAL_SIZE")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")  # Open MPI's
    assert host_memory.ranks_on_this_host() == 4


def test_the_host_check_counts_every_bucket_auto_may_give_back():
    """On a GPU an integer gpu_tail keeps its buckets there: the host holds the others. With
    "auto" any tail bucket may move to the host later, so the check counts them all."""
    from hf_superoffload.engine.buckets import plan_buckets
    from hf_superoffload.engine.layout import host_held_plans

    params = [torch.nn.Parameter(torch.zeros(64)) for _ in range(4)]
    plans = plan_buckets([{"params": params}], 64, None)
    assert len(plans) == 4
    assert [p.index for p in host_held_plans(plans, 2, 2, is_cuda=True)] == [0, 1]
    assert [p.index for p in host_held_plans(plans, 2, "auto", is_cuda=True)] == [0, 1, 2, 3]
    assert [p.index for p in host_held_plans(plans, 2, 2, is_cuda=False)] == [0, 1, 2, 3]


# --- HF_SUPEROFFLOAD_HOST_MEMORY_GIB: the job's whole figure, taken by every check in turn -------


@pytest.fixture
def own_claims(monkeypatch):
    """This test's claims only (other tests' optimizers may still be alive), one rank."""
    monkeypatch.setattr(host_memory, "_GRANTED", {})
    for name in host_memory.LAUNCHER_LOCAL_SIZES:
        monkeypatch.delenv(name, raising=False)


class Holder:
    """Stands for the objects that hold what a check granted."""


def test_under_the_override_a_check_counts_what_earlier_checks_granted_and_is_held(
    own_claims, monkeypatch
):
    """10 GiB for the job: 6 granted and held leave 4, so 5 more are refused (each alone
    would fit), 4 fit; once the holder goes, all 10 are there again."""
    monkeypatch.setenv(host_memory.HOST_MEMORY_ENV, "10")
    holder = Holder()
    host_memory.check_host_memory({"frozen_fp32_values": 6 * GiB}, "x").held_by(holder)
    with pytest.raises(host_memory.HostMemoryError) as err:
        host_memory.check_host_memory({"master": 5 * GiB}, "change something")
    assert (
        "x 1 rank(s) on this host (no launcher count, torch.distributed not initialized) = 5.00 "
        "GiB of host memory (pinned and pageable), but only 4.00 GiB is available "
        "(HF_SUPEROFFLOAD_HOST_MEMORY_GIB=10 less 6.00 GiB per rank x 1 rank(s) that this "
        "job's earlier host checks granted and it still holds: frozen_fp32_values 6.00 GiB)"
    ) in str(err.value)
    assert f"raise {host_memory.HOST_MEMORY_ENV} only if" in str(err.value)
    host_memory.check_host_memory({"master": 4 * GiB}, "x")  # 6 + 4: all of it
    del holder
    gc.collect()
    host_memory.check_host_memory({"master": 10 * GiB}, "x")


def test_a_claim_lasts_while_its_caller_or_any_of_its_holders_keeps_it(own_claims, monkeypatch):
    """Before it is bound, the caller's reference keeps it (an allocation that fails half-way
    drops it); a part taken out is held by its own holders; every rank of the host holds its
    own."""
    monkeypatch.setenv(host_memory.HOST_MEMORY_ENV, "10")
    pending = host_memory.check_host_memory({"master": 6 * GiB, "param_copy_out": 2 * GiB}, "x")
    with pytest.raises(host_memory.HostMemoryError):
        host_memory.check_host_memory({"master": 3 * GiB}, "x")
    buckets, ring = Holder(), Holder()
    pending.take("param_copy_out").held_by(ring)
    pending.held_by(buckets, None)
    del pending
    assert host_memory.held_host_parts() == {"master": 6 * GiB, "param_copy_out": 2 * GiB}
    del ring
    gc.collect()
    assert host_memory.held_host_parts() == {"master": 6 * GiB}
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # 2 x (6 held + 1) = 14 > 10
    with pytest.raises(host_memory.HostMemoryError, match=r"less 6.00 GiB per rank x 2 rank"):
        host_memory.check_host_memory({"master": 1 * GiB}, "x")
    del buckets
    gc.collect()
    assert host_memory.held_host_parts() == {}
    host_memory.check_host_memory({"master": 5 * GiB}, "x")  # 2 x 5: all of it


def test_without_the_override_memavailable_already_shows_what_was_taken(
    own_claims, host_files, monkeypatch
):
    monkeypatch.delenv(host_memory.HOST_MEMORY_ENV, raising=False)
    host_files(10 * 2**20)  # 10 GiB available after the first allocation
    holder = Holder()
    host_memory.check_host_memory({"master": 6 * GiB}, "x").held_by(holder)
    host_memory.check_host_memory({"master": 10 * GiB}, "x")  # not counted twice


def _spied_checks(monkeypatch, *modules) -> list[dict[str, int]]:
    """The parts of every host check the ``modules`` make, in order."""
    seen = []
    real = host_memory.check_host_memory

    def spy(parts, remedies):
        seen.append(dict(parts))
        return real(parts, remedies)

    for module in modules:
        monkeypatch.setattr(module, "check_host_memory", spy)
    return seen


def test_a_second_optimizer_is_refused_before_it_allocates_while_the_first_holds_its_state(
    own_claims, monkeypatch
):
    """Two optimizers of one process under a figure that holds either but not both: the
    second is refused before its params are re-pointed into any buffer; under a figure that
    holds both it steps as torch.optim.AdamW does."""
    from hf_superoffload import SuperOffloadOptimizer
    from hf_superoffload.engine import layout

    monkeypatch.delenv(host_memory.HOST_MEMORY_ENV, raising=False)
    seen = _spied_checks(monkeypatch, layout)

    def linear():
        torch.manual_seed(0)
        return torch.nn.Linear(32, 16)

    first = SuperOffloadOptimizer(linear().parameters(), lr=1e-2, gpu_tail=0)
    state = sum(seen[0].values())
    monkeypatch.setenv(host_memory.HOST_MEMORY_ENV, str((2 * state - 1) / GiB))
    refused = linear()
    storages = [p.data_ptr() for p in refused.parameters()]
    with pytest.raises(host_memory.HostMemoryError, match="earlier host checks granted"):
        SuperOffloadOptimizer(refused.parameters(), lr=1e-2, gpu_tail=0)
    assert [p.data_ptr() for p in refused.parameters()] == storages  # nothing laid out

    monkeypatch.setenv(host_memory.HOST_MEMORY_ENV, str(2 * state / GiB))
    net, reference = linear(), linear()
    second = SuperOffloadOptimizer(net.parameters(), lr=1e-2, gpu_tail=0)
    adamw = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    x = torch.randn(4, 32)
    for model in (net, reference):
        model(x).square().sum().backward()
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)  # the engine's default
    assert norm > 1.0  # it clips
    second.step()
    second.synchronize()
    adamw.step()
    for p, q in zip(net.parameters(), reference.parameters(), strict=True):
        state_of = second.master_state(p)
        torch.testing.assert_close(p.detach(), q.detach())
        torch.testing.assert_close(state_of["exp_avg"], adamw.state[q]["exp_avg"])
        torch.testing.assert_close(state_of["exp_avg_sq"], adamw.state[q]["exp_avg_sq"])
    first.close()
    second.close()


def test_a_zero3_state_stays_claimed_while_its_optimizers_replicas_live(own_claims, monkeypatch):
    """Its training and resume parts, while the optimizer's Replicas lives; start-up's extra
    (DeepSpeed's masters of the whole partition, gone once it is built) not after the check."""
    from hf_superoffload.engine.replicas import Replicas
    from hf_superoffload.zero3.host_check import check_zero3_host_memory, zero3_host_parts

    params = [torch.nn.Parameter(torch.zeros(4096, dtype=torch.bfloat16)) for _ in range(8)]
    base = torch.optim.AdamW(params)

    def check(replicas, ratio):
        kwargs = {
            "offload_ratio": ratio,
            "sub_group_size": 4096,
            "gradient_accumulation_dtype": torch.bfloat16,
        }
        check_zero3_host_memory(base, kwargs, replicas, False, {}, "cpu", "cpu")
        return zero3_host_parts(base, kwargs, ds_config={}, cast="cpu", device_type="cpu")

    first = Replicas(None, torch.device("cpu"))
    parts = check(first, 1.0)
    state = sum(parts.values())
    assert host_memory.held_host_parts() == {k: v for k, v in parts.items() if v}
    monkeypatch.setenv(host_memory.HOST_MEMORY_ENV, str((2 * state - 1) / GiB))
    with pytest.raises(host_memory.HostMemoryError, match="earlier host checks granted"):
        check(Replicas(None, torch.device("cpu")), 1.0)
    del first
    gc.collect()
    assert host_memory.held_host_parts() == {}
    all_on_the_device = Replicas(None, torch.device("cpu"))
    parts = check(all_on_the_device, 0.0)
    assert (
        parts["start_up_beyond_training"] > 0
        and sum(parts.values()) == parts["start_up_beyond_training"]
    )
    assert host_memory.held_host_parts() == {}
