"""The model card keeps secrets out and reports the STV counters the logs report (CPU, a few
seconds; nothing touches the network).

``push_to_hub`` uploads README.md, so the launch command and the recipe it embeds must not
carry ``--hub_token`` (either form), ``--wandb_api_key`` or a ``hub_token:`` key: their values
read ``***`` and everything else stays exact. The card's rollback counters come from the
snapshot train() keeps at its end (each counter the largest over the ranks, as logged), not
from this rank's optimizer, while the optimizer has taken no step since.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may touch the network

import shlex
import sys

import pytest
import torch
from cpu_trainer_args import cpu_training_args

from hf_superoffload import SuperOffloadTrainer, SuperOffloadTrainingArguments
from hf_superoffload.integrations import model_card
from hf_superoffload.toy import build_tiny_llama, tiny_llama_config

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

HUB_TOKEN = "hf_NOTREALsecretTOKEN123"
WANDB_KEY = "wandbNOTREALkey456"
RECIPE_TOKEN = "hf_NOTREALrecipeTOKEN789"
OLD_TOKEN = "hf_NOTREALcommentedTOKEN000"
FLOW_TOKEN = "hf_NOTREALflowTOKEN321"
JSON_TOKEN = "hf_NOTREALjsonTOKEN654"
SECRETS = (HUB_TOKEN, WANDB_KEY, RECIPE_TOKEN, OLD_TOKEN, FLOW_TOKEN, JSON_TOKEN)

RECIPE = f"""\
model_name_or_path: org/tiny-llama
hub_token: {RECIPE_TOKEN}  # mine
# hub_token: {OLD_TOKEN}
eos_token: "<|end|>"
model_init_kwargs: {{revision: main, token: {FLOW_TOKEN}}}
average_tokens_across_devices: true
learning_rate: 0.001
"""
RECIPE_SHOWN = """\
model_name_or_path: org/tiny-llama
hub_token: "***"
# hub_token: "***"
eos_token: "<|end|>"
model_init_kwargs: {revision: main, token: '***'}
average_tokens_across_devices: true
learning_rate: 0.001"""


def _trainer(output_dir, steps: int = 0) -> SuperOffloadTrainer:
    config = tiny_llama_config(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4)
    model = build_tiny_llama(config, seed=0)
    ids = torch.randint(4, 64, (16, 16), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": row, "labels": row.clone()} for row in ids]
    args = SuperOffloadTrainingArguments(
        **cpu_training_args(
            output_dir, superoffload_bucket_size=1 << 12, max_steps=max(steps, 1),
            per_device_train_batch_size=4, learning_rate=1e-3,
        )
    )  # fmt: skip
    trainer = SuperOffloadTrainer(model=model, args=args, train_dataset=rows)
    if steps:
        trainer.train()
    return trainer


def _readme(trainer) -> str:
    trainer.create_model_card()  # what push_to_hub calls
    with open(os.path.join(trainer.args.output_dir, "README.md"), encoding="utf-8") as card:
        return card.read()


def test_card_shows_secret_options_and_recipe_keys_as_stars(tmp_path, monkeypatch):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE)
    argv = ["examples/sft.py", "--config", str(recipe), "--hub_token", HUB_TOKEN]
    argv += [f"--wandb_api_key={WANDB_KEY}", "--eos_token", "<|end|>"]
    argv += ["--model_init_kwargs", f'{{"token":"{JSON_TOKEN}"}}']
    argv += ["--average_tokens_across_devices", "true", "--push_to_hub", "true"]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(sys, "orig_argv", ["/venv/bin/python", *argv])
    monkeypatch.setattr(model_card, "_ancestor_cmdlines", lambda: iter(()))
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)

    text = _readme(_trainer(tmp_path / "run"))
    for secret in SECRETS:
        assert secret not in text
    # The command as it ran, but for the two secrets (shlex quotes ``***`` for the shell).
    shown = ["python", "examples/sft.py", "--config", str(recipe), "--hub_token", "***"]
    shown += ["--wandb_api_key=***", "--eos_token", "<|end|>"]
    shown += ["--model_init_kwargs", '{"token": "***"}']
    shown += ["--average_tokens_across_devices", "true", "--push_to_hub", "true"]
    assert f"```bash\n{shlex.join(shown)}\n```" in text
    assert f"```yaml\n{RECIPE_SHOWN}\n```" in text


def test_accelerate_launch_command_shows_secrets_as_stars(tmp_path, monkeypatch):
    """Under ``accelerate launch`` the command is the launcher's (read from /proc), with the
    secret in either form and with a dash in its name."""
    (tmp_path / "gpu.yaml").write_text("mixed_precision: bf16\napi_key: NOTREALconfigKEY\n")
    launcher = ["/venv/bin/python", "/venv/bin/accelerate", "launch", "--config_file"]
    launcher += ["gpu.yaml", "train.py", f"--hub-token={HUB_TOKEN}", "--token", WANDB_KEY]
    monkeypatch.setattr(model_card, "_ancestor_cmdlines", lambda: iter([(launcher, str(tmp_path))]))
    run = model_card.launch()
    assert run["command"] == (
        "accelerate launch --config_file gpu.yaml train.py '--hub-token=***' --token '***'"
    )
    block = model_card._file_block("accelerate config", run["accelerate_config"])
    assert 'mixed_precision: bf16\napi_key: "***"\n```' in block
    assert "NOTREALconfigKEY" not in block


def test_card_reports_the_all_ranks_counters_of_the_snapshot(tmp_path, monkeypatch):
    """Another rank rolled back more (the logs' counters are the largest over the ranks): the
    card gives the snapshot train() kept, not this rank's optimizer's counters; once the
    optimizer steps again (a later train()), the snapshot is stale and its own are given."""
    trainer = _trainer(tmp_path / "run", steps=3)
    optimizer = trainer.superoffload_optimizer
    live = optimizer.stats
    assert live["steps"] == 3
    keys = ("speculative_steps", "rollbacks_clip", "rollbacks_nonfinite")
    all_ranks = {key: live[key] + 1 + i for i, key in enumerate(keys)}
    trainer.superoffload_stats = {**trainer.superoffload_stats, **all_ranks}

    text = _readme(trainer)
    assert f"| optimizer steps speculated | `{all_ranks['speculative_steps']}` |" in text
    assert f"| rollbacks: gradient clipping | `{all_ranks['rollbacks_clip']}` |" in text
    assert f"| rollbacks: non-finite gradients | `{all_ranks['rollbacks_nonfinite']}` |" in text

    trainer.superoffload_stats = {**trainer.superoffload_stats, "steps": 2}  # before a step
    text = _readme(trainer)
    assert f"| optimizer steps speculated | `{live['speculative_steps']}` |" in text
    assert f"| rollbacks: gradient clipping | `{live['rollbacks_clip']}` |" in text
    assert f"| rollbacks: non-finite gradients | `{live['rollbacks_nonfinite']}` |" in text
    assert "| STV counters |" not in text  # one process: its counters are all there are
    # With other processes, the card says whose counters these are.
    monkeypatch.setattr(type(trainer.accelerator), "num_processes", property(lambda _: 2))
    text = _readme(trainer)
    assert (
        "| STV counters | `the main process's, during training (the logs give the largest of 2)` |"
        in text
    )
    optimizer.close()


def test_a_secret_over_several_lines_or_in_json_is_hidden_whole():
    from hf_superoffload.integrations.card_secrets import redact_yaml

    block = f"run:\n  api_key: |\n    {HUB_TOKEN}\n    {WANDB_KEY}\n\n  seed: 0\n"
    assert redact_yaml(block) == 'run:\n  api_key: "***"\n\n  seed: 0\n'
    json = f'{{\n  "token": "{OLD_TOKEN}",\n  "eos_token": "</s>"\n}}\n'
    assert redact_yaml(json) == '{\n  "token": "***",\n  "eos_token": "</s>"\n}\n'


def test_secret_keys_inside_flow_values_are_hidden_and_the_syntax_kept():
    """A YAML flow collection or JSON value (a recipe's ``model_init_kwargs: {token: X}``, the
    command's ``--model_init_kwargs '{"token": "X"}'``) is read, its secret keys are hidden at
    any depth, and it is written back as it came: YAML as YAML, JSON as JSON."""
    from hf_superoffload.integrations.card_secrets import redact_argv, redact_yaml

    shown = {
        "model_init_kwargs: {token: hf_SECRET1}": "model_init_kwargs: {token: '***'}",
        "a: {a: {api_key: hf_SECRET2}, b: 1}  # why": "a: {a: {api_key: '***'}, b: 1}",
        "- {name: x, password: hf_SECRET3}": "- {name: x, password: '***'}",
        "  list: [{a: 1}, [{token: hf_SECRET4}]]": "  list: [{a: 1}, [{token: '***'}]]",
        '  "kwargs": {"token": "hf_SECRET5", "n": 2},': '  "kwargs": {"token": "***", "n": 2},',
        '{"a": [{"secret": "hf_SECRET6"}]}': '{"a": [{"secret": "***"}]}',
        # A JSON string inside YAML (``--model_init_kwargs`` copied into a recipe).
        'kwargs: \'{"token": "hf_SECRET7"}\'': 'kwargs: \'{"token": "***"}\'',
        # The whole value of a secret key, whatever it holds.
        "kw: {credentials: {user: me, pass: hf_SECRET8}}": "kw: {credentials: '***'}",
    }
    for line, expected in shown.items():
        assert redact_yaml(f"{line}\nseed: 0\n") == f"{expected}\nseed: 0\n", line

    argv = ["train.py", "--model_init_kwargs", '{"token":"hf_SECRET9"}', "--seed", "0"]
    argv += ['--model_init_kwargs={"token": "hf_SECRET10", "n": [1]}']
    argv += ["--dataset_kwargs", "{a: [{api_key: hf_SECRET11}]}", '[{"key": "hf_SECRET12"}]']
    assert redact_argv(argv) == [
        "train.py", "--model_init_kwargs", '{"token": "***"}', "--seed", "0",
        '--model_init_kwargs={"token": "***", "n": [1]}',
        "--dataset_kwargs", "{a: [{api_key: '***'}]}", '[{"key": "***"}]',
    ]  # fmt: skip


def test_flow_values_without_a_secret_are_left_byte_for_byte():
    """Nothing to hide: the spacing, quoting, comments and key order the user wrote stay."""
    from hf_superoffload.integrations.card_secrets import redact_argv, redact_yaml

    recipe = (
        "model_init_kwargs: {torch_dtype: bfloat16,   attn_implementation: 'sdpa'}  # mine\n"
        'lr_scheduler_kwargs: {"min_lr_rate":0.1}\n'
        "special: {eos_token: '</s>', pad_token: <pad>, num_tokens: 3}\n"
        "report_to: [wandb, trackio]\n"
        "- {z: 1, a: [2, 3]}\n"
        'chat_template: "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"\n'
        "kwargs: {\n  revision: main,\n  n: 1\n}\n"
    )
    assert redact_yaml(recipe) == recipe
    argv = ["--model_init_kwargs", '{"torch_dtype":"bfloat16" ,"eos_token":"</s>"}']
    argv += ['--lr_scheduler_kwargs={"min_lr_rate": 0.1}', "--chat_template", "{{ bos_token }}"]
    assert redact_argv(argv) == argv


def test_a_flow_value_that_cannot_be_read_but_names_a_secret_is_hidden_whole():
    from hf_superoffload.integrations.card_secrets import redact_argv, redact_yaml

    # A flow collection over several lines: its first line cannot be read on its own.
    text = "kwargs: {token: hf_SECRET1,\n    revision: main}\nseed: 0\n"
    assert redact_yaml(text) == 'kwargs: "***"\nseed: 0\n'
    assert redact_yaml("- [{api_key: hf_SECRET2}\n") == '- "***"\n'
    assert redact_argv(["--kw", '{"token": "hf_SECRET3"']) == ["--kw", "***"]
    assert redact_argv(['--kw={"token": hf_SECRET4']) == ["--kw=***"]
    # One that names no secret is left as it is.
    assert (
        redact_yaml("kwargs: {revision: main,\n  n: 1}\n") == "kwargs: {revision: main,\n  n: 1}\n"
    )
