"""Does the compact optimizer state train as well as exact AdamW? A small Llama learns the
bundled arithmetic data (hf_superoffload.recipes.arithmetic) from random weights with
``torch.optim.AdamW`` and with ``CompactAdamW`` (both moments in 8 bits,
hf_superoffload.ops.compact_state), several seeds each; the script writes the loss curves and
the exact-match accuracy of greedy answers on training prompts and on held-out prompts.

    python benchmarks/compact_convergence.py --steps 600 --seeds 3 --out-dir results/compact

Runs on a CPU in minutes (``--threads`` sets torch's intra-op threads).
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import random
import statistics
import time
from pathlib import Path

import torch

from hf_superoffload.ops.compact_state import CompactAdamW, CompactFormat
from hf_superoffload.recipes.arithmetic import _problems, make_sft_rows
from hf_superoffload.toy import build_tiny_llama, make_char_tokenizer, tiny_llama_config

OPTIMIZERS = {
    "adamw": torch.optim.AdamW,
    "compact": CompactAdamW,  # e4m3 / e5m3, blocks of 256, round to nearest even
    "compact_sr": functools.partial(CompactAdamW, format=CompactFormat(stochastic=True)),
    "compact_sr_e3m4_b64": functools.partial(
        CompactAdamW, format=CompactFormat(exp_avg=(3, 4), block=64, stochastic=True)
    ),
}


def held_out_rows(train: list[dict], count: int, seed: int = 7) -> list[dict]:
    """``count`` problems of the same distribution that the training rows do not hold."""
    seen = {row["prompt"] for row in train}
    rows = []
    for prompt, answer in _problems(count + len(seen), random.Random(seed)):
        if prompt not in seen:
            rows.append({"prompt": prompt, "completion": str(answer)})
        if len(rows) == count:
            break
    return rows


def encode(tokenizer, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, labels) padded to the longest row; labels only on the answer and <eos>."""
    bos, eos, pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    pairs = []
    for row in rows:
        prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        answer = tokenizer(row["completion"], add_special_tokens=False)["input_ids"] + [eos]
        ids = [bos, *prompt, *answer]
        pairs.append((ids, [-100] * (1 + len(prompt)) + answer))
    width = max(len(ids) for ids, _ in pairs)
    ids = torch.tensor([i + [pad] * (width - len(i)) for i, _ in pairs])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in pairs])
    return ids, labels


@torch.no_grad()
def answer_loss(model, data: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, float]:
    """(mean cross-entropy, share of tokens predicted right) over the answers and <eos>."""
    model.eval()
    ids, labels = data
    logits = model(input_ids=ids).logits[:, :-1].float()
    target = labels[:, 1:]
    mask = target != -100
    loss = torch.nn.functional.cross_entropy(logits[mask], target[mask]).item()
    accuracy = (logits.argmax(-1)[mask] == target[mask]).float().mean().item()
    model.train()
    return loss, accuracy


@torch.no_grad()
def exact_match(model, tokenizer, rows: list[dict], max_new: int = 6) -> float:
    """Share of rows whose greedy continuation of the prompt is the answer, then <eos>."""
    model.eval()
    hits = 0
    for row in rows:
        prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        ids = torch.tensor([[tokenizer.bos_token_id, *prompt]])
        out = []
        for _ in range(max_new):
            token = int(model(input_ids=ids).logits[0, -1].argmax())
            if token == tokenizer.eos_token_id:
                break
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
        hits += tokenizer.decode(out) == row["completion"]
    model.train()
    return hits / len(rows)


def train(name: str, seed: int, args, tokenizer, data, evals) -> dict:
    torch.manual_seed(seed)
    config = tiny_llama_config(
        vocab_size=len(tokenizer), hidden_size=args.hidden, num_layers=args.layers, num_heads=4
    )
    model = build_tiny_llama(config, seed=seed)
    opt = OPTIMIZERS[name](model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 30) * max(0.1, 1 - s / args.steps)
    )
    ids, labels = data
    order = torch.Generator().manual_seed(seed)
    losses = []
    start = time.perf_counter()
    for _ in range(args.steps):
        pick = torch.randint(0, ids.shape[0], (args.batch,), generator=order)
        loss = model(input_ids=ids[pick], labels=labels[pick]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    scores = {
        f"exact_match_{split}": exact_match(model, tokenizer, rows) for split, rows in evals.items()
    }
    loss, accuracy = answer_loss(model, encode(tokenizer, evals["held_out"]))
    params = sum(p.numel() for p in model.parameters())
    return {"optimizer": name, "seed": seed, "params": params, "seconds": seconds, "losses": losses,
            "held_out_loss": loss, "held_out_token_accuracy": accuracy, **scores}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--eval-rows", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out-dir", type=Path, default=Path("results/compact"))
    parser.add_argument(
        "--optimizers", nargs="+", default=["adamw", "compact_sr"], choices=sorted(OPTIMIZERS)
    )
    parser.add_argument("--first-seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = make_char_tokenizer()
    rows = make_sft_rows()
    evals = {"train": rows[: args.eval_rows], "held_out": held_out_rows(rows, args.eval_rows)}
    data = encode(tokenizer, rows)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for name in args.optimizers:
            run = train(name, seed, args, tokenizer, data, evals)
            runs.append(run)
            tail = statistics.mean(run["losses"][-50:])
            print(f"{name:>8} seed {seed}: last-50 loss {tail:.4f}, exact match train "
                  f"{run['exact_match_train']:.3f} held-out {run['exact_match_held_out']:.3f}, "
                  f"held-out loss {run['held_out_loss']:.4f} token accuracy "
                  f"{run['held_out_token_accuracy']:.3f}, {run['seconds']:.0f} s", flush=True)  # fmt: skip
    (args.out_dir / "runs.json").write_text(
        json.dumps({"args": vars(args) | {"out_dir": str(args.out_dir)}, "runs": runs})
    )
    with open(args.out_dir / "losses.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["optimizer", "seed", "step", "loss"])
        for run in runs:
            writer.writerows(
                (run["optimizer"], run["seed"], i + 1, f"{v:.6f}")
                for i, v in enumerate(run["losses"])
            )
    print(
        f"{'optimizer':>9} {'last-50 loss':>14} {'EM train':>10} {'EM held-out':>12} {'held-out loss':>14} {'held-out tok acc':>16}"
    )
    for name in args.optimizers:
        mine = [r for r in runs if r["optimizer"] == name]
        stat = lambda xs: f"{statistics.mean(xs):.4f}+-{statistics.pstdev(xs):.4f}"  # noqa: E731
        print(f"{name:>9} {stat([statistics.mean(r['losses'][-50:]) for r in mine]):>14} "
              f"{stat([r['exact_match_train'] for r in mine]):>10} {stat([r['exact_match_held_out'] for r in mine]):>12} "
              f"{stat([r['held_out_loss'] for r in mine]):>14} {stat([r['held_out_token_accuracy'] for r in mine]):>16}")  # fmt: skip


if __name__ == "__main__":
    main()
