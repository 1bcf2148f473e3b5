# Run (one system per process; the device machine: source scripts/device_env.sh first):
#   python benchmarks/train_step.py --system superoffload --hidden 3072 --layers 28 --seq 4096
#   python benchmarks/train_step.py --system no_offload   --hidden 3072 --layers 28 --seq 4096
"""Seconds per optimizer step of a randomly initialised Llama-style model, one system a run.

Systems: ``no_offload`` (fp32 params, bf16 autocast, fused AdamW on the GPU, clip_grad_norm_:
what the HF Trainer does without offload) and ``superoffload`` (bf16 params on the GPU, fp32
master and moments on the CPU, SuperOffloadOptimizer with clipping validated after backward).
Both use activation checkpointing and AdamW with clip 1.0. Prints one JSON line with the
median s/step after warm-up, tokens/s, TFLOPS, peak GPU memory, peak host RSS and the
engine's stats, and appends it to --jsonl if given.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import resource
import statistics
import time

import torch
import transformers


def model_config(args) -> transformers.LlamaConfig:
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


def flops_per_token(config: transformers.LlamaConfig, n_params: int, seq: int) -> float:
    """6N for the dense weights plus the attention score/value matmuls (fwd+bwd, causal not
    discounted), as in the PaLM appendix; recomputation by checkpointing is not counted."""
    return 6 * n_params + 12 * config.num_hidden_layers * config.hidden_size * seq


def build(args):
    config = model_config(args)
    dtype = torch.float32 if args.system == "no_offload" else torch.bfloat16
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    params = [p for p in model.parameters() if p.requires_grad]
    if args.system == "no_offload":
        optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, fused=True)
    else:
        from hf_superoffload import SuperOffloadOptimizer

        optimizer = SuperOffloadOptimizer(
            params,
            lr=1e-5,
            weight_decay=0.0,
            max_grad_norm=args.clip,
            model=model,
            gpu_buckets=args.gpu_buckets if args.gpu_buckets == "auto" else int(args.gpu_buckets),
            bucket_size=args.bucket_size,
            cast=args.cast,
        )
    return config, model, params, optimizer


def train_step(args, model, params, optimizer, batch):
    if args.system == "no_offload":
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, args.clip)
    else:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--system", choices=["no_offload", "superoffload"], required=True)
    parser.add_argument("--hidden", type=int, default=3072)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--inter", type=int, default=0, help="0: 8/3 x hidden, rounded to 256")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--gpu-buckets", default="auto")
    parser.add_argument("--bucket-size", type=int, default=1 << 25)
    parser.add_argument("--cast", default="auto")
    parser.add_argument("--jsonl", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    torch.manual_seed(0)
    config, model, params, optimizer = build(args)
    n_params = sum(p.numel() for p in params)
    batch = torch.randint(0, config.vocab_size, (args.batch, args.seq), device="cuda")
    times = []
    for _ in range(args.warmup + args.steps):
        start = time.perf_counter()
        train_step(args, model, params, optimizer, batch)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    if hasattr(optimizer, "synchronize"):
        optimizer.synchronize()
        torch.cuda.synchronize()
    seconds = statistics.median(times[args.warmup :])
    tokens = args.batch * args.seq
    tflops = flops_per_token(config, n_params, args.seq) * tokens / seconds / 1e12
    row = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "system": args.system,
        "params_b": round(n_params / 1e9, 3),
        "hidden": args.hidden,
        "layers": args.layers,
        "seq": args.seq,
        "batch": args.batch,
        "s_per_step": round(seconds, 4),
        "step_times": [round(t, 4) for t in times],
        "tokens_per_s": round(tokens / seconds, 1),
        "tflops": round(tflops, 1),
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "peak_host_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "stats": getattr(optimizer, "stats", None),
    }
    line = json.dumps(row)
    print(line)
    if args.jsonl:
        with open(args.jsonl, "a") as handle:
            handle.write(line + "\n")
    if hasattr(optimizer, "close"):
        optimizer.close()


if __name__ == "__main__":
    main()
