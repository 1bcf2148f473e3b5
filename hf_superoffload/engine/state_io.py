"""SuperOffloadOptimizer's checkpoint format: ``state_dict`` and ``load_state_dict``.

The layout is torch's (``{"state": {index: ...}, "param_groups": [...]}``, params numbered
across the groups in order); each entry holds the param's fp32 ``master`` besides AdamW's
``exp_avg``, ``exp_avg_sq`` and ``step`` (an int: each param's own count of updates).

One more top-level key, ``"superoffload"``, holds what is not per-param state:
``{"format": 1, "predicted_coef": float}``. ``predicted_coef`` is the clip coefficient of the
last validated step, which the next step speculates with (``Stv.predicted_coef``); a resumed
run that started from 1.0 instead would speculate (or not) differently from the uninterrupted
one and, where it then replays, round differently. torch's ``Optimizer.load_state_dict``, the
HF Trainer and accelerate read only ``state`` and ``param_groups`` (and ``torch.load(...,
weights_only=True)`` accepts a dict of numbers), so the extra key travels with the file and
costs them nothing. A state dict without it (older checkpoints) loads with 1.0.

No second copy of the state (``state_dict``): like torch's own ``Optimizer.state_dict``, the
entries *are* the live state, not copies: views into each host bucket's flat master and
moments. Save them right away (``torch.save(opt.state_dict(), f)``, as the HF Trainer and
accelerate do); the next step's backward (speculation) and ``step()`` overwrite them in
place. ``torch.save`` writes a view's whole underlying storage once, which here is the
bucket's own flat buffer, so the file holds each bucket once: 12 B/param, and saving needs no
extra host memory. Only buckets kept on the device (the tail) are copied to the host, once per
bucket. ``master_state()`` (``param_state``) still returns copies.

``save_atomically(opt.state_dict(), path)`` writes the file so that an interrupted write (a
crash, Ctrl-C, a full disk, a preempted machine) leaves the file already at ``path`` whole.

Loading (``load_state_dict``) copies entry by entry into the buckets, so a file opened with
``torch.load(f, mmap=True)`` is read page by page and never held in memory twice. Everything
is checked before anything is written: group count and sizes, that each entry belongs to a
trainable param, shapes, hyperparameters; a refused state dict leaves the optimizer as it was.

torch's ``AdamW`` state dicts (and a plain HF Trainer checkpoint's ``optimizer.pt``) load too:
an entry without ``master`` takes its master from the param's current value (in fp32; load the
model weights first), its moments and step from AdamW's; each group's lr, betas, eps and
weight_decay (and any scheduler keys such as ``initial_lr``) are taken, and AdamW's own
switches (``amsgrad``, ``maximize``, ``foreach``, ``fused``, ...) are checked and dropped:
those this optimizer cannot honour (``amsgrad=True``, ``maximize=True``, Adam's coupled L2
``decoupled_weight_decay=False`` with a weight decay) are refused with a ValueError.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from .compact_moments import decoded_entry
from .state_checks import (
    COMPACT_STATE_KEYS,
    EXTRA_KEY,
    MOMENT_KEYS,
    check_group_sizes,
    checked_entry,
    loaded_hypers,
    loaded_predicted_coef,
    lookup,
    param_number,
)

if TYPE_CHECKING:
    from .bucket import Bucket
    from .optimizer import SuperOffloadOptimizer

FORMAT_VERSION = 1


def held_bytes(opt: SuperOffloadOptimizer, on_device: bool) -> dict[str, int]:
    """Bytes the host buckets (or the tail's, ``on_device``) hold, by what holds them; the
    copy-out ring counts on the host."""

    def nbytes(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    buckets = [b for b in opt._buckets if b.on_device == on_device]
    moments = sum(
        b.compact.nbytes() if b.compact is not None else nbytes([b.exp_avg, b.exp_avg_sq])
        for b in buckets
    )
    ring, slots = opt._stv.host.copy_out, opt._stv.deferred.slots
    held = {"master": nbytes(b.master for b in buckets), "moments": moments}
    if on_device:
        return {**held, "gradients": nbytes(b.grad for b in buckets)}
    return {
        **held,
        "gradients": nbytes(b.host_grad for b in buckets),
        "param_copy_out": nbytes(ring.buffers) if ring is not None else 0,
        "accumulation": nbytes(b.grad_sum for b in buckets),
        "grad_slots": nbytes(slots.buffers) if slots is not None else 0,
    }


def param_state(opt: SuperOffloadOptimizer, param: torch.nn.Parameter) -> dict:
    """Copies of ``param``'s master, moments and step (the caller has synchronized)."""
    if id(param) not in opt._slot:
        raise ValueError(
            f"this param (shape {tuple(param.shape)}) has no SuperOffloadOptimizer state: it is "
            f"in none of the optimizer's param groups, or it does not require grad."
        )
    bucket, i = opt._slot[id(param)]
    if bucket.compact is not None:  # the moments decoded, as fp32 values
        exp_avg, exp_avg_sq = (m.view_as(param).cpu() for m in bucket.compact.decoded(i))
    else:
        exp_avg = bucket.views(bucket.exp_avg, i).cpu().clone()
        exp_avg_sq = bucket.views(bucket.exp_avg_sq, i).cpu().clone()
    return {
        "master": bucket.views(bucket.master, i).detach().cpu().clone(),
        "exp_avg": exp_avg,
        "exp_avg_sq": exp_avg_sq,
        "step": bucket.param_step(i),
    }


class _HostViews:
    """Each param's state as host tensors: views into a host bucket's own buffers, or into one
    host copy per device-resident buffer (made on first use)."""

    def __init__(self) -> None:
        self._copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, bucket: Bucket, tensor: torch.Tensor, i: int) -> torch.Tensor:
        if tensor.device.type != "cpu":
            key = id(tensor)
            if key not in self._copies:  # keep the source alive with its copy: ids stay unique
                self._copies[key] = (tensor, tensor.detach().to("cpu"))
            tensor = self._copies[key][1]
        return bucket.views(tensor, i).detach()


