# Run (one system per process; the device machine: source dev/gpu_env.sh first):
#   python benchmarks/train_step.py --system superoffload --hidden 3072 --layers 28 --seq 4096
#   python benchmarks/train_step.py --system no_offload   --hidden 3072 --layers 28 --seq 4096
# On N GPUs (data parallel, --batch per GPU; rank 0 prints one row for all ranks):
#   torchrun --standalone --nproc_per_node 2 benchmarks/train_step.py --system superoffload_zero3
"""Seconds per optimizer step of a randomly initialised Llama-style model, one system a run
(the systems are in benchmarks/systems.py; benchmarks/suite.py runs several and compares).

Prints one JSON line with the median s/step after warm-up, tokens/s, model TFLOPS, MFU, peak
GPU memory, peak host RSS, the median seconds of each phase (forward, backward, optimizer step)
as the host saw its calls and as the GPU's compute stream spent them, and, for the
SuperOffload systems, the engine's stats; appends it to --jsonl.

Under torchrun each rank trains its own batch (data parallel: DDP for no_offload, replicas for
superoffload, ZeRO-3 partitions for the DeepSpeed systems). Rank 0 prints the row of the
slowest rank's s/step, with tokens/s of all GPUs together and per GPU, the largest GPU peak,
the host RSS summed over the ranks (they share the host), and each rank's own figures.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import logging
import os
import resource
import statistics
import sys
import time

import clip_rate
import torch
import torch.distributed as dist
import transformers
from clip_rate import ClipRate
from systems import SYSTEMS, run_environment

# hf_superoffload is imported in main(), after the system's environment is set: the import
# reads HF_SUPEROFFLOAD_DEEPSPEED to decide whose SuperOffload DeepSpeed builds.


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and batch flags every per-run script takes (``model_config`` reads them)."""
    parser.add_argument(
        "--model-config", default=None,
        help="a config.json (e.g. hf_superoffload/model_configs/llama-3.1-8b.json): that "
        "architecture with random weights, in place of --hidden/--layers/--inter/--vocab",
    )  # fmt: skip
    parser.add_argument("--hidden", type=int, default=3072)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--inter", type=int, default=0, help="0: 8/3 x hidden, rounded to 256")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)


def model_config(args) -> transformers.PretrainedConfig:
    """The architecture of ``--model-config`` (a config.json), else a Llama-style model of
    the size flags."""
    if args.model_config:
        with open(args.model_config) as handle:
            values = {k: v for k, v in json.load(handle).items() if not k.startswith("_")}
        return transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    return transformers.LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.inter or int(args.hidden * 8 / 3 / 256 + 0.999) * 256,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 128,
        num_key_value_heads=args.hidden // 128,
        vocab_size=args.vocab,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
    )


def count_params(config: transformers.PretrainedConfig) -> tuple[int, int]:
    """(all params, matmul params), from a meta-device copy: ZeRO-3 partitions the real
    params, whose numel then reads 0."""
    from hf_superoffload.integrations.metrics import matmul_params

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters()), matmul_params(model)


PHASES = ("forward", "backward", "optimizer_step")


def host_rss_gib() -> dict[str, float]:
    """This process's resident host memory now and at its peak so far (Linux)."""
    fields = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = round(int(value.split()[0]) / 2**20, 2)  # kB -> GiB
    return {"now": fields["VmRSS"], "peak": fields["VmHWM"]}


MAX_EXTRA_WARMUP = 40  # steps a still-tuning "auto" may add to the warm-up


def _tail_moves(system) -> int | None:
    """The standalone engine's bucket moves so far (gpu_tail='auto' or its cap)."""
    optimizer = getattr(system, "optimizer", None)
    stats = getattr(optimizer, "stats", None)
    return stats.get("tail_moves") if isinstance(stats, dict) else None


def progress(rank: int, began: float, what: str) -> None:
    """Rank 0's progress on stderr, as it happens: a run cut short (a large model's start-up,
    a time limit) still shows how far it got and at what pace."""
    if rank == 0:
        peak = torch.cuda.max_memory_allocated() / 2**30
        print(f"[{time.perf_counter() - began:7.1f} s] {what} (GPU peak {peak:.1f} GiB)",
              file=sys.stderr, flush=True)  # fmt: skip


