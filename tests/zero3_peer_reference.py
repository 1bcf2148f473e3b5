"""Small models, configs and readers for tests/test_zero3_peer_cases.py: the cases of DeepSpeed's
own ZeRO-3 CPU-offload unit tests, each run on DeepSpeed's plain CPU offload (the reference) and
on ``"super_offload": true`` (ours) in one rank process, and compared tensor by tensor.

Everything here runs inside a rank that ``zero3_reference.init_rank`` has set up (DeepSpeed's CPU
accelerator and gloo on CPU).
"""

from __future__ import annotations

import dataclasses
import os

import torch
from engine_reference import PARAM_TOL

HIDDEN = 11  # odd: every param's partition over two ranks ends in padding
# DeepSpeed 0.19.8's ZeRO-3 writers of full-size values (set_fp32_grad_for_param,
# update_fp32_grad_for_param_vectorized, set_full_hp_param in runtime/zero/stage3.py) slice
# each rank's share as value[share * rank : share * (rank + 1)], past the end of the value on
# the last rank when the param's size does not divide by the ranks: that rank raises and the
# others wait in their next collective. Even: every param divides by two ranks.
WHOLE_SHARES_HIDDEN = 12
BATCH = 2


class PeerNet(torch.nn.Module):
    """A stack of ``layers`` square linear layers with ReLU between and a cross-entropy loss over
    ``HIDDEN`` classes. ``frozen`` freezes the first layer; ``tied`` makes the last layer share
    the weight of the one before it."""

    def __init__(self, layers: int = 3, frozen: bool = False, tied: bool = False, hidden=HIDDEN):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(layers))
        if tied:
            self.layers[-1].weight = self.layers[-2].weight
        if frozen:
            self.layers[0].requires_grad_(False)

    def forward(self, x, y):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = torch.relu(x)
        return torch.nn.functional.cross_entropy(x.float(), y)


@dataclasses.dataclass(frozen=True)
class PeerSetup:
    """One engine's configuration; ``config(super_offload)`` gives the DeepSpeed config."""

    accumulation: int = 1
    clip: float = 0.0
    bf16: bool = False
    sub_group_size: int = 200
    persistence_threshold: int = 0  # 0: every param partitioned
    offload_param: bool = False
    # "AdamW" in the config (DeepSpeed builds its CPU Adam) or the client's torch.optim.Adam
    client_adam: bool = False
    force_ds_cpu_optimizer: bool = False
    lr: float = 1e-2
    weight_decay: float = 0.01
    two_groups: bool = False  # client AdamW over weights (decay) and biases (no decay)
    layers: int = 3
    frozen: bool = False
    tied: bool = False
    zero_init: bool = False  # build the model under deepspeed.zero.Init
    # WHOLE_SHARES_HIDDEN for the cases that write full-size values (safe_set_full_*)
    hidden: int = HIDDEN

    def replace(self, **changes) -> PeerSetup:
        return dataclasses.replace(self, **changes)

    def config(self, super_offload: bool, world: int) -> dict:
        offload = {"device": "cpu", "pin_memory": False}
        if super_offload:
            offload["super_offload"] = True
        config = {
            "train_micro_batch_size_per_gpu": BATCH,
            "gradient_accumulation_steps": self.accumulation,
            "train_batch_size": BATCH * self.accumulation * world,
            "gradient_clipping": self.clip,
            "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": self.force_ds_cpu_optimizer,
            "steps_per_print": 10**9,
            "zero_optimization": {
                "stage": 3,
                "sub_group_size": self.sub_group_size,
                "reduce_bucket_size": 500,
                "stage3_param_persistence_threshold": self.persistence_threshold,
                "stage3_gather_16bit_weights_on_model_save": True,  # save_16bit_model writes
                "offload_optimizer": offload,
            },
        }
        if self.offload_param:
            config["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": False}
        if self.bf16:
            config["bf16"] = {"enabled": True}
        if not (self.client_adam or self.two_groups):
            config["optimizer"] = {
                "type": "AdamW",
                "params": {"lr": self.lr, "eps": 1e-6, "weight_decay": self.weight_decay},
            }
        return config


