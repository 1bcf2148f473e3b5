"""``HF_SUPEROFFLOAD_DEEPSPEED=0`` in a plain script (``deepspeed.initialize``, or the
``deepspeed.zero.Init`` that transformers enters to load a model under ZeRO-3, transformers'
Trainer), ``hf_superoffload`` imported: a DeepSpeed config that asks for SuperOffload builds
DeepSpeed's own, which reads none of the engine's ``HF_SUPEROFFLOAD_*`` variables. Those set are
refused when DeepSpeed (or, for the Trainer, accelerate, with the training arguments) first
reads the config, before anything is built (no param is partitioned); without them, or with the
package's engine on, the same config is read as before.

The model card a SuperOffload trainer writes under the opt-out names what trained the model:
DeepSpeed's own SuperOffload, not this package's engine.

Each case runs in a subprocess: the switch is read when ``hf_superoffload`` is imported.
"""

from __future__ import annotations

import json
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
    from deepspeed.runtime.config import DeepSpeedConfig

    def config(super_offload):
        offload = {"device": "cpu", "pin_memory": False, "super_offload": super_offload}
        return {
            "train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": 3, "offload_optimizer": offload},
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
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    out = {}
    for value in (True, "hf_superoffload"):  # DeepSpeed's value and the shipped configs'
        out[f"initialize {value}"] = refusal(
            lambda: deepspeed.initialize(model=model, config=config(value))
        )
    out["partitioned"] = any(hasattr(p, "ds_id") for p in model.parameters())

    def load_under_zero_init():
        with deepspeed.zero.Init(config_dict_or_path=config(True)):
            torch.nn.Linear(8, 8)

    out["zero.Init"] = refusal(load_under_zero_init)
    # transformers' Trainer: its arguments read the config through accelerate, which builds
    # DeepSpeed's CPU Adam before deepspeed.initialize; refused with the arguments.
    from transformers import TrainingArguments

    def arguments(value):
        return TrainingArguments(
            output_dir=os.environ["OUT_DIR"], use_cpu=True, report_to=[], deepspeed=config(value)
        )

    out["TrainingArguments"] = refusal(lambda: arguments(True))
    out["plain ZeRO-3"] = refusal(lambda: DeepSpeedConfig(config(False)))
    print(json.dumps(out))
    """
)

_PARSE = textwrap.dedent(
    """
    import json
    import hf_superoffload
    from deepspeed.runtime.config import DeepSpeedConfig

    offload = {"device": "cpu", "super_offload": "hf_superoffload"}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "offload_optimizer": offload},
    }
    print(json.dumps(DeepSpeedConfig(config).zero_config.offload_optimizer.super_offload))
    """
)


def _run(script: str, **variables: str) -> subprocess.CompletedProcess:
    env = one_cpu_rank_env(**variables)
    return subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )


def test_a_plain_script_under_the_opt_out_refuses_the_engine_variables(tmp_path):
    done = _run(
        _SCRIPT,
        OUT_DIR=str(tmp_path),
        HF_SUPEROFFLOAD_DEEPSPEED="0",
        HF_SUPEROFFLOAD_SPECULATE="false",
        HF_SUPEROFFLOAD_MOMENTS="compact",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    routes = ("initialize True", "initialize hf_superoffload", "zero.Init", "TrainingArguments")
    for route in routes:
        message = out[route]
        assert message is not None, f"{route}: not refused"
        assert message.startswith("HF_SUPEROFFLOAD_DEEPSPEED=0: DeepSpeed builds its own")
        assert "does not read HF_SUPEROFFLOAD_SPECULATE, HF_SUPEROFFLOAD_MOMENTS" in message
        assert "Unset them to run DeepSpeed's own" in message
        assert "superoffload_options" not in message  # no trainer argument to drop here
    assert out["partitioned"] is False  # refused before DeepSpeed built anything
    # No SuperOffload asked for: reading it refuses nothing (an optimizer built from it does:
    # test_engine_variables_unread.py).
    assert out["plain ZeRO-3"] is None


def test_the_same_config_reads_as_before_without_the_variables_or_the_opt_out():
    for variables in (
        {"HF_SUPEROFFLOAD_DEEPSPEED": "0"},  # DeepSpeed's own SuperOffload, nothing unread
        {"HF_SUPEROFFLOAD_DEEPSPEED": "1", "HF_SUPEROFFLOAD_SPECULATE": "false"},  # ours reads it
    ):
        done = _run(_PARSE, **variables)
        assert done.returncode == 0, f"{variables}: {done.stderr[-3000:]}"
        assert json.loads(done.stdout.splitlines()[-1]) is True


# A SuperOffload trainer on DeepSpeed whose engine built DeepSpeed's optimizer: what the card
# reads of it (a stand-in: DeepSpeed's own SuperOffload needs a CUDA GPU).
_CARD = textwrap.dedent(
    """
    import json, os, types
    import torch
    from hf_superoffload.integrations.model_card import add_superoffload_section

    out_dir = os.environ["OUT_DIR"]
    args = types.SimpleNamespace(
        output_dir=out_dir, per_device_train_batch_size=1, gradient_accumulation_steps=1
    )
    trainer = types.SimpleNamespace(
        args=args,
        accelerator=types.SimpleNamespace(unwrap_model=lambda model: model, num_processes=1),
        model=torch.nn.Linear(2, 2),
        state=types.SimpleNamespace(log_history=[]),
        deepspeed=types.SimpleNamespace(optimizer=type("SuperOffloadOptimizer_Stage3", (), {})()),
        is_deepspeed_enabled=True,
        _on_deepspeed=True,
        _stv_optimizer=None,
        _explicit_options=lambda: {},
    )
    path = os.path.join(out_dir, "README.md")
    add_superoffload_section(trainer, path, ["superoffload"], [])
    print(json.dumps(open(path, encoding="utf-8").read()))
    """
)


def _card(tmp_path, switch: str) -> str:
    out_dir = tmp_path / switch
    out_dir.mkdir()
    done = _run(_CARD, OUT_DIR=str(out_dir), HF_SUPEROFFLOAD_DEEPSPEED=switch)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_the_card_under_the_opt_out_names_deepspeeds_own_superoffload(tmp_path):
    card = _card(tmp_path, "0")
    assert "Trained with DeepSpeed's own SuperOffload optimizer on ZeRO-3" in card
    assert "trainer with `HF_SUPEROFFLOAD_DEEPSPEED=0` (`hf_superoffload`'s own engine did" in card
    assert "Trained with `hf_superoffload`" not in card
    assert "speculation-then-validation CPU-offloaded Adam" not in card
    assert "| HF_SUPEROFFLOAD_DEEPSPEED | `0` |" in card  # the switch, to reproduce the run
    ours = _card(tmp_path, "1")
    assert "Trained with `hf_superoffload` (SuperOffload: speculation-then-validation" in ours
    assert "DeepSpeed's own SuperOffload" not in ours
