"""The host side of a ZeRO-3 step holds no memory beyond what the memory plan counts: the CPU
work of the step (the worker's tasks: speculation, the step after validation, a replay with
the clip coefficient, compact moments' fused and deferred writes) and ``step()`` itself create
no tensors that grow with a partition, with fp32 or compact moments, clipped or not. Counted
with TensorPeak in each thread on a one-rank CPU run whose largest partition (the LM head)
is 512K elements, where a partition-sized temporary would be a MiB or more.

On a GPU run that saves the model, the host memory rises and falls after training with each
5 GB shard of the streamed save: the plan's save figure (``save_memory``), not the steps.
"""

from __future__ import annotations

import os

import pytest
import torch
from ranks import spawn_ranks
from tensor_peak import TensorPeak
from zero3_reference import SEQ, Zero3Case, build_model, free_port, init_rank, make_engine

VOCAB, HIDDEN = 8192, 64  # an LM head of 512K elements beside sub groups of 20K
SCALARS = 1024  # bytes: the norms and clip coefficient of a step (measured: 98)


def _measured_peaks() -> dict[str, int]:
    """Wrap the worker's tasks and the optimizer's step() in TensorPeak (each in its own
    thread: a dispatch mode sees the ops of the thread that entered it); returns their
    largest peaks, updated as they run."""
    from hf_superoffload.engine.worker import Worker
    from hf_superoffload.zero3.optimizer import SuperOffloadZero3Optimizer

    peaks = {"worker": 0, "step": 0}
    submit, step = Worker.submit, SuperOffloadZero3Optimizer.step

    def measured_submit(self, keys, task):
        def run():
            with TensorPeak() as peak:
                task()
            peaks["worker"] = max(peaks["worker"], peak.peak)

        submit(self, keys, run)

    def measured_step(self, closure=None):
        with TensorPeak() as peak:
            result = step(self, closure)
        peaks["step"] = max(peaks["step"], peak.peak)
        return result

    Worker.submit = measured_submit
    SuperOffloadZero3Optimizer.step = measured_step
    return peaks


def _on_rank(rank, world, port, out_dir) -> None:
    init_rank(rank, world, port)
    torch.set_num_threads(1)
    import hf_superoffload  # noqa: F401  (activates the ZeRO-3 path)

    peaks = _measured_peaks()
    results = {}
    for moments in ("fp32", "compact"):
        for clip in (1e-3, 0.0):  # every step clipped (replays, steps after validation), none
            os.environ["HF_SUPEROFFLOAD_MOMENTS"] = moments
            peaks.update(worker=0, step=0)
            case = Zero3Case(max_grad_norm=clip, bf16=True, sub_group_size=20000, schedule=False)
            engine, optimizer = make_engine(
                case, True, world, model_builder=lambda seed: build_model(
                    seed, vocab_size=VOCAB, hidden_size=HIDDEN
                ),
            )  # fmt: skip
            for step in range(4):
                generator = torch.Generator().manual_seed(step)
                ids = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
                engine.backward(engine(input_ids=ids, labels=ids).loss)
                engine.step()
            optimizer.synchronize()
            result = {**peaks, "largest": max(p.numel for p in optimizer._host_parts)}
            # The wrapper sees what a task creates (4000 bytes here), on the worker's thread.
            peaks["worker"] = 0
            optimizer._stv.worker.submit([0], lambda: torch.ones(1000))
            optimizer.synchronize()
            result.update(control=peaks["worker"], stats=optimizer.stats)
            results[(moments, clip)] = result
            engine.destroy()
    torch.save(results, os.path.join(out_dir, "rank0.pt"))


@pytest.mark.filterwarnings("ignore")
def test_the_host_side_of_a_zero3_step_makes_no_partition_sized_temporaries(tmp_path):
    spawn_ranks(_on_rank, (1, free_port(), str(tmp_path)), 1)
    results = torch.load(tmp_path / "rank0.pt", weights_only=False)
    for (moments, clip), got in results.items():
        what = f"{moments} moments, clip {clip}"
        assert got["largest"] == VOCAB * HIDDEN, what  # the LM head: 2 MiB of fp32
        assert got["control"] == 4000, f"{what}: the worker's tasks are not measured"
        assert got["worker"] <= SCALARS, f"{what}: the worker's tasks made {got['worker']} bytes"
        assert got["step"] <= SCALARS, f"{what}: step() made {got['step']} bytes"
        stats = got["stats"]
        if clip:  # the paths the run exercised: every step after the first one clipped
            assert stats["rollbacks_clip"] + stats["speculations_withheld"] > 0, what
        elif moments == "compact":
            assert stats["commits_fused"] > 0, what  # the fused commit + speculation pass
