"""The base optimizer DeepSpeed's ZeRO-3 gets on the ``super_offload`` path.

DeepSpeed (for an Adam/AdamW ``"optimizer"`` in its config) and accelerate (for the Trainer's
AdamW, with ``offload_optimizer`` set) would build ``DeepSpeedCPUAdam``, whose constructor
JIT-compiles DeepSpeed's C++ CPU Adam (about 5 minutes on first use on a 2-core CPU, 44 s on a
16-core GPU host). On this path that optimizer never steps: SuperOffloadZero3Optimizer's kernels
step every sub group, and the base optimizer only holds the param groups (the hyperparameters
an LR scheduler writes) and the Adam state keyed by the fp32 partitions.

``HostAdamState`` is that holder, built with ``DeepSpeedCPUAdam``'s arguments: the same param
group keys, its ``adam_w_mode``, and the state it would keep (an int ``step``, ``exp_avg``,
``exp_avg_sq``), so that checkpoints move between this path and DeepSpeed's plain CPU offload.
Its ``step`` refuses: a call would mean something other than our optimizer tried to step.
"""

from __future__ import annotations

import torch


class HostAdamState(torch.optim.Optimizer):
    def __init__(
        self,
        model_params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ):
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "bias_correction": bias_correction,
            "amsgrad": amsgrad,
        }
        super().__init__(model_params, defaults)
        self.adam_w_mode = adamw_mode
        self.fp32_optimizer_states = fp32_optimizer_states

    @classmethod
    def in_place_of(cls, optimizer: torch.optim.Optimizer) -> HostAdamState:
        """What accelerate's ``map_pytorch_optim_to_deepspeed`` would build from the Trainer's
        (or a loop's) ``optimizer``, without the build: over the same param group dicts (an LR
        scheduler made for ``optimizer`` still reaches them), ``lr`` and ``weight_decay`` from
        its defaults, AdamW mode for ``torch.optim.AdamW``."""
        defaults = {k: v for k, v in optimizer.defaults.items() if k in ("lr", "weight_decay")}
        adamw = isinstance(optimizer, torch.optim.AdamW)
        return cls(optimizer.param_groups, **defaults, adamw_mode=adamw)

    def add_param_group(self, param_group: dict) -> None:
        if param_group.get("amsgrad", self.defaults["amsgrad"]):
            raise ValueError("amsgrad is not supported by super_offload; set amsgrad=False.")
        super().add_param_group(param_group)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)

    def step(self, closure=None):
        raise RuntimeError(
            "HostAdamState holds the Adam state that hf_superoffload's ZeRO-3 optimizer "
            "(SuperOffloadZero3Optimizer) steps with its own kernels; it does not step itself. "
            "Step the DeepSpeed engine (engine.step()), not its base optimizer."
        )
