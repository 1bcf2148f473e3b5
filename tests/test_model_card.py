"""The model card a SuperOffload trainer writes to output_dir/README.md (CPU, a few seconds).

A 3-step run of the tiny random Llama of `hf_superoffload.toy`, with `SuperOffloadTrainer` and
with `SuperOffloadSFTTrainer`: the card is written where the parent writes its own
(`create_model_card`, which `push_to_hub` calls, and TRL's checkpoint saves), not by train()
alone; it parses with
`huggingface_hub.ModelCard.load`, carries our tags and card data, keeps what the parent's card
function wrote, and its Reproduce section holds the versions, the command and a tokens/s
figure. Nothing here touches the network (`push_to_hub` is never called).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may touch the network

import re
import shlex
import sys

import pytest
import torch
from cpu_trainer_args import cpu_training_args
from datasets import Dataset
from huggingface_hub import ModelCard

from hf_superoffload import SuperOffloadTrainer, SuperOffloadTrainingArguments, __version__
from hf_superoffload.integrations import model_card
from hf_superoffload.toy import build_tiny_llama, make_char_tokenizer, tiny_llama_config

STEPS = 3
TRAINING = {"max_steps": STEPS, "per_device_train_batch_size": 4, "learning_rate": 1e-3}


# One intra-op thread for these tiny models (conftest.py says why).
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _tiny_model(name_or_path: str = "org/tiny-llama"):
    config = tiny_llama_config(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4)
    model = build_tiny_llama(config, seed=0)
    model.config._name_or_path = name_or_path  # as from_pretrained("org/tiny-llama") sets it
    return model


def _token_rows(n: int = 32):
    ids = torch.randint(4, 64, (n, 16), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def _reproduce(card: ModelCard) -> str:
    assert card.text.count(model_card.BEGIN) == 1 and card.text.count(model_card.END) == 1
    return card.text.split(model_card.BEGIN)[1].split(model_card.END)[0]


def _assert_reproduce_section(section: str) -> None:
    assert model_card.HEADING in section
    for heading in ("Command", "Versions", "Hardware", "Training arguments", "Results"):
        assert f"### {heading}" in section
    for package in ("torch", "transformers", "accelerate", "trl", "deepspeed", "hf_superoffload"):
        assert f"| {package} |" in section
    assert f"| hf_superoffload | `{__version__}` |" in section
    assert f"| torch | `{torch.__version__}` |" in section
    assert shlex.join(sys.argv[1:]) in section  # the command that ran (here: pytest's)
    assert re.search(r"\| tokens/s \| `\d+\.\d \(median of \d+ logging intervals\)`", section)
    assert "| rollbacks: gradient clipping |" in section
    assert "| rollbacks: non-finite gradients |" in section
    assert "| learning_rate | `0.001` |" in section
    assert "| max_grad_norm |" in section and "| seed | `0` |" in section
    assert "| GPU | `none (CPU)` |" in section or "| GPU | `1 x" in section
    assert "| host memory |" in section and "| bucket_size | `4096` |" in section


def test_train_writes_no_card_and_create_model_card_does(tmp_path):
    output_dir = tmp_path / "run"
    args = SuperOffloadTrainingArguments(
        **cpu_training_args(output_dir, superoffload_bucket_size=1 << 12, **TRAINING)
    )
    trainer = SuperOffloadTrainer(model=_tiny_model(), args=args, train_dataset=_token_rows())
    trainer.train()
    trainer.superoffload_optimizer.close()
    path = output_dir / "README.md"
    assert not path.exists()  # the plain Trainer writes none unasked either

    trainer.create_model_card()  # what push_to_hub calls
    card = ModelCard.load(path)
    assert "superoffload" in card.data.tags
    assert "generated_from_trainer" in card.data.tags  # the Trainer's own card is kept
    assert card.data.base_model == "org/tiny-llama"
    assert card.data.library_name == "transformers"
    assert card.data.get("datasets") is None  # built in memory: no Hub dataset to name
    assert "Training hyperparameters" in card.text  # the Trainer's section
    assert "# run" in card.text  # the model is named after the output directory
    section = _reproduce(card)
    _assert_reproduce_section(section)
    # The optimizer that ran and where its state lived, in bytes.
    assert re.search(r"\| optimizer \| `SuperOffloadOptimizer, host [\d.]+ MiB, device", section)

    # Asked again: rewritten, one Reproduce section, our tags and the caller's.
    trainer.create_model_card(model_name="run", tags=["mine"])
    card = ModelCard.load(path)
    assert {"superoffload", "mine"} <= set(card.data.tags)
    _assert_reproduce_section(_reproduce(card))


def _sft_trainer(output_dir, **overrides):
    from hf_superoffload import SuperOffloadSFTConfig, SuperOffloadSFTTrainer

    rows = [{"prompt": f"{a}+{a}=", "completion": f"{2 * a}"} for a in range(32)]
    config = SuperOffloadSFTConfig(
        **cpu_training_args(
            output_dir, superoffload_bucket_size=1 << 14, max_length=32, **TRAINING, **overrides
        )
    )
    return SuperOffloadSFTTrainer(
        model=build_tiny_llama(seed=0),
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=make_char_tokenizer(),
    )


def test_sft_trainer_writes_the_card_with_its_checkpoints_as_trl_does(tmp_path):
    trainer = _sft_trainer(tmp_path / "sft", save_strategy="steps", save_steps=STEPS)
    trainer.train()
    trainer.superoffload_optimizer.close()
    assert (tmp_path / "sft" / f"checkpoint-{STEPS}").is_dir()

    card = ModelCard.load(tmp_path / "sft" / "README.md")
    assert {"superoffload", "sft", "trl"} <= set(card.data.tags)
    assert "SFT" in card.text  # TRL's own card text is kept
    # ... without its boilerplate for what it does not know (no base model, no Hub id).
    assert "[None]" not in card.text and 'model="None"' not in card.text
    assert f'model="{tmp_path / "sft"}"' in card.text
    section = _reproduce(card)
    assert "| max_length | `32` |" in section
    assert re.search(r"\| tokens/s \| `\d+\.\d", section)


def test_sft_trainer_writes_no_card_without_a_checkpoint_or_a_request(tmp_path):
    trainer = _sft_trainer(tmp_path / "sft")
    trainer.train()
    trainer.superoffload_optimizer.close()
    assert not (tmp_path / "sft" / "README.md").exists()


def test_no_card_from_a_process_that_does_not_save(tmp_path):
    args = SuperOffloadTrainingArguments(
        **cpu_training_args(tmp_path / "run", superoffload_bucket_size=1 << 12, **TRAINING)
    )
    trainer = SuperOffloadTrainer(model=_tiny_model(), args=args, train_dataset=_token_rows(8))
    trainer.is_world_process_zero = lambda: False  # as on a rank other than 0
    trainer.train()
    trainer.superoffload_optimizer.close()
    trainer.create_model_card()
    assert not (tmp_path / "run" / "README.md").exists()


def test_base_model_and_datasets():
    assert model_card.base_model_of(_tiny_model("org/name")) == "org/name"
    assert model_card.base_model_of(_tiny_model(os.getcwd())) is None  # a local directory
    assert model_card.base_model_of(_tiny_model("")) is None
    dataset = Dataset.from_list([{"text": "a"}])
    assert model_card.dataset_names(dataset) == []
    dataset.info.download_checksums = {
        "hf://datasets/trl-lib/Capybara@0123/data/train-00000.parquet": {}
    }
    assert model_card.dataset_names(dataset) == ["trl-lib/Capybara"]


def test_results_from_the_log_history():
    history = [
        {"loss": 2.0, "tokens_per_second": 100.0, "mfu": 0.2, "stv/rollbacks_clip": 1.0},
        {"loss": 1.5, "tokens_per_second": 300.0, "mfu": 0.4, "stv/rollbacks_clip": 2.0},
        {"train_runtime": 3.25},
    ]
    out = model_card.results(history, None)
    assert out["tokens/s"] == "200.0 (median of 2 logging intervals)"
    assert out["MFU"] == "30.0%"
    assert out["rollbacks: gradient clipping"] == "2"
    assert out["last logged loss"] == "1.5" and out["train runtime (s)"] == "3.25"
    stats = {"rollbacks_clip": 5, "rollbacks_nonfinite": 1, "speculative_steps": 9}
    out = model_card.results(history[:1], stats)
    assert out["rollbacks: gradient clipping"] == "5"
    assert out["rollbacks: non-finite gradients"] == "1"
    assert model_card.results([], None)["tokens/s"] == "not logged"


def test_dpo_and_plain_trainer_tags():
    from hf_superoffload import SuperOffloadDPOTrainer, SuperOffloadSFTTrainer

    assert model_card.trainer_kind_tags(SuperOffloadDPOTrainer) == ["superoffload", "dpo"]
    assert model_card.trainer_kind_tags(SuperOffloadSFTTrainer) == ["superoffload", "sft"]
    assert model_card.trainer_kind_tags(SuperOffloadTrainer) == ["superoffload"]


def test_accelerate_launch_command_and_config_found(tmp_path, monkeypatch):
    """Under ``accelerate launch``, the launcher's command line (read from /proc) is the
    command, and the YAML it was given is embedded, resolved from the launcher's directory."""
    (tmp_path / "gh200.yaml").write_text("distributed_type: 'NO'\nmixed_precision: bf16\n")
    launcher = ["/venv/bin/python", "/venv/bin/accelerate", "launch", "--config_file"]
    launcher += ["gh200.yaml", "train.py", "--config", "recipe.yaml"]
    monkeypatch.setattr(model_card, "_ancestor_cmdlines", lambda: iter([(launcher, str(tmp_path))]))
    run = model_card.launch()
    command = "accelerate launch --config_file gh200.yaml train.py --config recipe.yaml"
    assert run["command"] == command
    assert run["accelerate_config"] == str(tmp_path / "gh200.yaml")
    block = model_card._file_block("accelerate config", run["accelerate_config"])
    assert "mixed_precision: bf16" in block

    monkeypatch.setattr(model_card, "_ancestor_cmdlines", lambda: iter(()))
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    run = model_card.launch()
    assert run["accelerate_config"] is None and "not visible" in run["accelerate_note"]


def test_a_run_with_compact_moments_says_so_with_their_bytes(tmp_path):
    """The card names the compact moments and counts the bytes the optimizer holds (the
    fp32 master and codes and scales: about 6 B a param on the host, not 12)."""
    output_dir = tmp_path / "run"
    args = SuperOffloadTrainingArguments(
        **cpu_training_args(
            output_dir, superoffload_bucket_size=1 << 12, superoffload_moments="compact",
            superoffload_gpu_tail="0", **TRAINING,
        )
    )  # fmt: skip
    model = _tiny_model()
    trainer = SuperOffloadTrainer(model=model, args=args, train_dataset=_token_rows())
    trainer.train()
    optimizer = trainer.superoffload_optimizer
    held = optimizer.host_bytes()
    optimizer.close()
    params = sum(p.numel() for p in model.parameters())
    assert held["master"] == 4 * params and 2 * params < held["moments"] < 2.1 * params
    trainer.create_model_card()
    section = _reproduce(ModelCard.load(output_dir / "README.md"))
    state = (held["master"] + held["moments"]) / 2**20
    assert f"SuperOffloadOptimizer, compact moments (8 bits a value), host {state:.2f} MiB" in (
        section
    )
    assert "| moments | `compact` |" in section
