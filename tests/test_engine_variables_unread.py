"""Engine variables (``HF_SUPEROFFLOAD_*`` that only hf_superoffload's ZeRO-3 optimizer reads)
set beside a DeepSpeed config that asks for no SuperOffload, ``hf_superoffload`` imported:
DeepSpeed builds its own optimizer, which reads none of them, so they are refused, naming them
and what to change, before anything is built: when DeepSpeed's engine is about to build an
optimizer from the config (``deepspeed.initialize``), and when a Trainer other than the
SuperOffload ones is made with it (before ``train()`` builds DeepSpeed's CPU Adam).

Reading such a config refuses nothing: ``zero.Init`` (the model's load), the training arguments
(a SuperOffload trainer turns ``super_offload`` on in their config) and an engine that builds no
optimizer (TRL's reference model, inference) train nothing with it. Without the variables the
same configs train.

Each case runs in a subprocess: the opt-out is read when ``hf_superoffload`` is imported. The
script records the ops DeepSpeed loads: a refused run has not built or loaded its CPU Adam.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from ranks import one_cpu_rank_env

_SCRIPT = textwrap.dedent(
    """
    import json, os
    import torch
    import hf_superoffload
    import deepspeed
    from deepspeed.ops.op_builder.builder import OpBuilder
    from deepspeed.runtime.config import DeepSpeedConfig

    loaded, load = [], OpBuilder.load  # the ops DeepSpeed builds or loads

    def recording_load(self, *args, **kwargs):
        loaded.append(self.name)
        return load(self, *args, **kwargs)

    OpBuilder.load = recording_load

    def config(stage, device="cpu"):
        zero = {"stage": stage}
        if device is not None:
            zero["offload_optimizer"] = {"device": device, "pin_memory": False}
        return {
            "train_micro_batch_size_per_gpu": 1,
            "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        }

    def refusal(build):
        try:
            build()
        except ValueError as error:
            return str(error)
        return None

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)

    def model():
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))

    out = {}
    built = model()
    for name, stage, device in (("zero3", 3, "cpu"), ("zero2", 2, "cpu"), ("zero3 none", 3, None)):
        # ZeRO-Offload on stage 3 or 2, and ZeRO-3 without offload.
        out[f"initialize {name}"] = refusal(
            lambda: deepspeed.initialize(model=built, config=config(stage, device))
        )
    out["partitioned"] = any(hasattr(p, "ds_id") for p in built.parameters())
    # A client optimizer in place of the config's.
    no_section = {k: v for k, v in config(3).items() if k != "optimizer"}
    out["initialize client optimizer"] = refusal(
        lambda: deepspeed.initialize(
            model=built, config=no_section, optimizer=torch.optim.AdamW(built.parameters())
        )
    )
    # Nothing trains: read, the model loaded under zero.Init, an engine without an optimizer.
    passed = {}
    passed["read"] = refusal(lambda: DeepSpeedConfig(config(2)))

    def load_under_zero_init():
        with deepspeed.zero.Init(config_dict_or_path=config(3)):
            torch.nn.Linear(8, 8)

    passed["zero.Init"] = refusal(load_under_zero_init)
    reference = {**no_section, "zero_optimization": {"stage": 3}}  # as TRL's for its ref model
    passed["initialize without optimizer"] = refusal(
        lambda: deepspeed.initialize(model=model(), config=reference)
    )
    # transformers' Trainer: its arguments read the config through accelerate.
    from transformers import Trainer, TrainingArguments
    from hf_superoffload.toy import build_tiny_llama

    def arguments(stage):
        return TrainingArguments(
            output_dir=os.environ["OUT_DIR"], use_cpu=True, report_to=[], bf16=False,
            deepspeed=config(stage), max_steps=1,
        )

    for stage in (3, 2):
        passed[f"TrainingArguments zero{stage}"] = refusal(lambda: arguments(stage))
        args = arguments(stage)
        out[f"Trainer zero{stage}"] = refusal(
            lambda: Trainer(model=build_tiny_llama(), args=args, train_dataset=[])
        )
    # A SuperOffload trainer turns super_offload on in the same ZeRO-3 config: ours reads them.
    from hf_superoffload import SuperOffloadTrainer

    args = arguments(3)
    out["SuperOffloadTrainer zero3"] = refusal(
        lambda: SuperOffloadTrainer(model=build_tiny_llama(), args=args, train_dataset=[])
    )
    offload = args.deepspeed_plugin.deepspeed_config["zero_optimization"]["offload_optimizer"]
    out["flag"] = offload.get("super_offload")
    out["passed"] = passed
    out["built"] = loaded
    print(json.dumps(out))
    """
)

# Without the variables: the same plain ZeRO-3 CPU-offload config trains a step through
# deepspeed.initialize (DeepSpeed's own ZeRO-3 optimizer), and ZeRO-2 is read.
_RUNS = textwrap.dedent(
    """
    import json
    import torch
    import hf_superoffload
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    offload = {"device": "cpu", "pin_memory": False}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "offload_optimizer": offload},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    DeepSpeedConfig({**config, "zero_optimization": {"stage": 2, "offload_optimizer": offload}})
    engine, *_ = deepspeed.initialize(model=model, config=config)
    loss = engine(torch.randn(1, 8)).sum()
    engine.backward(loss)
    engine.step()
    print(json.dumps({"optimizer": type(engine.optimizer).__name__, "steps": engine.global_steps}))
    """
)


# A training loop of the user's through accelerate: accelerate builds DeepSpeed's CPU Adam for
# a CPU-offload config before deepspeed.initialize.
_ACCELERATE = textwrap.dedent(
    """
    import json
    import torch
    import hf_superoffload
    from deepspeed.ops.op_builder.builder import OpBuilder
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    loaded, load = [], OpBuilder.load

    def recording_load(self, *args, **kwargs):
        loaded.append(self.name)
        return load(self, *args, **kwargs)

    OpBuilder.load = recording_load
    offload = {"device": "cpu", "pin_memory": False}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "offload_optimizer": offload},
    }
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    model = torch.nn.Linear(8, 2)
    try:
        accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        refused = None
    except ValueError as error:
        refused = str(error)
    print(json.dumps({"refused": refused, "built": loaded}))
    """
)


def _run(script: str, tmp_path, **variables: str) -> subprocess.CompletedProcess:
    env = one_cpu_rank_env(OUT_DIR=str(tmp_path), **variables)
    return subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )


def _refusals(tmp_path, **variables: str) -> dict:
    done = _run(_SCRIPT, tmp_path, **variables)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


ROUTES = (
    "initialize zero3",
    "initialize zero2",
    "initialize zero3 none",
    "initialize client optimizer",
    "Trainer zero3",
    "Trainer zero2",
)


def test_a_config_without_super_offload_refuses_the_engine_variables_set(tmp_path):
    out = _refusals(tmp_path, HF_SUPEROFFLOAD_CPU_THREADS="14", HF_SUPEROFFLOAD_MOMENTS="compact")
    for route in ROUTES:
        message = out[route]
        assert message is not None, f"{route}: not refused"
        assert message.startswith("This DeepSpeed config asks for no SuperOffload"), route
        assert "reads none of HF_SUPEROFFLOAD_CPU_THREADS, HF_SUPEROFFLOAD_MOMENTS" in message
        assert "Unset them to run this config" in message
        assert '"super_offload": true to offload_optimizer on ZeRO stage 3' in message
        assert "HF_SUPEROFFLOAD_DEEPSPEED" not in message  # the engine is on
    assert "stage 2, offload_optimizer.device 'cpu'" in out["initialize zero2"]
    assert "stage 3, offload_optimizer.device None" in out["initialize zero3 none"]
    assert out["passed"] == dict.fromkeys(out["passed"])  # nothing trains there: no refusal
    assert out["SuperOffloadTrainer zero3"] is None and out["flag"] is True
    assert out["partitioned"] is False  # refused before DeepSpeed built anything
    assert "cpu_adam" not in out["built"]  # and before it built its CPU Adam


def test_under_the_opt_out_the_same_configs_refuse_them_naming_the_switch(tmp_path):
    out = _refusals(tmp_path, HF_SUPEROFFLOAD_DEEPSPEED="0", HF_SUPEROFFLOAD_SPECULATE="false")
    for route in ROUTES:
        message = out[route]
        assert message is not None, f"{route}: not refused"
        assert message.startswith("This DeepSpeed config asks for no SuperOffload"), route
        assert "reads none of HF_SUPEROFFLOAD_SPECULATE (" in message
        assert "and unset HF_SUPEROFFLOAD_DEEPSPEED to run hf_superoffload's engine" in message
    assert out["passed"] == dict.fromkeys(out["passed"])
    assert out["partitioned"] is False and "cpu_adam" not in out["built"]
    # The SuperOffload trainer refuses them as before: DeepSpeed's own would not read them.
    assert out["SuperOffloadTrainer zero3"].startswith("HF_SUPEROFFLOAD_DEEPSPEED=0: DeepSpeed")
    assert out["flag"] is None


def test_without_engine_variables_the_plain_config_trains(tmp_path):
    """Variables of the package that are no engine options (the host check's, the metrics')
    are not refused."""
    done = _run(
        _RUNS, tmp_path, HF_SUPEROFFLOAD_HOST_MEMORY_GIB="64", HF_SUPEROFFLOAD_PEAK_TFLOPS="1"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out == {"optimizer": "DeepSpeedZeroOptimizer_Stage3", "steps": 1}


def test_a_trainer_exported_option_is_not_the_users_setting():
    """A SuperOffload trainer hands its arguments over through the environment: a later plain
    run of the same process is not refused for them, but is for a variable the user set."""
    from hf_superoffload.zero3 import config

    saved = dict(os.environ), dict(config._EXPORTED)
    try:
        for name in config.ENGINE_VARIABLES:
            os.environ.pop(name, None)
        os.environ["HF_SUPEROFFLOAD_CAST"] = "cpu"  # the user's
        config._EXPORTED.clear()
        config.export_zero3_options({"moments": "compact", "cast": "gpu"})
        assert os.environ["HF_SUPEROFFLOAD_MOMENTS"] == "compact"
        assert config.engine_variables_set() == ["HF_SUPEROFFLOAD_CAST"]
        os.environ["HF_SUPEROFFLOAD_MOMENTS"] = "fp32"  # changed since: the user's again
        assert config.engine_variables_set() == ["HF_SUPEROFFLOAD_CAST", "HF_SUPEROFFLOAD_MOMENTS"]
    finally:
        os.environ.clear()
        os.environ.update(saved[0])
        config._EXPORTED.clear()
        config._EXPORTED.update(saved[1])


def test_an_accelerate_loop_is_refused_before_deepspeeds_cpu_adam(tmp_path):
    outs = []
    for variables in ({"HF_SUPEROFFLOAD_MOMENTS": "compact"}, {}):
        done = _run(_ACCELERATE, tmp_path, **variables)
        assert done.returncode == 0, done.stderr[-3000:]
        outs.append(json.loads(done.stdout.splitlines()[-1]))
    refused, runs = outs
    assert refused["refused"].startswith("This DeepSpeed config asks for no SuperOffload")
    assert "reads none of HF_SUPEROFFLOAD_MOMENTS (" in refused["refused"]
    assert "cpu_adam" not in refused["built"]
    assert runs["refused"] is None and "cpu_adam" in runs["built"]  # what it would have built
