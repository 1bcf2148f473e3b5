"""SuperOffloadSFTTrainer, and TRL's plain SFTTrainer, on DeepSpeed ZeRO-3 with
``"super_offload": true`` save through the streamed save (hf_superoffload/zero3/streaming_save.py): ``save_model`` and the checkpoints of
``save_strategy`` write the files the Trainer's own ZeRO-3 save writes (DeepSpeed's gathered
16-bit state dict through ``save_pretrained``, the config, the tokenizer, the training
arguments), the same tensors, even with ``stage3_gather_16bit_weights_on_model_save`` off (the
Trainer's own save then writes no weights at all, only DeepSpeed's checkpoint). Our trainer's
training_args.bin, there and in the checkpoint, holds no ``hub_token``.

One spawned process (DeepSpeed's CPU accelerator, gloo, fp32), the toy model and the bundled SFT
data, 2 steps with a checkpoint at step 2, for each trainer. The reference is what
``Trainer.save_model`` saves with the gather on: accelerate's ``get_state_dict`` (DeepSpeed's
``_zero3_consolidated_16bit_state_dict``) through the Trainer's ``_save``.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
from cpu_trainer_args import cpu_training_args
from ranks import set_rank_env, spawn_ranks
from safetensors.torch import load_file
from safetensors.torch import save_file as save_file_of_safetensors
from test_zero3_trainer import ZERO3_CPU_OFFLOAD, _rows
from zero3_reference import free_port

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

STEPS = 2
HUB_TOKEN = "hf_zero3_trainer_save_test_token"  # ours is given one: training_args.bin leaves it out


def _config(gather_on_save: bool) -> dict:
    config = copy.deepcopy(ZERO3_CPU_OFFLOAD)
    config["zero_optimization"]["offload_optimizer"]["super_offload"] = True
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = gather_on_save
    return config


def _train_and_save(out: str, ours: bool) -> None:
    from datasets import Dataset
    from transformers import Trainer
    from trl import SFTConfig, SFTTrainer

    from hf_superoffload import SuperOffloadSFTConfig, SuperOffloadSFTTrainer
    from hf_superoffload.toy import build_tiny_llama, make_char_tokenizer

    config_class, trainer_class = (
        (SuperOffloadSFTConfig, SuperOffloadSFTTrainer) if ours else (SFTConfig, SFTTrainer)
    )
    args = config_class(
        **cpu_training_args(
            f"{out}/run",
            max_steps=STEPS,
            per_device_train_batch_size=8,
            learning_rate=1e-3,
            max_length=64,
            save_strategy="steps",
            save_steps=STEPS,
            deepspeed=_config(gather_on_save=False),  # a user config that turns it off
            hub_token=HUB_TOKEN if ours else None,
        )
    )
    trainer = trainer_class(
        model=build_tiny_llama(seed=0),
        args=args,
        train_dataset=Dataset.from_list(_rows(64)),
        processing_class=make_char_tokenizer(),
    )
    trainer.train()
    assert type(trainer.deepspeed.optimizer).__name__ == "SuperOffloadZero3Optimizer"
    trainer.save_model(f"{out}/final")
    Path(f"{out}/hub_token_in_memory").write_text(str(trainer.args.hub_token))
    # What the Trainer's own save writes (it needs DeepSpeed's gather on).
    trainer.deepspeed._config.zero_config.gather_16bit_weights_on_model_save = True
    trainer.deepspeed.optimizer.synchronize()
    gathered = trainer.accelerator.get_state_dict(trainer.deepspeed)
    Trainer._save(trainer, f"{out}/gathered", state_dict=gathered)
    trainer.deepspeed.destroy()


def _both_trainers(rank: int, world: int, port: int, out: str) -> None:
    set_rank_env(rank, world, port)
    torch.set_num_threads(1)
    import hf_superoffload  # noqa: F401  (activates "super_offload": true)

    _train_and_save(f"{out}/ours", ours=True)
    if world == 1:
        _train_and_save(f"{out}/trl", ours=False)  # a plain trainer given the flag


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("zero3_trainer_save")
    spawn_ranks(_both_trainers, (1, free_port(), str(out)), world=1, timeout=300)
    return out


@pytest.fixture(scope="module")
def saved_by_two_ranks(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("zero3_trainer_save_two_ranks")
    spawn_ranks(_both_trainers, (2, free_port(), str(out)), world=2, timeout=300)
    return out


def _files(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if p.is_file()}


@pytest.mark.parametrize("trainer", ["ours", "trl"])
def test_save_model_writes_the_trainers_files_and_tensors(saved, trainer):
    _assert_same_save(saved / trainer)


def test_two_ranks_save_the_trainers_files_and_tensors(saved_by_two_ranks):
    _assert_same_save(saved_by_two_ranks / "ours")
    checkpoint = saved_by_two_ranks / "ours" / "run" / f"checkpoint-{STEPS}"
    got = load_file(checkpoint / "model.safetensors")
    want = load_file(saved_by_two_ranks / "ours" / "final" / "model.safetensors")
    assert all(torch.equal(got[key], want[key]) for key in want)


def _assert_same_save(saved: Path) -> None:
    final, gathered = saved / "final", saved / "gathered"
    assert _files(final) == _files(gathered)
    assert {"model.safetensors", "config.json", "training_args.bin"} <= _files(final)
    for name in _files(final) - {"model.safetensors", "training_args.bin"}:
        assert (final / name).read_bytes() == (gathered / name).read_bytes(), name
    got, want = load_file(final / "model.safetensors"), load_file(gathered / "model.safetensors")
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key


@pytest.mark.parametrize("trainer", ["ours", "trl"])
def test_a_checkpoint_holds_the_streamed_weights_beside_deepspeeds_state(saved, trainer):
    saved = saved / trainer
    checkpoint = saved / "run" / f"checkpoint-{STEPS}"
    assert (checkpoint / f"global_step{STEPS}").is_dir()  # the optimizer state, as before
    assert (checkpoint / "trainer_state.json").is_file()
    got = load_file(checkpoint / "model.safetensors")
    want = load_file(saved / "final" / "model.safetensors")  # no step since
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[key], want[key]) for key in want)


def test_the_saved_model_loads_with_from_pretrained(saved):
    from transformers import AutoModelForCausalLM

    from hf_superoffload.toy import build_tiny_llama

    model = AutoModelForCausalLM.from_pretrained(saved / "ours" / "final")
    want = load_file(saved / "ours" / "gathered" / "model.safetensors")
    loaded = model.state_dict()
    for key, tensor in want.items():
        assert torch.equal(loaded[key], tensor), key
    initial = build_tiny_llama(seed=0).state_dict()
    assert any(not torch.equal(initial[key], tensor) for key, tensor in want.items())  # trained


def test_our_trainers_saves_leave_the_hub_token_out_of_training_args(saved):
    ours = saved / "ours"
    for directory in (ours / "final", ours / "run" / f"checkpoint-{STEPS}"):
        args = torch.load(directory / "training_args.bin", weights_only=False)
        assert args.hub_token is None and args.max_steps == STEPS
    run_and_save = [*(ours / "run").rglob("*"), *(ours / "final").rglob("*")]
    assert [p for p in run_and_save if p.is_file() and HUB_TOKEN.encode() in p.read_bytes()] == []
    assert (ours / "hub_token_in_memory").read_text() == HUB_TOKEN  # the push still has it


def _save_over_a_save(rank: int, world: int, port: int, out: str) -> None:
    """A sharded save, a save over it that fails mid-stream (its second shard's write), then one
    that succeeds (one file); a copy of the folder after each."""
    import shutil

    from datasets import Dataset

    import hf_superoffload.zero3.save_memory as save_memory
    import hf_superoffload.zero3.streaming_save as streaming_save
    from hf_superoffload import SuperOffloadSFTConfig, SuperOffloadSFTTrainer
    from hf_superoffload.toy import build_tiny_llama, make_char_tokenizer

    set_rank_env(rank, world, port)
    torch.set_num_threads(1)
    args = SuperOffloadSFTConfig(
        **cpu_training_args(
            f"{out}/run",
            max_steps=1,
            per_device_train_batch_size=8,
            max_length=64,
            save_strategy="no",
            deepspeed=_config(gather_on_save=False),
        )
    )
    trainer = SuperOffloadSFTTrainer(
        model=build_tiny_llama(seed=0),
        args=args,
        train_dataset=Dataset.from_list(_rows(16)),
        processing_class=make_char_tokenizer(),
    )
    trainer.train()
    target = f"{out}/model"
    save_memory.STREAMED_SHARD_BYTES = 40_000
    trainer.save_model(target)
    shutil.copytree(target, f"{out}/first")
    writes = []

    def full_on_the_second_shard(tensors, path, **kwargs):
        writes.append(path)
        if len(writes) == 2:
            raise OSError("No space left on device")
        return save_file_of_safetensors(tensors, path, **kwargs)

    streaming_save.save_file = full_on_the_second_shard
    save_memory.STREAMED_SHARD_BYTES = 20_000
    try:
        trainer.save_model(target)
        outcome = "returned"
    except OSError as error:
        outcome = str(error)
    (Path(out) / "outcome.txt").write_text(outcome)
    shutil.copytree(target, f"{out}/after_failure")
    streaming_save.save_file = save_file_of_safetensors
    save_memory.STREAMED_SHARD_BYTES = 5 * 10**9
    trainer.save_model(target)
    trainer.deepspeed.destroy()


@pytest.fixture(scope="module")
def saved_over(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("zero3_save_over_a_save")
    spawn_ranks(_save_over_a_save, (1, free_port(), str(out)), world=1, timeout=300)
    return out


def test_a_save_that_fails_midway_leaves_the_previous_save_loadable(saved_over):
    from transformers import AutoModelForCausalLM

    assert (saved_over / "outcome.txt").read_text() == "No space left on device"
    first, after = saved_over / "first", saved_over / "after_failure"
    assert "model.safetensors.index.json" in _files(first)  # the first save is sharded
    assert sorted(p.name for p in after.iterdir()) == sorted(p.name for p in first.iterdir())
    for name in _files(first):
        assert (after / name).read_bytes() == (first / name).read_bytes(), name
    loaded = AutoModelForCausalLM.from_pretrained(after).state_dict()
    want = AutoModelForCausalLM.from_pretrained(first).state_dict()
    assert all(torch.equal(loaded[key], tensor) for key, tensor in want.items())


def test_a_save_over_a_sharded_one_leaves_exactly_its_own_files(saved_over):
    first, model = saved_over / "first", saved_over / "model"
    weights = {name for name in _files(first) if name.startswith("model")}
    assert sorted(p.name for p in model.iterdir()) == sorted(
        (_files(first) - weights) | {"model.safetensors"}
    )
    got = load_file(model / "model.safetensors")
    want = {}
    for name in weights - {"model.safetensors.index.json"}:
        want.update(load_file(first / name))
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[key], want[key]) for key in want)


def test_a_quantized_or_peft_model_is_left_to_the_trainers_own_save():
    """streamed_save_engine routes a model the streamed save refuses (check_streamable) to
    the Trainer's own save instead: what Trainer.save_model writes for it is transformers'."""
    from types import SimpleNamespace

    from hf_superoffload.integrations.zero3_save import streamed_save_engine
    from hf_superoffload.toy import build_tiny_llama

    model = build_tiny_llama(seed=0)
    engine = SimpleNamespace(
        zero_optimization_partition_weights=lambda: True, autotp_size=lambda: 1, module=model
    )
    trainer = SimpleNamespace(
        is_deepspeed_enabled=True,
        deepspeed=engine,
        model=model,
        accelerator=SimpleNamespace(unwrap_model=lambda m: m),
    )
    assert streamed_save_engine(trainer) is engine
    model.hf_quantizer = object()  # as from_pretrained(..., quantization_config=...) sets it
    assert streamed_save_engine(trainer) is None
    model.hf_quantizer = None
    model._hf_peft_config_loaded = True
    assert streamed_save_engine(trainer) is None


def _unstreamable_tiny_llama():
    from transformers.core_model_loading import Chunk, WeightConverter

    from hf_superoffload.toy import build_tiny_llama

    model = build_tiny_llama(seed=0)
    # A checkpoint format that splits one tensor into several params (see
    # test_zero3_streaming_save): the streamed save cannot write it.
    model._weight_conversions = [
        WeightConverter(
            source_patterns="self_attn.qkv.weight",
            target_patterns=["self_attn.q.weight", "self_attn.k.weight", "self_attn.v.weight"],
            operations=[Chunk(dim=0)],
        )
    ]
    return model


def _train_an_unstreamable_model(out: Path, ours: bool, **trainer_kwargs) -> None:
    """Train 1 step with save_strategy "no"; outcome.txt: "trained" or the refusal, steps.txt:
    the steps taken."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from hf_superoffload import SuperOffloadSFTConfig, SuperOffloadSFTTrainer
    from hf_superoffload.toy import make_char_tokenizer

    config_class, trainer_class = (
        (SuperOffloadSFTConfig, SuperOffloadSFTTrainer) if ours else (SFTConfig, SFTTrainer)
    )
    args = config_class(
        **cpu_training_args(
            f"{out}/run",
            max_steps=1,
            per_device_train_batch_size=8,
            max_length=64,
            save_strategy="no",  # no checkpoint; the script's final save_model still streams
            deepspeed=_config(gather_on_save=False),
        )
    )
    trainer = trainer_class(
        model=_unstreamable_tiny_llama(),
        args=args,
        train_dataset=Dataset.from_list(_rows(16)),
        processing_class=make_char_tokenizer(),
        **trainer_kwargs,
    )
    try:
        trainer.train()
        outcome = "trained"
    except NotImplementedError as error:
        outcome = str(error)
    out.mkdir(parents=True, exist_ok=True)
    (out / "outcome.txt").write_text(outcome)
    (out / "steps.txt").write_text(str(trainer.state.global_step))
    if trainer.deepspeed is not None:
        trainer.deepspeed.destroy()


def _plain_trainer_with_an_unstreamable_model(rank: int, world: int, port: int, out: str):
    set_rank_env(rank, world, port)
    torch.set_num_threads(1)
    import hf_superoffload  # noqa: F401  (activates "super_offload": true)

    _train_an_unstreamable_model(Path(out), ours=False)


def test_a_plain_trainer_refuses_a_model_it_could_not_save_before_a_step(tmp_path):
    """TRL's SFTTrainer through our ZeRO-3 optimizer, save_strategy "no": train() refuses the
    model at its start (not at the final save), telling a plain Trainer's user what to change."""
    args = (1, free_port(), str(tmp_path))
    spawn_ranks(_plain_trainer_with_an_unstreamable_model, args, world=1, timeout=300)
    outcome = (tmp_path / "outcome.txt").read_text()
    assert "cannot be saved on the ZeRO-3 path" in outcome
    assert '"super_offload"' in outcome and "--save_model" not in outcome
    assert (tmp_path / "steps.txt").read_text() == "0"


def _our_trainer_with_an_unstreamable_model(rank: int, world: int, port: int, out: str):
    set_rank_env(rank, world, port)
    torch.set_num_threads(1)
    _train_an_unstreamable_model(Path(out) / "saves", ours=True)  # saves after train()
    _train_an_unstreamable_model(Path(out) / "never", ours=True, superoffload_final_save=False)


def test_our_trainer_refuses_an_unstreamable_model_it_will_save_whatever_save_strategy(tmp_path):
    """SuperOffloadSFTTrainer on ZeRO-3 with save_strategy "no": a script still saves the model
    after train() (examples/sft.py does unless --save_model false), so an unstreamable model is
    refused before a step; told that nothing is saved after training
    (``superoffload_final_save=False``, what the recipes pass for --save_model false), it trains."""
    args = (1, free_port(), str(tmp_path))
    spawn_ranks(_our_trainer_with_an_unstreamable_model, args, world=1, timeout=300)
    outcome = (tmp_path / "saves" / "outcome.txt").read_text()
    assert "cannot be saved on the ZeRO-3 path" in outcome, outcome
    assert "--save_model false --save_strategy no" in outcome
    assert "superoffload_final_save=False" in outcome
    assert (tmp_path / "saves" / "steps.txt").read_text() == "0"
    assert (tmp_path / "never" / "outcome.txt").read_text() == "trained"
    assert (tmp_path / "never" / "steps.txt").read_text() == "1"


def _fake_zero3_trainer(model, final_save: bool):
    """What the SuperOffload trainer's train-begin check reads of a trainer on ZeRO-3."""
    from types import SimpleNamespace

    engine = SimpleNamespace(
        zero_optimization_partition_weights=lambda: True,
        autotp_size=lambda: 1,
        module=model,
        _raise_if_autoep_zero3_consolidated_export=lambda what: None,
    )
    return SimpleNamespace(
        is_deepspeed_enabled=True,
        deepspeed=engine,
        model=model,
        accelerator=SimpleNamespace(unwrap_model=lambda m: m),
        _throughput=SimpleNamespace(reset=lambda: None),
        superoffload_final_save=final_save,
    )


@pytest.mark.parametrize(
    ("save_strategy", "final_save", "checked"),
    [("no", True, True), ("no", False, False), ("steps", False, True), ("epoch", True, True)],
)
def test_the_train_begin_check_runs_whenever_the_model_will_be_saved(
    save_strategy, final_save, checked
):
    """At checkpoints (save_strategy) or after train() (superoffload_final_save): checked;
    skipped only when neither saves."""
    from types import SimpleNamespace

    from hf_superoffload.integrations.trainer import _SuperOffloadCallback

    trainer = _fake_zero3_trainer(_unstreamable_tiny_llama(), final_save)
    callback = _SuperOffloadCallback(trainer)
    args = SimpleNamespace(save_strategy=save_strategy)
    if checked:
        with pytest.raises(NotImplementedError, match="cannot be saved on the ZeRO-3 path"):
            callback.on_train_begin(args, None, None)
    else:
        callback.on_train_begin(args, None, None)


@pytest.mark.parametrize(("argv", "final_save"), [([], True), (["--save_model", "false"], False)])
def test_the_recipe_tells_the_trainer_whether_it_saves_after_training(tmp_path, argv, final_save):
    from hf_superoffload.recipes.run import build_trainer

    common = ["--output_dir", str(tmp_path), "--max_steps", "1", "--report_to", "none"]
    _, trainer, _ = build_trainer("sft", [*common, *argv])
    assert trainer.superoffload_final_save is final_save
