"""Which optimizer trained a run and where its fp32 master and Adam moments lived, in bytes, for
the end-of-run summary (``recipes/report.py``) and the model card (``model_card.py``).

The optimizer is the one that stepped: under DeepSpeed the engine's (ours on the ZeRO-3 path,
whichever Trainer drove it), else the Trainer's. Ours report the fp32 master and both moments
as their buffers hold them (the ZeRO-3 path: this rank's partition), on the host and in the
GPU tail, and whether the moments are fp32 or compact (8 bits a value).
"""

from __future__ import annotations

from ..engine import SuperOffloadOptimizer

MIB = 2**20
GIB = 2**30


def running_optimizer(trainer):
    """The optimizer that steps the params (unwrapped from accelerate's wrapper)."""
    engine = getattr(trainer, "deepspeed", None)
    inner = getattr(engine, "optimizer", None)
    if inner is None:
        optimizer = getattr(trainer, "optimizer", None)
        inner = getattr(optimizer, "optimizer", optimizer)
    return inner


def stv_stats(trainer) -> dict | None:
    """The STV counters: the SuperOffload trainers' snapshot at the end of train(), else those
    of the optimizer that ran (ours under a plain Trainer), else None."""
    snapshot = getattr(trainer, "superoffload_stats", None)
    if snapshot:
        return snapshot
    optimizer = running_optimizer(trainer)
    return dict(optimizer.stats) if hasattr(optimizer, "stats") else None


def optimizer_state_placement(trainer, model) -> dict:
    """``optimizer`` (its class), ``where`` (in words), ``host_bytes`` and ``device_bytes`` of
    the fp32 master and moments (None when the optimizer cannot tell), and for ours how many of
    its ``buckets`` (``unit``: buckets, or sub groups on ZeRO-3) were in the GPU tail."""
    optimizer = running_optimizer(trainer)
    if optimizer is None:  # a card written before train() built one
        return {
            "optimizer": None,
            "where": "not built yet",
            "host_bytes": None,
            "device_bytes": None,
        }
    name = type(optimizer).__name__
    if hasattr(optimizer, "host_bytes") and hasattr(optimizer, "device_bytes"):  # ours
        host, device, stats = optimizer.host_bytes(), optimizer.device_bytes(), optimizer.stats
        standalone = isinstance(optimizer, SuperOffloadOptimizer)
        ranks = getattr(trainer.args, "world_size", 1)
        where = (
            name if standalone else f"{name} (DeepSpeed ZeRO-3, per rank: 1/{ranks} of the state)"
        )
        if getattr(optimizer, "moments", "fp32") == "compact":
            where += ", compact moments (8 bits a value)"
        return {
            "optimizer": name,
            "where": where,
            "host_bytes": host["master"] + host["moments"],
            "device_bytes": device["master"] + device["moments"],
            "gpu_tail_buckets": int(stats["gpu_tail_buckets"]),
            "buckets": int(stats["buckets"]),
            "unit": "buckets" if standalone else "sub groups",
        }
    where = (
        f"DeepSpeed's {name} (its offload_optimizer settings)"
        if getattr(trainer, "is_deepspeed_enabled", False)
        else f"torch {name} on {trainer.args.device}"
    )
    return {"optimizer": name, "where": where, "host_bytes": None, "device_bytes": None}


def size(nbytes: int | None) -> str:
    if nbytes is None:
        return "?"
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB // 10 else f"{nbytes / MIB:.2f} MiB"


def describe(placement: dict) -> str:
    """One line: where the state lived, host and device bytes, buckets in the GPU tail."""
    text = placement["where"]
    if placement["host_bytes"] is not None:
        text += f", host {size(placement['host_bytes'])}"
    if placement["device_bytes"] is not None:
        text += f", device {size(placement['device_bytes'])}"
    if "gpu_tail_buckets" in placement:
        text += (
            f", GPU tail {placement['gpu_tail_buckets']} of {placement['buckets']} "
            f"{placement['unit']}"
        )
    return text