def build_engine(setup: PeerSetup, super_offload: bool, world: int, seed: int = 0):
    """A DeepSpeed engine over a fresh ``PeerNet`` (the same initial weights for a given seed)."""
    import deepspeed

    config = setup.config(super_offload, world)
    torch.manual_seed(seed)
    if setup.zero_init:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = PeerNet(setup.layers, setup.frozen, setup.tied, setup.hidden)
    else:
        model = PeerNet(setup.layers, setup.frozen, setup.tied, setup.hidden)
    trainable = [p for p in model.parameters() if p.requires_grad]
    kwargs = {"model": model, "config": config}
    if setup.two_groups:
        groups = [
            {"params": [p for p in trainable if p.ndim == 2], "weight_decay": setup.weight_decay},
            {"params": [p for p in trainable if p.ndim == 1], "weight_decay": 0.0},
        ]
        kwargs["optimizer"] = torch.optim.AdamW(groups, lr=setup.lr, eps=1e-6)
    elif setup.client_adam:
        kwargs["optimizer"] = torch.optim.Adam(trainable, lr=setup.lr, eps=1e-6)
    else:
        kwargs["model_parameters"] = trainable
    engine, *_ = deepspeed.initialize(**kwargs)
    return engine


def micro_batch(step: int, micro: int, rank: int, dtype=torch.float32, hidden: int = HIDDEN):
    generator = torch.Generator().manual_seed(7919 * step + 31 * micro + rank)
    x = torch.randn(BATCH, hidden, generator=generator).to(dtype)
    y = torch.randint(0, hidden, (BATCH,), generator=generator)
    return x, y


def input_dtype(engine) -> torch.dtype:
    return torch.bfloat16 if engine.bfloat16_enabled() else torch.float32


def train_steps(engine, steps: range, rank: int) -> list[float]:
    """``engine.backward`` and ``engine.step`` per micro batch, as DeepSpeed's tests train."""
    losses = []
    for step in steps:
        for micro in range(engine.gradient_accumulation_steps()):
            hidden = engine.module.layers[0].in_features
            loss = engine(*micro_batch(step, micro, rank, input_dtype(engine), hidden))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
    return losses


def sync(engine) -> None:
    """Our optimizer steps on a worker thread after step() returns; read after it is done."""
    if hasattr(engine.optimizer, "synchronize"):
        engine.optimizer.synchronize()


def trainable_state(engine) -> dict:
    """This rank's partition of each trainable param's fp32 master and Adam moments (None for a
    frozen param), in module order, and the step count of every sub group."""
    sync(engine)
    zero = engine.optimizer
    out = {"master": [], "exp_avg": [], "exp_avg_sq": []}
    for param in engine.module.parameters():
        if not param.requires_grad:
            for key in out:
                out[key].append(None)
            continue
        i, offset, _ = zero.grad_position[zero.get_param_id(param)]
        numel = real_numel(param)
        flat = zero.fp32_partitioned_groups_flat[i]
        out["master"].append(flat.detach().narrow(0, offset, numel).float().clone())
        state = zero.optimizer.state[flat]
        for key in ("exp_avg", "exp_avg_sq"):
            value = state[key].narrow(0, offset, numel) if key in state else None
            out[key].append(None if value is None else value.float().clone())
    out["step"] = sorted(
        {int(zero.optimizer.state[f].get("step", 0)) for f in zero.fp32_partitioned_groups_flat}
    )
    return out


def real_numel(param) -> int:
    """How many elements of this rank's partition of ``param`` are the param's (the rest, on
    the last ranks, is padding: issue 24 item 5 has ours step it from uninitialised memory,
    so the comparisons of the other cases leave it out)."""
    import deepspeed.comm as dist

    size = param.ds_tensor.numel()
    return max(0, min(size, param.ds_numel - size * dist.get_rank()))


def padding(engine) -> dict[str, torch.Tensor]:
    """The padding elements of this rank's fp32 master partitions, per param name."""
    sync(engine)
    zero = engine.optimizer
    out = {}
    for name, param in engine.module.named_parameters():
        if param.requires_grad:
            i, offset, size = zero.grad_position[zero.get_param_id(param)]
            real = real_numel(param)
            flat = zero.fp32_partitioned_groups_flat[i]
            out[name] = flat.detach().narrow(0, offset + real, size - real).float().clone()
    return out