def state_dict(opt: SuperOffloadOptimizer) -> dict:
    """torch's layout, entries viewing the live state (see the module docstring), with torch's
    state-dict hooks run around it as torch's own optimizers run them."""
    for pre_hook in opt._optimizer_state_dict_pre_hooks.values():
        pre_hook(opt)
    state = _state_dict(opt)
    for post_hook in opt._optimizer_state_dict_post_hooks.values():
        changed = post_hook(opt, state)
        state = state if changed is None else changed
    return state


def _state_dict(opt: SuperOffloadOptimizer) -> dict:
    opt.synchronize()
    host = _HostViews()
    # Params numbered by identity, as torch's: a group listed again (param_groups.extend)
    # shows the same numbers. Entries of optimizer.state not keyed by a param (a state-dict
    # pre-hook's, say) travel as they are, as in torch's.
    state = {k: v for k, v in opt.state.items() if not isinstance(k, torch.Tensor)}
    groups, numbers = [], {}
    for group in opt.param_groups:
        ids = []
        for param in group["params"]:
            index = numbers.setdefault(id(param), len(numbers))
            slot = opt._slot.get(id(param))
            if slot is not None and index not in state:
                bucket, i = slot
                state[index] = {
                    "master": host(bucket, bucket.master, i),
                    **_moments_entry(bucket, i, host),
                    # A float tensor, as torch's AdamW keeps it: its step() increments the
                    # count in place, which an int loaded into it would never see.
                    "step": torch.tensor(float(bucket.param_step(i))),
                }
            ids.append(index)
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    extra = {"format": FORMAT_VERSION, "predicted_coef": float(opt._stv.predicted_coef)}
    return {"state": state, "param_groups": groups, EXTRA_KEY: extra}


def _moments_entry(bucket: Bucket, i: int, host: _HostViews) -> dict:
    """AdamW's two moments; compact ones as their codes (uint8, shaped like the param) and
    block scales (``exp_avg_scale``, ``exp_avg_sq_scale``)."""
    if bucket.compact is None:
        return {
            "exp_avg": host(bucket, bucket.exp_avg, i),
            "exp_avg_sq": host(bucket, bucket.exp_avg_sq, i),
        }
    shape = bucket.plan.params[i].shape
    tensors = (t.detach().cpu() for t in bucket.compact.param_moments(i))
    entry = dict(zip(COMPACT_STATE_KEYS, tensors, strict=True))
    return {k: t.view(shape) if k in MOMENT_KEYS else t for k, t in entry.items()}


