"""What the memory plan reads of a model: its params (sizes, order, which the Trainer decays),
its decoder layers and widths, from the config alone (built on the meta device)."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class ModelShape:
    params: int
    largest_param: int
    layers: int
    hidden: int
    vocab: int
    layer_params: int  # the largest decoder layer's
    active_intermediate: int  # MLP width a token goes through (top-k experts' in MoE)
    # Every param in the model's order (named_parameters): its elements, and whether the
    # Trainer decays it (its first param group; norms and biases go to the second).
    param_numels: tuple[int, ...] = dataclasses.field(default=(), repr=False)
    param_decays: tuple[bool, ...] = dataclasses.field(default=(), repr=False)

    @classmethod
    def of(cls, config) -> ModelShape:
        import transformers

        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        named = list(model.named_parameters())
        sizes = [p.numel() for _, p in named]
        # The Trainer's own rule (it reads nothing of the Trainer but the model).
        decays = set(transformers.Trainer.get_decay_parameter_names(None, model))
        layers = _decoder_layers(model)
        return cls(
            params=sum(sizes),
            largest_param=max(sizes),
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            vocab=config.vocab_size,
            layer_params=max(sum(p.numel() for p in layer.parameters()) for layer in layers),
            active_intermediate=active_intermediate(config),
            param_numels=tuple(sizes),
            param_decays=tuple(name in decays for name, _ in named),
        )


def active_intermediate(config) -> int:
    """The MLP width one token goes through: its top-k experts' in an MoE.

    An expert's width is ``moe_intermediate_size`` where the config has one (Qwen3-MoE, whose
    ``intermediate_size`` is its dense layers'), else ``intermediate_size`` (GPT-OSS, whose
    experts are all of it). Counting a single expert there planned GPT-OSS-20B's recomputed
    layer 4x too narrow (0.8 GiB low at seq 4096 x batch 4)."""
    experts = getattr(config, "num_local_experts", 0) or getattr(config, "num_experts", 0) or 0
    top_k = getattr(config, "num_experts_per_tok", 0) or 0
    if not (experts and top_k):
        return config.intermediate_size
    expert_width = getattr(config, "moe_intermediate_size", 0) or config.intermediate_size
    return top_k * expert_width


def _decoder_layers(model) -> list[torch.nn.Module]:
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and module[0] is not None:
            return list(module)
    raise ValueError(
        f"{type(model).__name__} has no list of decoder layers to plan for; the memory plan "
        f"covers decoder-only models (a ModuleList of layers), such as the configs in "
        f"hf_superoffload/model_configs."
    )