def sub_group_steps(engine) -> list[int]:
    """The step count of each sub group, in order (DeepSpeed keeps one per sub group)."""
    sync(engine)
    zero = engine.optimizer
    return [int(zero.optimizer.state[f]["step"]) for f in zero.fp32_partitioned_groups_flat]


def gathered_params(engine) -> dict[str, torch.Tensor]:
    """Every param of the module, whole (all-gathered), by name, in fp32."""
    import deepspeed

    sync(engine)
    out = {}
    for name, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters(param, modifier_rank=None):
            out[name] = param.detach().float().clone()
    return out


def full_fragments(engine, with_grads: bool, with_moments: bool) -> dict[str, dict]:
    """DeepSpeed's tensor-fragment API (``safe_get_full_*``) per param name: the fp32 master,
    and the gradient and moments when asked; None where DeepSpeed answers None (frozen)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad
    from deepspeed.utils import safe_get_full_optimizer_state as state_of

    out = {}
    for name, param in engine.module.named_parameters():
        entry = {"fp32": _clone(safe_get_full_fp32_param(param))}
        if with_grads:
            entry["grad"] = _clone(safe_get_full_grad(param))
        if with_moments:
            entry["exp_avg"] = _clone(state_of(param, "exp_avg"))
            entry["exp_avg_sq"] = _clone(state_of(param, "exp_avg_sq"))
        out[name] = entry
    return out


def local_fragments(engine, with_grads: bool, with_moments: bool) -> dict[str, dict]:
    """As ``full_fragments``, through the local (this rank's partition) accessors."""
    from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_grad
    from deepspeed.utils import safe_get_local_optimizer_state as state_of

    out = {}
    for name, param in engine.module.named_parameters():
        real = real_numel(param)  # the partition's padding left out
        entry = {"fp32": _clone(safe_get_local_fp32_param(param), real)}
        if with_grads:
            entry["grad"] = _clone(safe_get_local_grad(param), real)
        if with_moments:
            entry["exp_avg"] = _clone(state_of(param, "exp_avg"), real)
            entry["exp_avg_sq"] = _clone(state_of(param, "exp_avg_sq"), real)
        out[name] = entry
    return out


def _clone(tensor, numel: int | None = None):
    if tensor is None:
        return None
    tensor = tensor.detach().float().cpu()
    return (tensor if numel is None else tensor.flatten()[:numel]).clone()


def values_for(engine, seed: int, key: str) -> dict[str, torch.Tensor]:
    """Deterministic full-size values per trainable param (the same on every rank), to write
    through the tensor-fragment API: positive for ``exp_avg_sq``."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, param in engine.module.named_parameters():
        if param.requires_grad:
            shape = param.ds_shape if hasattr(param, "ds_shape") else param.shape
            value = torch.randn(shape, generator=generator) * 0.1
            out[name] = value.abs() * 1e-3 if key == "exp_avg_sq" else value
    return out


def assert_close_dicts(got, want, what: str, tolerances=None, exact: bool = False) -> None:
    """Nested dicts / lists of tensors (or None), compared leaf by leaf: bit for bit with
    ``exact``, else with ``tolerances[key]`` for the innermost dict key that has one
    (PARAM_TOL for the others)."""
    _compare(got, want, what, tolerances or {}, exact, PARAM_TOL)


def _compare(got, want, what, tolerances, exact, tol) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict), f"{what}: {type(got).__name__}, want a dict"
        assert set(got) == set(want), f"{what}: keys {sorted(got)} != {sorted(want)}"
        for key in want:
            inner = tolerances.get(key, tol) if isinstance(key, str) else tol
            _compare(got[key], want[key], f"{what}[{key}]", tolerances, exact, inner)
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{what}: {len(got)} items != {len(want)}"
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            _compare(a, b, f"{what}[{i}]", tolerances, exact, tol)
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{what}: {type(got).__name__}, want a tensor"
        bounds = {"rtol": 0.0, "atol": 0.0} if exact else tol
        torch.testing.assert_close(got, want, **bounds, msg=lambda m: f"{what}: {m}")
    else:
        assert got == want, f"{what}: {got!r} != {want!r}"


def rank_dir(root: str, name: str, mode: str) -> str:
    """A checkpoint folder shared by the ranks of one case and mode."""
    path = os.path.join(root, name, mode)
    os.makedirs(path, exist_ok=True)
    return path
