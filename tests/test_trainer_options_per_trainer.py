"""Each SuperOffload trainer on DeepSpeed hands its own options to the ZeRO-3 optimizer that
its train() builds: the options go through the environment, so a trainer made later in the same
process (a notebook, a sweep) must neither inherit an earlier trainer's options nor leave its own
to the earlier one's train(); after train() none of them is left for a later optimizer of the
process, and the user's own variables are back.

Runs in a subprocess (one CPU rank, DeepSpeed's CPU accelerator), as tests/test_refusal_order.py
does; the parent Trainer's train() is replaced by one that records what the ZeRO-3 optimizer
would resolve at that moment (``SuperOffloadOptions()``, as zero3/options.resolve_options reads).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from ranks import one_cpu_rank_env

_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import transformers
    from hf_superoffload import SuperOffloadTrainer, SuperOffloadTrainingArguments
    from hf_superoffload.integrations.plugin import SuperOffloadOptions
    from hf_superoffload.toy import build_tiny_llama
    from zero3_reference import trainer_zero3_config

    seen = []

    def recording_train(self, *args, **kwargs):
        options = SuperOffloadOptions()
        seen.append({"moments": options.moments, "speculate": options.speculate})

    transformers.Trainer.train = recording_train

    def trainer(name, **fields):
        args = SuperOffloadTrainingArguments(
            output_dir=os.path.join(sys.argv[1], name), use_cpu=True, report_to=[], bf16=False,
            deepspeed=trainer_zero3_config(), **fields,
        )
        return SuperOffloadTrainer(model=build_tiny_llama(), args=args)

    first = trainer("first", superoffload_moments="compact", superoffload_speculate=False)
    second = trainer("second")
    after_second = os.environ.get("HF_SUPEROFFLOAD_SPECULATE")
    first.train()
    second.train()
    first.train()
    print(json.dumps({"seen": seen, "after_second": after_second,
                      "moments_left": os.environ.get("HF_SUPEROFFLOAD_MOMENTS"),
                      "speculate_left": os.environ.get("HF_SUPEROFFLOAD_SPECULATE")}))
    """
)


def test_each_trainer_hands_its_own_options_to_its_optimizer(tmp_path):
    env = one_cpu_rank_env(HF_SUPEROFFLOAD_SPECULATE="true")  # the user's own setting
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    first = {"moments": "compact", "speculate": False}
    second = {"moments": "fp32", "speculate": True}  # no options: defaults and the user's
    assert out["seen"] == [first, second, first]
    assert out["after_second"] == "true"  # the user's value is back once the second is made
    # After train() nothing of a trainer's is left for a later optimizer; the user's value is.
    assert out["moments_left"] is None
    assert out["speculate_left"] == "true"


def test_a_train_that_raises_leaves_none_of_its_options(monkeypatch):
    from hf_superoffload.zero3.config import zero3_options_exported

    monkeypatch.delenv("HF_SUPEROFFLOAD_MOMENTS", raising=False)
    monkeypatch.setenv("HF_SUPEROFFLOAD_SPECULATE", "true")  # the user's own setting
    with (
        pytest.raises(RuntimeError),
        zero3_options_exported({"moments": "compact", "speculate": False}),
    ):
        assert os.environ["HF_SUPEROFFLOAD_MOMENTS"] == "compact"
        assert os.environ["HF_SUPEROFFLOAD_SPECULATE"] == "false"
        raise RuntimeError("train() failed")
    assert "HF_SUPEROFFLOAD_MOMENTS" not in os.environ
    assert os.environ["HF_SUPEROFFLOAD_SPECULATE"] == "true"
