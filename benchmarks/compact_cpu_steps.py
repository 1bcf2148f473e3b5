"""CPU passes per training step of the engines on a CPU-only machine, with fp32 or compact moments.

    python benchmarks/compact_cpu_steps.py --engine standalone --moments compact
    python benchmarks/compact_cpu_steps.py --engine zero3 --moments fp32 --hidden 768

Trains a random tiny Llama (fp32, no clipping: every speculation is validated) for --steps
steps after --warmup, on the standalone optimizer or on DeepSpeed ZeRO-3 (one rank, gloo, the
CPU accelerator), and prints one JSON line: seconds per step, and per step the engine's CPU
pass seconds (``cpu_step_seconds``: speculative, fused and after-validation passes;
``commit_seconds``: compact moments' validated updates written by a pass of their own;
``replay_seconds``) and its counts, and the process's CPU time per step (all threads: the
model's compute and the passes). Here the worker and the model share the same cores, so the
seconds per step add the passes up rather than overlap them as on a GPU host.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

# Run from a checkout without installing: the package is the folder above this one.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

COUNTED = ("cpu_step_seconds", "commit_seconds", "replay_seconds", "exposed_cpu_seconds",
           "slot_wait_seconds")  # fmt: skip


def build(args):
    from hf_superoffload.toy import build_tiny_llama, tiny_llama_config

    config = tiny_llama_config(
        vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
        num_heads=args.hidden // 64, max_position_embeddings=args.seq,
    )  # fmt: skip
    return build_tiny_llama(config)


def standalone(args, model):
    from hf_superoffload import SuperOffloadOptimizer

    opt = SuperOffloadOptimizer(
        model.parameters(), lr=1e-4, max_grad_norm=None, gpu_tail=0, model=model,
        moments=args.moments, cpu_threads=args.threads, bucket_size=args.bucket_size,
    )  # fmt: skip

    def step(ids):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    return step, opt._stv, lambda: opt.stats, opt.close


def zero3(args, model):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK="0",
                      LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")  # fmt: skip
    os.environ["HF_SUPEROFFLOAD_MOMENTS"] = args.moments
    import deepspeed

    import hf_superoffload  # noqa: F401  (activates the ZeRO-3 path)

    deepspeed.init_distributed(dist_backend="gloo")
    config = {
        "train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False, "steps_per_print": 10**9,
        "zero_optimization": {
            "stage": 3, "sub_group_size": args.sub_group_size,
            "offload_optimizer": {"device": "cpu", "pin_memory": False, "super_offload": True},
        },
    }  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, zero, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    def step(ids):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()

    return step, zero._stv, lambda: zero.stats, engine.destroy


def arguments(description: str) -> argparse.ArgumentParser:
    """The model, engine and step flags (compact_pass_profile.py takes the same)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--engine", choices=("standalone", "zero3"), default="standalone")
    parser.add_argument("--moments", choices=("fp32", "compact"), default="compact")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="CPU Adam threads")
    parser.add_argument("--bucket-size", type=int, default=1 << 22, help="standalone's")
    parser.add_argument("--sub-group-size", type=int, default=1 << 22, help="ZeRO-3's")
    parser.add_argument("--port", type=int, default=29531)
    return parser


def warmed_up(args):
    """The model's param count, the engine (``step``, its STV core, ``stats``, ``close``)
    after the warm-up steps, and the batches of the measured steps."""
    model = build(args)
    params = sum(p.numel() for p in model.parameters())
    step, stv, stats, close = (standalone if args.engine == "standalone" else zero3)(args, model)
    generator = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
        for _ in range(args.warmup + args.steps)
    ]
    for ids in batches[: args.warmup]:
        step(ids)
    # The worker's queue, not a flush: each measured step makes its passes (with compact
    # moments, the last warm-up step's update is written during the first measured one).
    stv.worker.wait()
    return params, (step, stv, stats, close), batches[args.warmup :]


def main() -> None:
    args = arguments(__doc__.split("\n")[0]).parse_args()
    params, (step, stv, stats, close), batches = warmed_up(args)
    before = dict(stats())
    start, cpu_start = time.perf_counter(), time.process_time()
    for ids in batches:
        step(ids)
    stv.worker.wait()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    after = dict(stats())
    close()
    per_step = {k: round((after.get(k, 0) - before.get(k, 0)) / args.steps, 4) for k in COUNTED}
    print(json.dumps({
        "engine": args.engine, "moments": args.moments, "params": params,
        "s_per_step": round(elapsed / args.steps, 4),
        "process_cpu_s_per_step": round(cpu / args.steps, 4), **per_step,
        "commits_fused": after.get("commits_fused", 0) - before.get("commits_fused", 0),
        "speculations_applied": after["speculations_applied"] - before["speculations_applied"],
    }))  # fmt: skip


if __name__ == "__main__":
    main()
