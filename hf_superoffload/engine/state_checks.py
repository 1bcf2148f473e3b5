"""What ``load_state_dict`` checks before it writes anything (state_io.py): the param groups'
sizes, each entry's keys, shapes, dtypes and step, the hyperparameters and torch's AdamW
switches of each saved group, and the extra key's predicted clip coefficient. Each refusal is a
ValueError that says what to change.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from .checks import HYPER_KEYS, check_group

EXTRA_KEY = "superoffload"
MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
# A compact entry's tensors (CompactMoments.tensors' order): uint8 codes under MOMENT_KEYS,
# and each moment's block scales.
COMPACT_STATE_KEYS = ("exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale")
COMPACT_SCALE_KEYS = COMPACT_STATE_KEYS[1::2]

# Keys torch's Adam/AdamW put into every param group that are no hyperparameters of ours: what
# each must be for us to continue the run faithfully (None: any value; an implementation
# detail). ``decoupled_weight_decay`` is checked with the group's weight decay.
_TORCH_ADAM_SWITCHES = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "fused": None,
    "capturable": None,
    "differentiable": None,
    "decoupled_weight_decay": None,
}


def _group_sizes(groups: list[dict]) -> list[int]:
    return [len(group["params"]) for group in groups]


def check_group_sizes(groups: list[dict], saved_groups: list) -> None:
    ours = _group_sizes(groups)
    try:
        theirs = _group_sizes(saved_groups)
    except (TypeError, KeyError) as exc:
        raise ValueError(
            "state_dict's 'param_groups' must be a list of dicts each with a 'params' list of "
            "param ids, as optimizer.state_dict() writes them."
        ) from exc
    if ours == theirs:
        return
    if len(ours) != len(theirs):
        what = f"{len(theirs)} param groups, this optimizer has {len(ours)}"
    else:
        diff = [
            f"group {g}: {t} vs {o} here"
            for g, (t, o) in enumerate(zip(theirs, ours, strict=True))
            if t != o
        ]
        what = f"param groups of other sizes ({'; '.join(diff)})"
    raise ValueError(
        f"state_dict has {what}. Params per group: state_dict {theirs} ({sum(theirs)} in all), "
        f"this optimizer {ours} ({sum(ours)} in all). Build SuperOffloadOptimizer with the same "
        f"param groups, holding the same params in the same order, as the optimizer that saved "
        f"it (the HF Trainer's is [decay params, no-decay params]: "
        f"Trainer.get_decay_parameter_names)."
    )


def lookup(where: dict, key) -> tuple[int, int, torch.Tensor]:
    for candidate in (key, param_number(key)):
        if candidate is not None and candidate in where:
            return where[candidate]
    raise ValueError(
        f"state_dict has state for param id {key!r}, which is in none of its param groups' "
        f"'params' lists; the state dict is inconsistent. Save it again from the optimizer "
        f"(optimizer.state_dict()), or drop that entry of its 'state'."
    )


def param_number(key) -> int | None:
    try:
        return int(key)
    except (TypeError, ValueError):
        return None


def checked_entry(slot: Mapping, key, g: int, j: int, param: torch.Tensor, entry) -> dict:
    """The entry with its tensors' shapes checked and its step as an int (``slot``: the
    optimizer's params with state, by id)."""
    what = f"state_dict entry {key!r} (param group {g}, param {j})"
    if id(param) not in slot:
        raise ValueError(
            f"{what} has optimizer state, but that param does not require grad here "
            f"(SuperOffloadOptimizer keeps no state for it); load into a model with the same "
            f"trainable params, or drop the entry."
        )
    if not isinstance(entry, Mapping):
        raise ValueError(
            f"{what} is a {type(entry).__name__}, not a dict of state (exp_avg, exp_avg_sq, "
            f"step): load a state dict saved by SuperOffloadOptimizer or torch.optim.AdamW."
        )
    missing = [k for k in (*MOMENT_KEYS, "step") if k not in entry]
    if missing:
        raise ValueError(
            f"{what} lacks {missing} (has {sorted(entry)}); SuperOffloadOptimizer loads its own "
            f"state dicts and torch.optim.AdamW's (exp_avg, exp_avg_sq, step)."
        )
    if "max_exp_avg_sq" in entry:
        raise ValueError(f"{what} holds amsgrad's max_exp_avg_sq; {_AMSGRAD}")
    compact = isinstance(entry.get("exp_avg"), torch.Tensor) and entry["exp_avg"].dtype == (
        torch.uint8
    )
    for k in ("master", *MOMENT_KEYS):
        if k == "master" and "master" not in entry:
            continue
        tensor = entry[k]
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(
                f"{what}: {k} is a {type(tensor).__name__}, not a tensor: load a state dict "
                f"saved by SuperOffloadOptimizer or torch.optim.AdamW."
            )
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(
                f"{what}: {k} has shape {tuple(tensor.shape)}, the param here has "
                f"{tuple(param.shape)}; load into the same model, with the params in the same "
                f"order within the same param groups as when it was saved."
            )
        codes = compact and k in MOMENT_KEYS
        if codes and tensor.dtype != torch.uint8:
            raise ValueError(
                f"{what}: exp_avg holds compact codes (uint8) but {k} is {tensor.dtype}; both "
                f"moments of an entry are compact or neither: load the state dict as saved."
            )
        if not codes and not tensor.is_floating_point():
            raise ValueError(
                f"{what}: {k} has dtype {tensor.dtype}, not a floating-point one: load a state "
                f"dict saved by SuperOffloadOptimizer or torch.optim.AdamW."
            )
    if compact:
        _check_compact_scales(what, entry, param.numel())
    step = entry["step"]
    value = float(step.item() if isinstance(step, torch.Tensor) else step)
    if not (math.isfinite(value) and value >= 0 and value == int(value)):
        raise ValueError(f"{what}: step must be a whole number >= 0, got {step!r}.")
    return {**entry, "step": int(value)}


