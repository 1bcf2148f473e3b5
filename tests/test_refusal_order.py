"""A SuperOffload trainer given a DeepSpeed config refuses what it cannot run before it changes
anything: the DeepSpeed config the training arguments hold (accelerate builds the engine from
it; the trainer turns on its ``super_offload``), the config dict the user passed, and the
environment (the engine options the trainer hands to the ZeRO-3 optimizer). A refused trainer
leaves the arguments as the parent Trainer's own set-up left them, so that they can be used
again (a plain Trainer, another try) without a SuperOffload flag or an option nobody asked for.

Each case runs in a subprocess (one CPU rank, DeepSpeed's CPU accelerator): the trainer sets up
DeepSpeed's distributed state, and the opt-out is read when ``hf_superoffload`` is imported.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from ranks import one_cpu_rank_env

_SCRIPT = textwrap.dedent(
    """
    import copy, json, os, sys
    import transformers
    from hf_superoffload import SuperOffloadTrainer, SuperOffloadTrainingArguments
    from hf_superoffload.integrations.plugin import SuperOffloadOptions
    from hf_superoffload.toy import build_tiny_llama
    from zero3_reference import trainer_zero3_config

    def engine_env():
        return {k: v for k, v in os.environ.items() if k.startswith("HF_SUPEROFFLOAD_")}

    # The held config as the parent Trainer's __init__ leaves it (accelerate writes its
    # "fp16": {"enabled": false} there for any Trainer): what the mixin may not change.
    parent_init, after_parent = transformers.Trainer.__init__, []

    def recording_init(self, *args, **kwargs):
        parent_init(self, *args, **kwargs)
        after_parent.append(copy.deepcopy(self.args.deepspeed_plugin.deepspeed_config))

    transformers.Trainer.__init__ = recording_init

    def case(output_dir, fields, options=None):
        user = trainer_zero3_config()  # no "super_offload": the trainer would turn it on
        args = SuperOffloadTrainingArguments(
            output_dir=output_dir, use_cpu=True, report_to=[], bf16=False, deepspeed=user,
            **fields,
        )
        held = args.deepspeed_plugin.deepspeed_config  # what accelerate builds the engine from
        before = copy.deepcopy(user), engine_env()
        after_parent.clear()
        try:
            SuperOffloadTrainer(model=build_tiny_llama(), args=args, superoffload_options=options)
            refused = None
        except ValueError as error:
            refused = str(error)
        return {
            "refused": refused,
            "user config": user == before[0],
            "held config": held is args.deepspeed_plugin.deepspeed_config
            and [held] == after_parent,
            "environment": engine_env() == before[1],
            "flag": held["zero_optimization"]["offload_optimizer"].get("super_offload"),
            "exported": sorted(set(engine_env().items()) - set(before[1].items())),
        }

    out_dir, cases = sys.argv[1], json.loads(sys.argv[2])
    out = {}
    for name, (fields, options) in cases.items():
        options = None if options is None else SuperOffloadOptions(**options)
        out[name] = case(os.path.join(out_dir, name), fields, options)
    print(json.dumps(out))
    """
)


def _run(tmp_path, cases: dict, **variables: str) -> dict:
    env = one_cpu_rank_env(**variables)
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path), json.dumps(cases)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


UNCHANGED = {"user config": True, "held config": True, "environment": True}


def test_a_refused_trainer_left_the_config_and_the_environment_as_they_were(tmp_path):
    save_dtype = {"superoffload_speculate": False, "superoffload_save_dtype": "bfloat16"}
    out = _run(
        tmp_path,
        {
            # DeepSpeed's config replaces the bucket size: refused with the options.
            "replaced option": [{}, {"bucket_size": 512, "speculate": False}],
            # Refused after the engine options would have been handed over.
            "save dtype": [save_dtype, None],
            # Accepted (last: it changes the environment): the flag is on, the option handed.
            "accepted": [{"superoffload_speculate": False}, None],
        },
    )
    accepted = out.pop("accepted")
    replaced, save_dtype = out["replaced option"]["refused"], out["save dtype"]["refused"]
    assert "bucket_size -> zero_optimization.sub_group_size" in replaced
    assert "superoffload_save_dtype applies to the standalone engine" in save_dtype
    for name, found in out.items():
        assert {k: found[k] for k in UNCHANGED} == UNCHANGED, name
        assert found["flag"] is None and found["exported"] == [], name
    assert accepted["refused"] is None and accepted["flag"] is True
    assert accepted["exported"] == [["HF_SUPEROFFLOAD_SPECULATE", "false"]]


def test_under_the_opt_out_the_refused_trainer_left_the_config_as_it_was(tmp_path):
    out = _run(
        tmp_path, {"opt-out": [{"superoffload_speculate": False}, None]},
        HF_SUPEROFFLOAD_DEEPSPEED="0",
    )  # fmt: skip
    found = out["opt-out"]
    assert "HF_SUPEROFFLOAD_DEEPSPEED=0: DeepSpeed builds its own" in found["refused"]
    assert "superoffload_speculate" in found["refused"]
    assert {k: found[k] for k in UNCHANGED} == UNCHANGED
    assert found["flag"] is None and found["exported"] == []


def test_the_save_dtype_variable_is_refused_when_the_trainer_is_made(tmp_path):
    """HF_SUPEROFFLOAD_SAVE_DTYPE is refused where its argument is (the trainer's __init__,
    before any change), with the engine on and under the opt-out."""
    out = _run(
        tmp_path, {"variable": [{}, None]}, HF_SUPEROFFLOAD_SAVE_DTYPE="bfloat16"
    )  # fmt: skip
    found = out["variable"]
    assert "HF_SUPEROFFLOAD_SAVE_DTYPE=bfloat16 applies to the standalone engine" in (
        found["refused"] or ""
    )
    assert {k: found[k] for k in UNCHANGED} == UNCHANGED
    assert found["flag"] is None and found["exported"] == []
    out = _run(
        tmp_path, {"opt-out": [{}, None]},
        HF_SUPEROFFLOAD_SAVE_DTYPE="bfloat16", HF_SUPEROFFLOAD_DEEPSPEED="0",
    )  # fmt: skip
    found = out["opt-out"]
    assert "HF_SUPEROFFLOAD_DEEPSPEED=0" in (found["refused"] or "")
    assert "HF_SUPEROFFLOAD_SAVE_DTYPE" in found["refused"]
    assert {k: found[k] for k in UNCHANGED} == UNCHANGED
