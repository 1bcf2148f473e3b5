"""Compact moments on DeepSpeed ZeRO-3 (``HF_SUPEROFFLOAD_MOMENTS=compact``) against DeepSpeed
ZeRO-3 with plain CPU offload stepping the same partitions with the plain-PyTorch compact
update (``FlatCompactAdamW`` below): every rank's fp32 master partitions, both moments' codes
and block scales, to the bit, through clipping, a NaN step, accumulation, two param groups, an
LR schedule and two ranks, on the host and with sub groups on the "device" (``ratio``). Run
on a GPU machine, the same tests check the speculative passes the GPU runs there.
"""

from __future__ import annotations

import os

import pytest
import torch
from ranks import spawn_ranks
from zero3_reference import Zero3Case, build_model, free_port, init_rank, make_engine, train

from hf_superoffload.engine.grad_slots import GRAD_SLOTS
from hf_superoffload.ops.compact_state import BLOCK, compact_adam_pass
from hf_superoffload.zero3.memory_plan import Zero3Run, zero3_memory_plan

STATE_KEYS = ("exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale")


class FlatCompactAdamW(torch.optim.Optimizer):
    """The compact update over DeepSpeed's flat fp32 partitions, as its plain CPU offload
    hands them over (one sub group's partition per step() call, its gradient already clipped),
    cut into the params' partitions (``set_layout``) as the engine cuts them: a block grid per
    param partition, salted with the param's place among the optimizer's params and the rank."""

    def __init__(self, params, lr, eps):
        super().__init__(params, dict(lr=lr, betas=(0.9, 0.999), eps=eps, weight_decay=0.0))
        ordered = [p for g in self.param_groups for p in g["params"]]
        self._ordinal = {id(p): n for n, p in enumerate(ordered)}
        self._layout: dict[int, list[tuple[int, int, int]]] = {}

    def set_layout(self, zero, world: int, rank: int) -> None:
        for i, flat in enumerate(zero.fp32_partitioned_groups_flat):
            spans = []
            for param in zero.fp16_groups[i]:
                _, offset, numel = zero.grad_position[zero.get_param_id(param)]
                spans.append((offset, numel, self._ordinal[id(param)] * world + rank))
            self._layout[id(flat)] = spans

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for flat in group["params"]:
                if flat.grad is None:
                    continue
                state = self.state[flat]
                if not state:
                    blocks = sum(-(-n // BLOCK) for _, n, _ in self._layout[id(flat)])
                    state["step"] = 0
                    for key in STATE_KEYS:
                        scale = key.endswith("scale")
                        state[key] = (
                            torch.zeros(blocks)
                            if scale
                            else torch.zeros(flat.numel(), dtype=torch.uint8)
                        )
                state["step"] += 1
                block = 0
                for offset, numel, salt in self._layout[id(flat)]:
                    blocks = slice(block, block + -(-numel // BLOCK))
                    compact_adam_pass(
                        flat.data.narrow(0, offset, numel), flat.grad.narrow(0, offset, numel),
                        state["exp_avg"].narrow(0, offset, numel), state["exp_avg_scale"][blocks],
                        state["exp_avg_sq"].narrow(0, offset, numel),
                        state["exp_avg_sq_scale"][blocks], step=state["step"], lr=group["lr"],
                        beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"],
                        weight_decay=group["weight_decay"], salt=salt,
                    )  # fmt: skip
                    block = blocks.stop


def _state(zero) -> list[dict]:
    """Per param (in ds_id order, the model's): its partition's master, codes and block scales,
    and its sub group's step (the engine and the reference cut sub groups differently)."""
    if hasattr(zero, "synchronize"):
        zero.synchronize()
    out = []
    for i, master in enumerate(zero.fp32_partitioned_groups_flat):
        state, first_block = zero.optimizer.state[master], 0
        for param in zero.fp16_groups[i]:
            _, offset, numel = zero.grad_position[zero.get_param_id(param)]
            blocks = slice(first_block, first_block + -(-numel // BLOCK))
            first_block = blocks.stop
            entry = {"param": param.ds_id, "step": int(state["step"])}
            entry["master"] = master.detach().narrow(0, offset, numel).cpu().clone()
            for key in STATE_KEYS:
                whole = state[key]
                part = whole[blocks] if key.endswith("scale") else whole.narrow(0, offset, numel)
                entry[key] = part.cpu().clone()
            out.append(entry)
    return sorted(out, key=lambda entry: entry["param"])


def _on_rank(rank, world, port, case, out_dir) -> None:
    init_rank(rank, world, port)
    torch.set_num_threads(1)
    import hf_superoffload  # noqa: F401  (activates the ZeRO-3 path)

    results = {}
    for name, super_offload in (("reference", False), ("superoffload", True)):
        os.environ["HF_SUPEROFFLOAD_MOMENTS"] = "compact"
        base = torch.optim.AdamW if super_offload else FlatCompactAdamW
        engine, optimizer = make_engine(case, super_offload, world, optimizer_class=base)
        if not super_offload:
            optimizer.optimizer.set_layout(optimizer, world, rank)
        record = train(engine, case, rank, range(case.steps))
        record["state"] = _state(optimizer)
        record["kind"] = type(optimizer).__name__
        if super_offload:
            record["stats"] = optimizer.stats
            record["host_bytes"] = optimizer.host_bytes()
            record["params"] = sum(p.ds_tensor.numel() for p in engine.module.parameters())
            record["largest_host_sub_group"] = max(p.numel for p in optimizer._host_parts)
            staging = optimizer._device_speculation
            record["staging_bytes"] = staging.nbytes if staging is not None else 0
        results[name] = record
        engine.destroy()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize(
    ("world", "ratio", "bf16", "grad_accum_dtype"),
    [
        (1, 1.0, False, None),
        (2, 1.0, False, None),
        (2, 0.5, False, None),
        (1, 1.0, True, None),
        (1, 1.0, True, "fp32"),
    ],
    ids=["one-rank", "two-ranks", "gpu-tail", "bf16", "bf16-fp32-gradients"],
)
def test_compact_moments_on_zero3_equal_the_flat_compact_reference(
    world, ratio, bf16, grad_accum_dtype, tmp_path
):
    if torch.cuda.is_available() and world > torch.cuda.device_count():
        pytest.skip(f"{world} ranks take a GPU each")
    # Thresholds inside each world's range of norms: one rank clips some steps in fp32 and
    # every step in bf16, two ranks clip some.
    clip = {1: 1.3, 2: 1.0}[world]
    case = Zero3Case(
        max_grad_norm=clip, accumulation=1 if bf16 else 2, nan_step=3, ratio=ratio, bf16=bf16,
        grad_accum_dtype=grad_accum_dtype,
    )  # fmt: skip
    spawn_ranks(_on_rank, (world, free_port(), case, str(tmp_path)), world)
    for rank in range(world):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        ref, ours = result["reference"], result["superoffload"]
        assert (ref["kind"], ours["kind"]) == (
            "DeepSpeedZeroOptimizer_Stage3", "SuperOffloadZero3Optimizer"
        )  # fmt: skip
        torch.testing.assert_close(
            torch.tensor(ours["losses"]), torch.tensor(ref["losses"]), rtol=0, atol=0,
            equal_nan=True,
        )  # fmt: skip
        # The global norm of every step too (not only of those that clip): combined from the
        # norms of DeepSpeed's sub groups, not of ours, it is DeepSpeed's to the bit.
        torch.testing.assert_close(
            torch.tensor(ours["norms"]), torch.tensor(ref["norms"]), rtol=0, atol=0,
            equal_nan=True,
        )  # fmt: skip
        assert len(ours["state"]) == len(ref["state"])
        for a, b in zip(ours["state"], ref["state"], strict=True):
            for key in ("master", *STATE_KEYS):
                assert torch.equal(a[key], b[key]), f"rank {rank} param {a['param']} {key}"
            assert a["step"] == b["step"] == case.steps - 1
        stats = ours["stats"]
        assert stats["rollbacks_nonfinite"] == 1 and stats["speculations_applied"] > 0
        assert (stats["gpu_tail_buckets"] > 0) == (ratio < 1.0)
        # With a GPU the speculative passes run there (device_speculation.py), and the
        # masters and codes above are still the reference's to the bit.
        cuda = torch.cuda.is_available()
        assert (stats["speculations_on_device"] > 0) == cuda
        assert stats["speculations_on_device"] <= stats["speculations_applied"]
        if bf16:  # 8 B/param and a scale pair a block; the plan counts the same bytes
            host, params = ours["host_bytes"], ours["params"]
            # The gradients in DeepSpeed's accumulation dtype: bf16's, or the config's fp32.
            grad_dtype = torch.float32 if grad_accum_dtype == "fp32" else torch.bfloat16
            assert host["master"] + host["gradients"] == (4 + grad_dtype.itemsize) * params
            run = Zero3Run(
                seq=8, batch=case.micro_batch, sub_group_size=case.sub_group_size,
                compact_moments=True, grad_accum_dtype=grad_accum_dtype,
            )  # fmt: skip
            plan = zero3_memory_plan(build_model().config, run)
            for key in ("master", "gradients", "moments", "accumulation"):
                assert plan.host[key] == host[key], key
            assert 2 * params < host["moments"] < 2.1 * params
            assert plan.host["param_copy_out"] >= host["param_copy_out"] > 0
            # GRAD_SLOTS gradient slots of the largest host sub group (grad_slots.py).
            slot = grad_dtype.itemsize * ours["largest_host_sub_group"]
            assert host["grad_slots"] == GRAD_SLOTS * slot > 0
            assert plan.host["grad_slots"] >= host["grad_slots"]
            # The GPU staging of the speculative passes, in the gradients' dtype: planned as
            # allocated.
            if cuda:
                assert plan.gpu["compact_speculation"] == ours["staging_bytes"] > 0


def _resume_on_rank(rank, world, port, case, out_dir) -> None:
    os.environ["HF_SUPEROFFLOAD_MOMENTS"] = "compact"
    init_rank(rank, world, port)
    torch.set_num_threads(1)
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    import hf_superoffload  # noqa: F401
    from hf_superoffload.zero3.checkpoint_layout import CheckpointLayoutError

    half = case.steps // 2
    checkpoint = os.path.join(out_dir, "checkpoint")
    engine, optimizer = make_engine(case, True, world)
    train(engine, case, rank, range(half))
    engine.save_checkpoint(checkpoint, tag="half")
    masters = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    straight = train(engine, case, rank, range(half, case.steps))
    straight["state"] = _state(optimizer)
    engine.destroy()

    engine, optimizer = make_engine(case, True, world, model_seed=1)  # other initial weights
    engine.load_checkpoint(checkpoint, tag="half")
    resumed = train(engine, case, rank, range(half, case.steps))
    resumed["state"] = _state(optimizer)
    engine.destroy()

    os.environ["HF_SUPEROFFLOAD_MOMENTS"] = "fp32"  # compact codes do not load into fp32 moments
    engine, optimizer = make_engine(case, True, world, model_seed=1)
    before = optimizer.fp32_partitioned_groups_flat[0].clone()
    try:
        engine.load_checkpoint(checkpoint, tag="half")
        refused = ""
    except CheckpointLayoutError as error:
        refused = str(error)
    unchanged = torch.equal(before, optimizer.fp32_partitioned_groups_flat[0])
    engine.destroy()
    deepspeed.comm.barrier()
    consolidated = get_fp32_state_dict_from_zero_checkpoint(checkpoint, tag="half")
    torch.save(
        {"straight": straight, "resumed": resumed, "masters": masters, "fp32": consolidated,
         "refused": refused, "unchanged": unchanged},
        os.path.join(out_dir, f"rank{rank}.pt"),
    )  # fmt: skip


@pytest.mark.parametrize("ratio", [1.0, 0.5])
def test_compact_save_then_resume_is_bit_exact_and_zero_to_fp32_reads_the_masters(ratio, tmp_path):
    case = Zero3Case(max_grad_norm=1.0, nan_step=1, ratio=ratio)
    world = 2
    spawn_ranks(_resume_on_rank, (world, free_port(), case, str(tmp_path)), world)
    for rank in range(world):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        straight, resumed = result["straight"], result["resumed"]
        assert resumed["losses"] == straight["losses"], rank
        for a, b in zip(resumed["state"], straight["state"], strict=True):
            for key in ("master", *STATE_KEYS):
                assert torch.equal(a[key], b[key]), f"rank {rank} {key}"
        assert result["fp32"].keys() == result["masters"].keys()
        for name, master in result["masters"].items():
            assert torch.equal(result["fp32"][name], master), f"zero_to_fp32 differs at {name}"
        assert "HF_SUPEROFFLOAD_MOMENTS=compact" in result["refused"]
        assert result["unchanged"]


def test_the_trainers_moments_argument_reaches_the_zero3_optimizer(monkeypatch):
    """Under DeepSpeed the trainers hand ``superoffload_moments`` over through the environment
    the ZeRO-3 optimizer reads when DeepSpeed builds it."""
    from hf_superoffload.zero3.config import export_zero3_options
    from hf_superoffload.zero3.options import resolve_options

    monkeypatch.delenv("HF_SUPEROFFLOAD_MOMENTS", raising=False)
    assert not resolve_options(None, torch.device("cpu")).compact
    monkeypatch.setenv("HF_SUPEROFFLOAD_MOMENTS", "fp32")  # restored after the test
    export_zero3_options({"moments": "compact"})
    assert resolve_options(None, torch.device("cpu")).compact


def _fp32_into_compact_on_rank(rank, world, port, case, out_dir) -> None:
    init_rank(rank, world, port)
    torch.set_num_threads(1)
    import hf_superoffload  # noqa: F401

    checkpoint = os.path.join(out_dir, "checkpoint")
    os.environ["HF_SUPEROFFLOAD_MOMENTS"] = "fp32"
    engine, optimizer = make_engine(case, True, world)
    train(engine, case, rank, range(case.steps))
    engine.save_checkpoint(checkpoint, tag="fp32")
    saved = []
    for master in optimizer.fp32_partitioned_groups_flat:
        state = optimizer.optimizer.state[master]
        saved.append({k: t.detach().cpu().clone() for k, t in
                      (("master", master), ("exp_avg", state["exp_avg"]),
                       ("exp_avg_sq", state["exp_avg_sq"]))})  # fmt: skip
    engine.destroy()
    os.environ["HF_SUPEROFFLOAD_MOMENTS"] = "compact"
    engine, optimizer = make_engine(case, True, world, model_seed=1)
    engine.load_checkpoint(checkpoint, tag="fp32")
    loaded = []
    for i, master in enumerate(optimizer.fp32_partitioned_groups_flat):
        part = optimizer._host_part_at[i]
        decoded = [torch.zeros(part.numel), torch.zeros(part.numel)]
        for index, segment in enumerate(part.compact.segments):
            span = slice(segment.offset, segment.offset + segment.numel)
            for moment, values in zip(decoded, part.compact.decoded(index), strict=True):
                moment[span] = values
        loaded.append({"master": master.detach().cpu().clone(), "exp_avg": decoded[0],
                       "exp_avg_sq": decoded[1], "step": int(part.step)})  # fmt: skip
    resumed = train(engine, case, rank, range(case.steps, case.steps + 2))
    engine.destroy()
    torch.save({"saved": saved, "loaded": loaded, "resumed": resumed},
               os.path.join(out_dir, f"rank{rank}.pt"))  # fmt: skip


def test_fp32_moments_of_a_checkpoint_load_into_compact_ones_encoded(tmp_path):
    """A ZeRO-3 checkpoint with fp32 moments resumes with compact ones: the masters as saved,
    each moment encoded to nearest (within a code's error of the fp32 value), and training
    goes on."""
    case = Zero3Case(max_grad_norm=1.0, steps=3, schedule=False)
    spawn_ranks(_fp32_into_compact_on_rank, (1, free_port(), case, str(tmp_path)), 1)
    result = torch.load(tmp_path / "rank0.pt", weights_only=False)
    for saved, loaded in zip(result["saved"], result["loaded"], strict=True):
        assert torch.equal(loaded["master"], saved["master"])
        assert loaded["step"] == case.steps
        for key, tiny in (("exp_avg", 2.0**-17), ("exp_avg_sq", 2.0**-33)):
            want, got = saved[key], loaded[key]
            block_max = want.abs().max()  # bounds each block's largest: the subnormal step
            assert ((got - want).abs() <= want.abs() / 16 + tiny * block_max).all(), key
            assert (got != 0).sum() > 0.9 * (want != 0).sum(), key
    assert all(torch.isfinite(torch.tensor(result["resumed"]["losses"])))


def _access_on_rank(rank, world, port, case, out_dir) -> None:
    os.environ["HF_SUPEROFFLOAD_MOMENTS"] = "compact"
    init_rank(rank, world, port)
    torch.set_num_threads(1)
    import time

    from deepspeed.utils import (
        safe_get_full_fp32_param,
        safe_get_full_optimizer_state,
        safe_set_full_optimizer_state,
    )

    import hf_superoffload  # noqa: F401
    from hf_superoffload.engine import compact_passes

    run = compact_passes.CompactPasses.run

    def slow_commit(self, part, hyper, scale, runs, grad, *, commit, send, seconds):
        if commit and not send:  # the commit pass the next forward does not wait for
            time.sleep(0.2)
        return run(self, part, hyper, scale, runs, grad, commit=commit, send=send, seconds=seconds)

    compact_passes.CompactPasses.run = slow_commit
    engine, optimizer = make_engine(case, True, world)
    train(engine, case, rank, range(case.steps))  # nothing clips: every step commits later
    param = next(engine.module.parameters())
    read_at_once = safe_get_full_fp32_param(param).clone()
    optimizer.synchronize()
    after_all = safe_get_full_fp32_param(param).clone()
    commits = optimizer.stats["commit_seconds"]
    # The moments read as fp32 values (decoded), and writing one is refused.
    moment = safe_get_full_optimizer_state(param, "exp_avg").clone()
    i, _, numel = optimizer.grad_position[optimizer.get_param_id(param)]
    index = next(n for n, p in enumerate(optimizer.fp16_groups[i]) if p is param)
    decoded = optimizer._host_part_at[i].compact.decoded(index)[0][:numel].view_as(moment)
    try:
        safe_set_full_optimizer_state(param, moment, "exp_avg")
        refused = ""
    except ValueError as error:
        refused = str(error)
    engine.destroy()
    torch.save({"at_once": read_at_once, "after": after_all, "commits": commits,
                "moment": moment, "decoded": decoded, "refused": refused},
               os.path.join(out_dir, f"rank{rank}.pt"))  # fmt: skip


def test_deepspeeds_accessors_read_a_compact_sub_group_after_its_commit(tmp_path):
    """safe_get_full_fp32_param right after a step reads the master its commit pass (still on
    the worker, which the next forward does not wait for) writes, not the one before it; the
    moments read as fp32 values, and writing one is refused."""
    case = Zero3Case(max_grad_norm=0.0, steps=2, schedule=False)
    spawn_ranks(_access_on_rank, (1, free_port(), case, str(tmp_path)), 1)
    result = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert result["commits"] > 0
    assert torch.equal(result["at_once"], result["after"])
    assert result["moment"].dtype == torch.float32 and torch.equal(
        result["moment"], result["decoded"]
    )
    assert "not supported with compact moments" in result["refused"]