def _check_compact_scales(what: str, entry: Mapping, numel: int) -> None:
    """A compact entry's block scales: one fp32 per block of the param's codes."""
    from .compact_moments import blocks_of  # here: compact_moments -> ops

    for key in COMPACT_SCALE_KEYS:
        scale = entry.get(key)
        ok = isinstance(scale, torch.Tensor) and scale.dtype == torch.float32
        if not ok or tuple(scale.shape) != (blocks_of(numel),):
            got = (
                f"{scale.dtype} {tuple(scale.shape)}" if isinstance(scale, torch.Tensor) else scale
            )
            raise ValueError(
                f"{what}: a compact entry needs {key}, fp32 of shape ({blocks_of(numel)},) (one "
                f"a block of the param's codes), got {got!r}: load the state dict as saved."
            )


_AMSGRAD = (
    "SuperOffloadOptimizer implements AdamW without amsgrad, so it cannot continue this run "
    "faithfully; resume it with torch.optim.AdamW(amsgrad=True), or start the moments afresh."
)


def loaded_hypers(g: int, saved: Mapping, group: dict) -> dict:
    """The saved group's keys to take over (all but 'params' and torch's AdamW switches),
    checked: a switch we cannot honour, or hyperparameters we refuse, raise."""
    where = f"state_dict's param group {g}"
    for key, allowed in _TORCH_ADAM_SWITCHES.items():
        if allowed is not None and key in saved and bool(saved[key]) != allowed:
            if key == "amsgrad":
                raise ValueError(f"{where} has amsgrad=True; {_AMSGRAD}")
            raise ValueError(
                f"{where} has maximize=True (gradient ascent); SuperOffloadOptimizer minimizes. "
                f"Negate the loss instead, and start the moments afresh."
            )
    hyper = {k: v for k, v in saved.items() if k != "params" and k not in _TORCH_ADAM_SWITCHES}
    for key in ("lr", "eps", "weight_decay"):
        if isinstance(hyper.get(key), torch.Tensor):
            hyper[key] = float(hyper[key])
    if "betas" in hyper:
        hyper["betas"] = tuple(float(b) for b in hyper["betas"])
    weight_decay = hyper.get("weight_decay", group["weight_decay"])
    if saved.get("decoupled_weight_decay") is False and weight_decay:
        raise ValueError(
            f"{where} comes from torch.optim.Adam with weight_decay={weight_decay}, an L2 "
            f"penalty added to the gradients; SuperOffloadOptimizer's weight decay is AdamW's "
            f"(decoupled), so the run would change. Resume it with torch.optim.Adam, or convert "
            f"deliberately (set the group's weight_decay to 0, or decoupled_weight_decay=True)."
        )
    merged = {
        **{k: group[k] for k in HYPER_KEYS},
        **{k: hyper[k] for k in HYPER_KEYS if k in hyper},
    }
    try:
        check_group({"params": [], **merged})
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from exc
    return hyper


def loaded_predicted_coef(state_dict: Mapping) -> float:
    extra = state_dict.get(EXTRA_KEY)
    if extra is None:
        return 1.0  # an older checkpoint, or torch's AdamW: as if no step had clipped
    coef = extra.get("predicted_coef", 1.0) if isinstance(extra, Mapping) else None
    if not isinstance(coef, (int, float)) or not 0.0 < coef <= 1.0:
        raise ValueError(
            f"state_dict[{EXTRA_KEY!r}] must be a dict with a 'predicted_coef' in (0, 1] (the "
            f"last clip coefficient), got {extra!r}; drop the key to load as if no step had "
            f"clipped."
        )
    return float(coef)
