"""Where each param's partition sits in a ZeRO-3 checkpoint's sub groups, and moving that state
into an optimizer whose sub groups are cut differently.

A rank's ZeRO-3 optimizer file holds, per sub group, one flat fp32 master and one flat tensor
per Adam moment: the partitions of the sub group's params, one after the other. DeepSpeed cuts
sub groups in param order, each at least ``sub_group_size`` elements; ours (``sub_groups.py``)
cuts them at most ``sub_group_size`` and puts the persistent params in sub groups of their own.
So the same param sits at different places in the two files, and DeepSpeed's own loader (which
copies sub group i into sub group i) fails or mixes params up. Our checkpoints record their cut
(``LAYOUT_KEY``); a checkpoint without the record was cut by DeepSpeed's rule, which its sub
group sizes and the param order tell.

A layout is a list of sub groups, each ``(param group index, ((name, partition numel), ...))``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

# In the ZeRO optimizer's state dict (beside DeepSpeed's keys, which its tools ignore).
LAYOUT_KEY = "hf_superoffload_sub_groups"
# DeepSpeed's keys (deepspeed.checkpoint.constants), spelt here so reading needs no DeepSpeed.
BASE_OPTIMIZER_STATE = "optimizer_state_dict"
FP32_FLAT_GROUPS = "fp32_flat_groups"
MOMENTS = ("exp_avg", "exp_avg_sq")

Layout = list[tuple[int, tuple[tuple[str, int], ...]]]


class CheckpointLayoutError(ValueError):
    """The checkpoint's sub groups cannot be matched to this optimizer's params."""


def live_layout(zero) -> Layout:
    """The layout of a live DeepSpeed ZeRO-3 optimizer (ours or DeepSpeed's)."""
    return [
        (zero.sub_group_to_group_id[i], tuple((zero.param_names[p], p.partition_numel()) for p in group))
        for i, group in enumerate(zero.fp16_groups)
    ]  # fmt: skip


def as_record(layout: Layout) -> list:
    """The layout in plain lists (what the checkpoint stores)."""
    return [[group, [[name, numel] for name, numel in params]] for group, params in layout]


def from_record(record: list) -> Layout:
    return [(int(g), tuple((str(n), int(k)) for n, k in params)) for g, params in record]


def saved_layout(zero, saved: dict) -> Layout:
    """The layout of a rank's saved ZeRO-3 optimizer state dict: its record, or else the cut
    that DeepSpeed's rule (or ours, for files saved before the record existed) makes of this
    optimizer's params with the saved sub group sizes."""
    if LAYOUT_KEY in saved:
        return from_record(saved[LAYOUT_KEY])
    sizes = [t.numel() for t in saved[FP32_FLAT_GROUPS]]
    groups = saved_group_of_sub_groups(saved)
    fits = []
    for order in (_deepspeed_order(zero), _our_order(zero)):
        layout = _cut_by_sizes(order, sizes, groups)
        if layout is not None and layout not in fits:
            fits.append(layout)
    if len(fits) != 1:
        raise CheckpointLayoutError(
            f"the checkpoint's {len(sizes)} sub groups (sizes {sizes[:8]}{'...' * (len(sizes) > 8)})"
            + (" fit no cut" if not fits else " fit two different cuts")
            + " of this model's params: was it saved from the same model, param groups and "
            "number of ranks?"
        )
    return fits[0]


def saved_group_of_sub_groups(saved: dict) -> list[int]:
    """Each saved sub group's param group, from the base optimizer's param groups (DeepSpeed
    lists each sub group's flat master in its group, in sub group order)."""
    index_to_group = {}
    for g, group in enumerate(saved[BASE_OPTIMIZER_STATE]["param_groups"]):
        for index in group["params"]:
            index_to_group[index] = g
    groups = [index_to_group[i] for i in sorted(index_to_group)]
    if groups != sorted(groups) or len(groups) != len(saved[FP32_FLAT_GROUPS]):
        raise CheckpointLayoutError(
            "the checkpoint's sub groups are not in param-group order (DeepSpeed's own tools "
            "assume they are); it cannot be read here."
        )
    return groups


def _deepspeed_order(zero) -> list[tuple[int, list[tuple[str, int]]]]:
    """Per param group (DeepSpeed's trainable groups, in order), its params in DeepSpeed's
    order: the order DeepSpeed cuts sub groups in."""
    out = []
    for j, group in enumerate(zero.trainable_param_groups):
        source = group.get("_ds_source_param_group_id", j)
        out.append((source, [(zero.param_names[p], p.partition_numel()) for p in group["params"]]))
    return out


def _our_order(zero) -> list[tuple[int, list[tuple[str, int]]]]:
    """As ``_deepspeed_order``, with each group's persistent params last (sub_groups.py)."""
    persistent = {
        zero.param_names[p] for group in zero.fp16_groups for p in group if getattr(p, "ds_persist", False)
    }  # fmt: skip
    return [
        (g, [e for e in params if e[0] not in persistent] + [e for e in params if e[0] in persistent])
        for g, params in _deepspeed_order(zero)
    ]  # fmt: skip


def _cut_by_sizes(order, sizes: list[int], groups: list[int]) -> Layout | None:
    """Cut each param group's params, in ``order``, into consecutive runs of the saved sizes;
    None where the sizes do not fall on param boundaries."""
    layout: Layout = []
    s = 0
    for group_id, params in order:
        current, total = [], 0
        for name, numel in params:
            if s >= len(sizes) or groups[s] != group_id:
                return None
            current.append((name, numel))
            total += numel
            if total == sizes[s]:
                layout.append((group_id, tuple(current)))
                current, total, s = [], 0, s + 1
            elif total > sizes[s]:
                return None
        if current:
            return None
    return layout if s == len(sizes) else None


def _positions(layout: Layout) -> dict[str, tuple[int, int, int]]:
    """name -> (sub group, offset, numel)."""
    out = {}
    for i, (_, params) in enumerate(layout):
        offset = 0
        for name, numel in params:
            out[name] = (i, offset, numel)
            offset += numel
    return out


class Recut:
    """Copies a checkpoint's per-sub-group tensors into sub groups cut another way, one target
    sub group at a time (no full copy of the checkpoint is ever made)."""

    def __init__(self, source: Layout, target: Layout):
        src, dst = _positions(source), _positions(target)
        missing, extra = sorted(dst.keys() - src.keys()), sorted(src.keys() - dst.keys())
        if missing or extra:
            raise CheckpointLayoutError(
                f"the checkpoint and this optimizer hold different params (not in the "
                f"checkpoint: {missing[:5]}; only in the checkpoint: {extra[:5]}): resume with "
                "the model, frozen params and param groups that saved it."
            )
        for name, (_, _, numel) in dst.items():
            if src[name][2] != numel:
                raise CheckpointLayoutError(
                    f"{name}: {src[name][2]} elements per rank in the checkpoint, {numel} here: "
                    "a different number of ranks needs DeepSpeed's universal checkpoint "
                    '(ds_to_universal, then "load_universal": true in the checkpoint config).'
                )
        groups_src = {name: source[i][0] for name, (i, _, _) in src.items()}
        for name, (i, _, _) in dst.items():
            if groups_src[name] != target[i][0]:
                raise CheckpointLayoutError(
                    f"{name} is in param group {groups_src[name]} in the checkpoint and in "
                    f"{target[i][0]} here: resume with the param groups that saved it."
                )
        self.sources: list[
            list[tuple[int, int, int, int]]
        ] = []  # (src sub group, src off, dst off, n)
        for _, params in target:
            self.sources.append([(src[name][0], src[name][1], dst[name][1], dst[name][2])
                                 for name, _ in params])  # fmt: skip
        self.identity = source == target
        # After which target sub group each saved one is read for the last time.
        last = {s: t for t, runs in enumerate(self.sources) for s, _, _, _ in runs}
        self.done_after = [
            sorted(s for s, t_last in last.items() if t_last == t) for t in range(len(target))
        ]

    def source_sub_groups(self, target: int) -> set[int]:
        return {s for s, _, _, _ in self.sources[target]}

    def copy_into(self, target: int, into: torch.Tensor, saved: list[torch.Tensor]) -> None:
        """Fill target sub group ``target`` (``into``, flat) from the saved flats ``saved``."""
        for s, src_offset, dst_offset, numel in self.sources[target]:
            into.narrow(0, dst_offset, numel).copy_(saved[s].narrow(0, src_offset, numel))

    def tensors(
        self, saved: list[torch.Tensor], like: list[torch.Tensor]
    ) -> Iterator[torch.Tensor]:
        """New tensors in the target cut (for DeepSpeed's own loader, which wants them whole)."""
        for t, ref in enumerate(like):
            out = torch.empty(ref.numel(), dtype=saved[0].dtype)
            self.copy_into(t, out, saved)
            yield out
