"""What a recipe run shows and leaves behind: a progress bar with the loss on it, the loss curve
as a PNG, and a short summary (tokens/s, rollbacks by cause, where the optimizer state lived)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from transformers.trainer_callback import ProgressCallback, TrainerCallback

from ..integrations.optimizer_report import (
    describe,
    optimizer_state_placement,
    running_optimizer,
    stv_stats,
)


class LossBar(ProgressCallback):
    """The Trainer's tqdm bar, with the latest loss and tokens/s on it instead of one printed
    dict per log (the demo logs every step)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not (state.is_world_process_zero and self.training_bar is not None and logs):
            return
        shown = {k: f"{logs[k]:.4g}" for k in ("loss", "tokens_per_second") if k in logs}
        if shown:
            self.training_bar.set_postfix(shown, refresh=False)


class LogLines(TrainerCallback):
    """Each logged dict, at full precision, appended to ``output_dir/log_history.jsonl`` as it
    is logged: the bar and ``train.log`` round, and ``trainer_state.json`` is written only with
    a checkpoint or at the end, so a stopped run keeps its metrics here."""

    FILE = "log_history.jsonl"

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not (state.is_world_process_zero and logs):
            return
        path = Path(args.output_dir) / self.FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as lines:
            lines.write(json.dumps({"step": state.global_step, **logs}) + "\n")


def use_loss_bar(trainer) -> None:
    """Swap the Trainer's progress bar for ``LossBar`` (when it shows one at all)."""
    if trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(LossBar())


def losses(log_history: list[dict]) -> list[tuple[int, float]]:
    return [(log["step"], log["loss"]) for log in log_history if "loss" in log and "step" in log]


def plot_losses(log_history: list[dict], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    points = losses(log_history)
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot([s for s, _ in points], [v for _, v in points], marker="." if len(points) < 60 else "")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def optimizer_placement(trainer, model) -> dict:
    """Where the fp32 master and the Adam moments lived at the end (bytes on the host and on
    the GPU), as far as the optimizer that ran can tell."""
    return optimizer_state_placement(trainer, model)


def summarize(trainer, model, kind: str, train_metrics: dict) -> dict:
    history = trainer.state.log_history
    points = losses(history)
    tokens = [log["tokens_per_second"] for log in history if "tokens_per_second" in log]
    stats = stv_stats(trainer) or {}
    return {
        "kind": kind,
        "losses": [v for _, v in points],
        "first_loss": points[0][1] if points else None,
        "last_loss": points[-1][1] if points else None,
        "steps": trainer.state.global_step,
        "train_runtime_s": train_metrics.get("train_runtime"),
        "tokens_per_second": statistics.median(tokens) if tokens else None,
        "device": str(trainer.args.device),
        "processes": trainer.args.world_size,  # ranks that trained together
        "sequence_parallel_size": _sequence_parallel_size(trainer),  # ranks a sequence spans
        "bf16": bool(trainer.args.bf16),
        "optimizer": type(running_optimizer(trainer)).__name__,
        "superoffload_stats": stats or None,
        "optimizer_state": optimizer_placement(trainer, model),
        "activation_checkpoint_offload": _activation_offload(trainer),
        "output_dir": str(Path(trainer.args.output_dir).resolve()),
    }


def _activation_offload(trainer) -> dict | None:
    """What ``--activation_checkpoint_offload`` moved on this rank (None: off)."""
    from ..integrations.activation_offload import ActivationOffloadCallback

    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, ActivationOffloadCallback):
            offload, tally = callback.offload, callback.offload.tally
            return {
                "layers": offload.layers,
                "inputs_moved": tally.packed,
                # The host memory the copies held at once (pinned: whole allocator blocks).
                "host_peak_bytes": tally.peak_held_bytes,
                "pinned": tally.packed > 0 and tally.pinned == tally.packed,
            }
    return None


def _sequence_parallel_size(trainer) -> int:
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    return pc.sp_size if pc is not None and pc.sp_enabled else 1


def format_summary(summary: dict) -> str:
    first, last = summary["first_loss"], summary["last_loss"]
    runtime = summary["train_runtime_s"] or 0.0
    tokens = summary["tokens_per_second"]
    sp_size = summary.get("sequence_parallel_size", 1)
    sp = f", sequence parallel over {sp_size} ranks" if sp_size > 1 else ""
    lines = [
        f"{summary['kind']}: loss {first:.4f} -> {last:.4f} over {summary['steps']} steps, "
        f"{runtime:.1f} s on {summary['device']} (bf16={summary['bf16']}{sp}), "
        + (f"{tokens:,.0f} tokens/s (median)" if tokens else "tokens/s not logged"),
    ]
    stats = summary["superoffload_stats"]
    if stats:
        lines.append(
            f"rollbacks: {stats['rollbacks_clip']:.0f} for gradient clipping, "
            f"{stats['rollbacks_nonfinite']:.0f} for NaN/Inf; {stats['speculative_steps']:.0f} "
            f"of {stats['steps']:.0f} steps speculated ({stats['speculations_applied']:.0f} "
            f"partitions stepped before validation, {stats['speculations_withheld']:.0f} "
            f"withheld, {stats['replays']:.0f} replayed)"
        )
    lines.append(f"optimizer state: {describe(summary['optimizer_state'])} (fp32 master + moments)")
    offload = summary.get("activation_checkpoint_offload")
    if offload:
        memory = "pinned host memory" if offload["pinned"] else "host memory (not pinned: no GPU)"
        lines.append(
            f"activation checkpoint offload: the inputs of {offload['layers']} layers waited in "
            f"{memory}, at most {offload['host_peak_bytes'] / 2**30:.2f} GiB at once per rank"
        )
    written = ", ".join(["model", *summary.get("written", [])])
    lines.append(f"output: {summary['output_dir']} ({written})")
    return "\n".join(lines)