def start_ranks() -> tuple[int, int]:
    """(rank, world) of this process; under torchrun, its GPU and the NCCL group (DeepSpeed's
    init_distributed then finds the group made)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    return dist.get_rank(), world


def planned(args, config, world: int) -> dict | None:
    """What ``hf-superoffload plan`` predicts per rank for the ZeRO-3 path at this point (GPU:
    allocated, as ``peak_gpu_gib``; host: the rank's resident memory), beside what was measured."""
    if args.system != "superoffload_zero3":
        return None
    from hf_superoffload.integrations.plugin import SuperOffloadOptions
    from hf_superoffload.zero3.memory_plan import Zero3Run, zero3_memory_plan

    # systems.py's DeepSpeed config: one param group, DeepSpeed's persistence threshold. The
    # cast is the one the ZeRO-3 optimizer resolved (HF_SUPEROFFLOAD_CAST, which main() sets
    # from --cast), so the copy-out ring is counted as made, not at its most.
    run = Zero3Run(
        seq=args.seq, batch=args.batch, ranks=world, ratio=args.ratio, decay_groups=False,
        persistence_threshold=100_000, cast=SuperOffloadOptions().cast,
    )  # fmt: skip
    plan = zero3_memory_plan(config, run)
    return {
        "gpu_gib": round(plan.gpu_bytes / 2**30, 2),
        "host_gib": round(plan.host_bytes_without_resume / 2**30, 2),  # it loads no checkpoint
    }


def across_ranks(row: dict, world: int) -> dict | None:
    """One row for all ranks (on rank 0; None elsewhere): a data-parallel step is as slow as
    its slowest rank."""
    if world == 1:
        return {**row, "world": 1, "tokens_per_s_per_gpu": row["tokens_per_s"]}
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if dist.get_rank() != 0:
        return None
    slowest = max(rows, key=lambda r: r["s_per_step"])
    tokens = row["batch"] * row["seq"] * world
    per_rank_keys = ("s_per_step", "peak_gpu_gib", "peak_host_rss_gib", "host_rss_gib")
    return {
        **slowest,
        "world": world,
        "tokens_per_s": round(tokens / slowest["s_per_step"], 1),
        "tokens_per_s_per_gpu": slowest["tokens_per_s"],
        "peak_gpu_gib": max(r["peak_gpu_gib"] for r in rows),
        "peak_host_rss_gib": round(sum(r["peak_host_rss_gib"] for r in rows), 2),
        "ranks": [{k: r[k] for k in per_rank_keys} for r in rows],
    }


def timed_phases(system, batch, loss_scale: float = 1.0) -> dict:
    """Run one step phase by phase. Host seconds of each call, and CUDA events on the
    compute stream between the phases (read after the step's synchronize: ``gpu`` fills in
    lazily), so that timing adds no synchronization of its own."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(len(PHASES) + 1)]
    marks = [time.perf_counter()]
    events[0].record()
    loss = system.forward(batch)
    if loss_scale != 1.0:
        loss = loss * loss_scale
    marks.append(time.perf_counter())
    events[1].record()
    system.backward(loss)
    marks.append(time.perf_counter())
    events[2].record()
    system.optimizer_step()
    marks.append(time.perf_counter())
    events[3].record()
    return {"host": [b - a for a, b in itertools.pairwise(marks)], "events": events}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--system", choices=sorted(SYSTEMS), required=True)
    add_model_arguments(parser)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--gpu-buckets", default="auto")
    parser.add_argument("--bucket-size", type=int, default=1 << 25)
    parser.add_argument(
        "--cast", default="auto",
        help="the SuperOffload systems' cast: 'auto', 'gpu' or 'cpu' (others have none)",
    )  # fmt: skip
    parser.add_argument("--gpu-memory-cap", type=float, default=None, help="GiB (superoffload)")
    parser.add_argument(
        "--ratio", type=float, default=1.0,
        help="DeepSpeed systems: offload_optimizer.ratio (share of sub groups on the host)",
    )  # fmt: skip
    clip_rate.add_arguments(parser)
    parser.add_argument("--jsonl", default=None)
    args = parser.parse_args()
    control = (
        ClipRate(args.clip_rate, args.clip, args.clip_first) if args.clip_rate is not None else None
    )
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    try:
        environment = run_environment(args.system, args.cast)
    except ValueError as refusal:
        sys.exit(str(refusal))
    early = [m for m in ("hf_superoffload", "deepspeed") if m in sys.modules]
    if environment and early:
        sys.exit(f"{early} imported before {args.system}'s environment {environment} was set")
    os.environ.update(environment)
    from hf_superoffload.integrations.metrics import model_flops_per_token, peak_tflops

    began = time.perf_counter()
    rank, world = start_ranks()
    torch.manual_seed(0)
    config = model_config(args)
    system = SYSTEMS[args.system](config, args)
    rss_after_init = host_rss_gib()
    progress(rank, began, f"built {args.system}, host RSS {rss_after_init['now']} GiB")
    n_params, n_matmul = count_params(config)
    if world > 1:
        torch.manual_seed(1000 + rank)  # each rank its own data
    batch = torch.randint(0, config.vocab_size, (args.batch, args.seq), device="cuda")
    times, phases = [], []
    warmup = args.warmup  # grows while gpu_tail='auto' is still moving buckets
    moves_before_timing = _tail_moves(system) if warmup == 0 else None
    step = 0
    while step < warmup + args.steps:
        if step == warmup and args.system == "superoffload" and system.still_tuning():
            if warmup >= args.warmup + MAX_EXTRA_WARMUP:
                sys.exit(
                    f"gpu_tail='auto' was still placing buckets after {warmup} warm-up "
                    "steps, so a move could land in a timed step: raise --warmup (suite.py: "
                    "--superoffload-warmup)."
                )
            warmup += 1
        start = time.perf_counter()
        scale = control.scale_for(step) if control else 1.0
        phases.append(timed_phases(system, batch, scale))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        progress(rank, began, f"step {step + 1}/{warmup + args.steps}: {times[-1]:.3f} s")
        if control:
            control.record(system.grad_norm())
        if step == warmup - 1:
            moves_before_timing = _tail_moves(system)
        step += 1
    stats = system.finish()
    torch.cuda.synchronize()
    if control:  # the norms that decided each step (the log keeps them)
        print("clip-rate norms:", [round(n, 3) for n in control.norms], file=sys.stderr)
    for p in phases:
        p["gpu"] = [a.elapsed_time(b) / 1e3 for a, b in itertools.pairwise(p["events"])]

    def timed():
        return phases[warmup:]

    seconds = statistics.median(times[warmup:])
    tokens = args.batch * args.seq
    tflops = model_flops_per_token(config, n_matmul, args.seq) * tokens / seconds / 1e12
    row = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "system": args.system,
        "params_b": round(n_params / 1e9, 3),
        "hidden": config.hidden_size,
        "layers": config.num_hidden_layers,
        "seq": args.seq,
        "batch": args.batch,
        "s_per_step": round(seconds, 4),
        "step_times": [round(t, 4) for t in times],
        "tokens_per_s": round(tokens / seconds, 1),
        "tflops": round(tflops, 1),
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "peak_host_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "host_rss_gib": {"after_init": rss_after_init, "end": host_rss_gib()},
        "mfu": round(tflops / peak, 4) if (peak := peak_tflops()) else None,
        "clip": args.clip,
        "warmup_steps": warmup,
        "clip_rate": args.clip_rate,
        "clip_first": args.clip_first,
        # What happened, not what was asked: the share of timed steps whose norm clipped.
        "clipped_share": round(control.clipped_share(warmup), 3) if control else None,
        "tail_moves_timed": (
            stats["tail_moves"] - moves_before_timing if moves_before_timing is not None else None
        ),
        "ratio": args.ratio,
        "optimizer": getattr(system, "optimizer_name", None),
        "expected_optimizer": getattr(system, "expected_optimizer", None),
        "phases": {
            f"{where}_{name}_s": round(statistics.median(p[where][i] for p in timed()), 4)
            for where in ("host", "gpu")
            for i, name in enumerate(PHASES)
        },
        "stats": stats,
        "host_bytes": getattr(system, "host_bytes", lambda: None)(),
        "plan_per_rank": planned(args, config, world),
    }
    row = across_ranks(row, world)
    if row is None:  # not rank 0
        dist.destroy_process_group()
        return
    line = json.dumps(row)
    print(line)
    if world > 1:
        dist.destroy_process_group()
    if args.jsonl:
        with open(args.jsonl, "a") as handle:
            handle.write(line + "\n")


if __name__ == "__main__":
    main()
