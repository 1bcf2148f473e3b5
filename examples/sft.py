# Run (from the repository root, with the package installed: pip install -e .):
#   python examples/sft.py
#   python examples/sft.py --max-steps 200 --lr 1e-3 --output-dir outputs/sft-long
"""Supervised fine-tuning of a tiny Llama on the bundled arithmetic data with TRL's SFTTrainer.

The job needs no download: the model (random weights), the character tokenizer
(`hf_superoffload.toy`) and the data (`examples/data/arithmetic_sft.jsonl`) are all local, so
it runs anywhere in about half a minute on two CPU cores. It trains on a GPU in bf16 mixed
precision when one is visible, else on the CPU in fp32. At the end it saves the model and
tokenizer to `--output-dir`, prints the first and the last training loss, and exits non-zero
if the loss did not go down. On a CPU shared with other busy processes, `OMP_NUM_THREADS=1`
keeps it fast: the default tiny model gains nothing from more threads.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

# Nothing here comes from the Hugging Face Hub. Offline mode makes `datasets` and the trainer
# skip the Hub look-ups they would otherwise try (and wait on, on a machine without network).
# It must be set before `huggingface_hub` is imported; an explicit setting by the user wins.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from datasets import load_dataset
from transformers import set_seed
from trl import SFTConfig, SFTTrainer

from hf_superoffload import SuperOffloadSFTConfig, SuperOffloadSFTTrainer
from hf_superoffload.toy import build_tiny_llama, make_char_tokenizer, tiny_llama_config

DATA_FILE = Path(__file__).resolve().parent / "data" / "arithmetic_sft.jsonl"
# Recent transformers (5.x) renamed `gradient_checkpointing` to `activation_checkpointing` and warn
# on the old name, which TRL's config sets (to True) by default; older versions lack the new name.
_CHECKPOINTING_ARG = (
    "activation_checkpointing"
    if "activation_checkpointing" in {f.name for f in dataclasses.fields(SFTConfig)}
    else "gradient_checkpointing"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-steps", type=int, default=50, help="optimizer steps (default: 50)")
    p.add_argument("--batch-size", type=int, default=32, help="per-device batch (default: 32)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: 3e-3)")
    p.add_argument(
        "--max-grad-norm",
        type=float,
        default=1.0,
        help="gradient clipping norm; 0 disables clipping (default: 1.0, the Trainer default)",
    )
    p.add_argument(
        "--optimizer",
        choices=["superoffload", "adamw"],
        default="superoffload",
        help="superoffload (default): fp32 master and Adam state on the CPU, stepped during "
        "backward; adamw: the Trainer's own torch AdamW, for comparison",
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the weights and data order")
    p.add_argument("--output-dir", default="outputs/sft-tiny-llama", help="where the model goes")
    p.add_argument("--data-file", type=Path, default=DATA_FILE, help="prompt-completion jsonl")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument(
        "--report-to",
        default="none",
        help='comma-separated trackers, e.g. "wandb"; "none" (default) logs to stdout only',
    )
    args = p.parse_args(argv)
    if args.max_steps < 2:
        p.error("--max-steps must be at least 2 (the job compares the first and last loss)")
    return args


def make_sft_config(args: argparse.Namespace) -> SFTConfig:
    """The training arguments. Values that differ from TRL's defaults are set on purpose."""
    use_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    superoffload = {}
    if args.optimizer == "superoffload" and os.environ.get("ACCELERATE_USE_DEEPSPEED") != "true":
        # A 0.1M-param model fits one default bucket; small ones exercise the bucket pipeline.
        # (Under a DeepSpeed config the partition is its sub_group_size.)
        superoffload = {"superoffload_bucket_size": 1 << 14}
    return SuperOffloadSFTConfig(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,  # TRL's 2e-5 default suits pretrained models, not random ones
        lr_scheduler_type="cosine",
        warmup_steps=0.1,  # a float below 1 is a fraction of max_steps
        max_grad_norm=args.max_grad_norm,
        seed=args.seed,
        # TRL defaults bf16 to True on every device; on CPU that would mean slow bf16 autocast.
        bf16=use_bf16,
        # TRL turns gradient checkpointing on by default; a model this small needs no memory saving.
        **{_CHECKPOINTING_ARG: False},
        dataloader_pin_memory=torch.cuda.is_available(),  # pinning on CPU only warns
        max_length=64,  # the longest row is 14 tokens with <bos> and <eos>
        logging_steps=1,  # every step's loss, so the first one is the untrained model's
        save_strategy="no",  # the final model is saved explicitly below
        report_to=[t.strip() for t in args.report_to.split(",") if t.strip()],
        dataloader_num_workers=0,
        optim="adamw_torch",  # the plain-AdamW comparison uses torch's default arithmetic
        **superoffload,
    )


def build_trainer(
    args: argparse.Namespace, model, tokenizer, train_dataset, sft_config: SFTConfig | None = None
) -> SFTTrainer:
    """The trainer for this job: TRL's SFTTrainer, with SuperOffload unless --optimizer adamw."""
    trainer_cls = SuperOffloadSFTTrainer if args.optimizer == "superoffload" else SFTTrainer
    return trainer_cls(
        model=model,
        args=sft_config or make_sft_config(args),
        train_dataset=train_dataset,
        processing_class=tokenizer,
    )


def train(args: argparse.Namespace) -> dict:
    """Run the job; return the per-step training losses and where the model was saved."""
    set_seed(args.seed)
    tokenizer = make_char_tokenizer()
    config = tiny_llama_config(
        vocab_size=len(tokenizer), hidden_size=args.hidden_size, num_layers=args.num_layers
    )
    model = build_tiny_llama(config, seed=args.seed)
    dataset = load_dataset("json", data_files=str(args.data_file), split="train")

    trainer = build_trainer(args, model, tokenizer, dataset)
    result = trainer.train()
    trainer.save_model(args.output_dir)  # model, config and tokenizer
    trainer.save_state()  # trainer_state.json, with every logged loss

    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    summary = {
        "losses": losses,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "steps": trainer.state.global_step,
        "train_runtime_s": result.metrics["train_runtime"],
        "device": str(trainer.args.device),
        "bf16": trainer.args.bf16,
        "optimizer": args.optimizer,
        "superoffload_stats": getattr(trainer, "superoffload_stats", None),
        "output_dir": str(Path(args.output_dir).resolve()),
    }
    with open(Path(args.output_dir) / "sft_summary.json", "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    summary = train(args)
    first, last = summary["first_loss"], summary["last_loss"]
    print(
        f"first training loss {first:.4f}, last {last:.4f} after {summary['steps']} steps "
        f"({summary['train_runtime_s']:.1f} s on {summary['device']}, bf16={summary['bf16']}, "
        f"optimizer {summary['optimizer']}); model saved to {summary['output_dir']}"
    )
    if summary["superoffload_stats"]:
        stats = summary["superoffload_stats"]
        print(
            f"superoffload: {stats['speculative_steps']} of {stats['steps']} steps speculated, "
            f"{stats['rollbacks_clip']} replayed for clipping, {stats['rollbacks_nonfinite']} "
            f"skipped, CPU Adam {stats['cpu_step_seconds']:.2f} s"
        )
    if not last < first:
        print("error: the training loss did not go down", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