def load_state_dict(opt: SuperOffloadOptimizer, state_dict: Mapping) -> None:
    """``_load_state_dict`` with torch's load hooks run around it, as torch runs them."""
    for pre_hook in opt._optimizer_load_state_dict_pre_hooks.values():
        changed = pre_hook(opt, state_dict)
        state_dict = state_dict if changed is None else changed
    _load_state_dict(opt, state_dict)
    for post_hook in opt._optimizer_load_state_dict_post_hooks.values():
        post_hook(opt)


@torch.no_grad()
def _load_state_dict(opt: SuperOffloadOptimizer, state_dict: Mapping) -> None:
    """Check everything, then copy entry by entry into the buckets (module docstring)."""
    opt.synchronize()
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= state_dict.keys():
        raise ValueError(
            "load_state_dict expects an optimizer state dict with 'state' and 'param_groups' "
            f"(what optimizer.state_dict() returns), got "
            f"{sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict)}."
        )
    saved_groups = list(state_dict["param_groups"])
    check_group_sizes(opt.param_groups, saved_groups)
    hypers = [loaded_hypers(g, saved, opt.param_groups[g]) for g, saved in enumerate(saved_groups)]
    coef = loaded_predicted_coef(state_dict)
    where = {}  # saved param id -> (group index, index in group, param)
    for g, (saved, group) in enumerate(zip(saved_groups, opt.param_groups, strict=True)):
        for j, (saved_id, param) in enumerate(zip(saved["params"], group["params"], strict=True)):
            where[saved_id] = (g, j, param)
    entries = {}  # id(param) -> checked entry
    others = {}  # entries not keyed by a param number: back into optimizer.state, as torch's
    for key, entry in state_dict["state"].items():
        if key not in where and param_number(key) is None:
            others[key] = entry
            continue
        g, j, param = lookup(where, key)
        entries[id(param)] = checked_entry(opt._slot, key, g, j, param, entry)

    # Nothing below raises: a refused state dict has left the optimizer untouched.
    for key in [k for k in opt.state if not isinstance(k, torch.Tensor)]:
        del opt.state[key]
    opt.state.update(others)
    for group, hyper in zip(opt.param_groups, hypers, strict=True):
        group.update(hyper)
    for group in opt.param_groups:
        for param in group["params"]:
            slot = opt._slot.get(id(param))
            if slot is not None:
                _load_param(*slot, param, entries.get(id(param)))
    for bucket in opt._buckets:
        bucket.flat_param.copy_(bucket.master)
        if bucket.on_device:
            opt._tail.set_step(bucket)
    opt._stv.predicted_coef = coef


def _load_param(bucket: Bucket, i: int, param: torch.Tensor, entry: dict | None) -> None:
    """One param's state from its checked entry; a param without one starts afresh, as it
    would in torch's AdamW (no moments, no updates yet), from its current value."""
    master = bucket.views(bucket.master, i)
    if entry is None or entry.get("master") is None:
        master.copy_(param.detach())  # torch's layout: the param is the master (cast to fp32)
    else:
        master.copy_(entry["master"])
    if bucket.compact is not None:
        bucket.compact.load(i, entry)
        bucket.set_param_step(i, 0 if entry is None else entry["step"])
        return
    if entry is not None and entry["exp_avg"].dtype == torch.uint8:  # compact: decoded
        decoded = decoded_entry(*(entry[k] for k in COMPACT_STATE_KEYS))
        entry = {
            **entry,
            **{k: m.view_as(param) for k, m in zip(MOMENT_KEYS, decoded, strict=True)},
        }
    for key in MOMENT_KEYS:
        target = bucket.views(getattr(bucket, key), i)
        if entry is None:
            target.zero_()
        else:
            target.copy_(entry[key])
    bucket.set_param_step(i, 0 if entry is None else entry["step"])


def save_atomically(state: object, path: str | os.PathLike) -> None:
    """``torch.save(state, path)``, so that an interrupted write leaves whatever ``path`` held
    before loadable: the bytes go to a temporary file beside it, reach the disk (fsync), and
    only then replace ``path`` by a rename, which POSIX makes atomic within one filesystem.
    On failure the temporary file is removed and the error raised as it was."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    partial = os.path.join(
        directory, f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(4)}.partial"
    )
    # 0o666 under the umask, as torch.save's own open() would create the file.
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    except BaseException:
        if os.path.exists(partial):
            os.unlink(partial)
        raise
    # The rename is durable only once the directory entry is on disk too.
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
