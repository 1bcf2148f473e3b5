"""How DeepSpeed is set up for the ZeRO-3 path, on one CPU rank (DeepSpeed's CPU accelerator,
gloo).

- Nothing that never steps is built: DeepSpeed (for an "AdamW" in its config) and accelerate
  (for the Trainer's AdamW) would build DeepSpeed's CPU Adam, whose op takes minutes to compile
  on first use, only to hold the state our kernels step. HostAdamState holds it instead, in
  the CPU Adam's format, and the run equals DeepSpeed's plain CPU offload on that CPU Adam.
- An optimizer this path does not step is refused by the package, saying what to change,
  before DeepSpeed or accelerate builds anything for it.
"""

from __future__ import annotations

import pytest
import torch
from ranks import spawn_ranks
from zero3_reference import (
    TOLERANCES,
    Zero3Case,
    assert_states_close,
    build_model,
    free_port,
    init_rank,
    make_engine,
    optimizer_state,
    train,
)

CASE = Zero3Case(deepspeed_adam=True, steps=3, max_grad_norm=1.0)


def _format(zero) -> dict:
    """The layout of the base optimizer's state in a checkpoint (the ZeRO-3 optimizer's
    state_dict): param group keys, state keys, step type."""
    saved = zero.state_dict()["optimizer_state_dict"]
    entries = list(saved["state"].values())
    return {
        "group_keys": sorted({k for g in saved["param_groups"] for k in g if k != "params"}),
        "state_keys": sorted({k for e in entries for k in e}),
        "step_types": sorted({type(e["step"]).__name__ for e in entries}),
    }


def _with_deepspeed_adamw_in_the_config(rank, port, out_dir) -> None:
    init_rank(rank, 1, port)
    torch.set_num_threads(1)
    from deepspeed.ops.op_builder.builder import OpBuilder

    import hf_superoffload  # noqa: F401

    loads = []
    original = OpBuilder.load

    def recording_load(self, *args, **kwargs):
        loads.append(self.name)
        return original(self, *args, **kwargs)

    OpBuilder.load = recording_load
    engine, optimizer = make_engine(CASE, True, 1)
    ours_loads = list(loads)
    assert type(optimizer).__name__ == "SuperOffloadZero3Optimizer"
    train(engine, CASE, rank, range(CASE.steps))
    ours = {"state": optimizer_state(engine), "base": type(optimizer.optimizer).__name__,
            "format": _format(optimizer)}  # fmt: skip
    engine.destroy()

    engine, optimizer = make_engine(CASE, False, 1)  # DeepSpeed's plain offload: its CPU Adam
    train(engine, CASE, rank, range(CASE.steps))
    ref = {"state": optimizer_state(engine), "base": type(optimizer.optimizer).__name__,
           "format": _format(optimizer)}  # fmt: skip
    engine.destroy()
    torch.save({"ours": ours, "ref": ref, "loads": ours_loads}, f"{out_dir}/result.pt")


@pytest.mark.slow  # DeepSpeed's CPU Adam, the reference, is a JIT build of minutes
def test_an_adamw_in_the_config_builds_no_cpu_adam_and_follows_deepspeeds_cpu_adam(tmp_path):
    spawn_ranks(_with_deepspeed_adamw_in_the_config, (free_port(), str(tmp_path)), world=1)
    result = torch.load(tmp_path / "result.pt", weights_only=False)
    ours, ref = result["ours"], result["ref"]
    assert result["loads"] == [], f"DeepSpeed ops built or loaded for our run: {result['loads']}"
    assert (ours["base"], ref["base"]) == ("HostAdamState", "DeepSpeedCPUAdam")
    # Checkpoints hold the same layout as DeepSpeed's plain CPU offload writes.
    assert ours["format"] == ref["format"]
    assert ours["format"]["step_types"] == ["int"]
    assert_states_close(ours["state"], ref["state"], TOLERANCES, "ours vs DeepSpeed's CPU Adam")


def _refusals(rank, port, out_dir) -> None:
    init_rank(rank, 1, port)
    torch.set_num_threads(1)
    import accelerate.accelerator
    import deepspeed
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    import hf_superoffload  # noqa: F401
    from hf_superoffload.zero3.base_optimizer import HostAdamState

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "super_offload": "hf_superoffload"},
        },
    }
    errors = {}
    lamb = {**config, "optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}
    model = build_model()
    try:
        deepspeed.initialize(model=model, config=lamb, model_parameters=model.parameters())
    except Exception as error:  # the type and message are compared
        errors["lamb"] = (type(error).__name__, str(error))

    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    model = build_model()
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
    try:
        accelerator.prepare(model, sgd)
    except Exception as error:
        errors["sgd"] = (type(error).__name__, str(error))
    # What accelerate hands DeepSpeed for the Trainer's AdamW, over the same param groups.
    adamw = torch.optim.AdamW(build_model().parameters(), lr=1e-3, weight_decay=0.1)
    mapped = accelerate.accelerator.map_pytorch_optim_to_deepspeed(adamw)
    errors["mapped"] = (type(mapped).__name__, mapped.param_groups[0] is adamw.param_groups[0])
    assert isinstance(mapped, HostAdamState)
    torch.save(errors, f"{out_dir}/errors.pt")


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("refusals")
    spawn_ranks(_refusals, (free_port(), str(out)), world=1)
    return torch.load(out / "errors.pt", weights_only=False)


def test_another_optimizer_in_the_config_gets_the_packages_refusal(refusals):
    kind, message = refusals["lamb"]
    assert kind == "ValueError", message
    assert "super_offload steps AdamW on the CPU" in message and "'lamb'" in message
    assert '"AdamW"' in message  # what to change


def test_another_client_optimizer_is_refused_not_turned_into_a_cpu_adam(refusals):
    kind, message = refusals["sgd"]
    assert kind == "ValueError", message
    assert "the optimizer is SGD" in message


def test_accelerate_hands_deepspeed_a_state_holder_over_the_trainers_groups(refusals):
    # The same group dicts: an LR scheduler built for the Trainer's AdamW still reaches them.
    assert refusals["mapped"] == ("HostAdamState", True)
