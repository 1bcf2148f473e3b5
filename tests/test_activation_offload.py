"""Activation checkpoint offload (integrations/activation_offload.py, the recipes'
``--activation_checkpoint_offload true``): the input each checkpointed decoder layer keeps for
backward waits in (pinned) host memory, and nothing else changes.

Here, in this process: a tiny Llama's forward and backward with and without the offload give
bit-identical gradients (reentrant and non-reentrant checkpointing), the offload packed exactly
one tensor per layer, each of the size the memory plan counts (zero3/activation_memory.py), and
released them all after backward; the refusals; the plan's figures and ``plan``'s flag. Through
the recipe on DeepSpeed ZeRO-3 (one rank, and two with Ulysses SP 2):
tests/test_activation_offload_ranks.py. The GPU memory drop: the ``gpu`` test at the end.
"""

from __future__ import annotations

import dataclasses
import json
import os
from types import SimpleNamespace

import pytest
import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from hf_superoffload.cli import main as cli_main
from hf_superoffload.integrations.activation_offload import (
    ActivationOffloadCallback,
    CheckpointInputOffload,
    check_arguments,
)
from hf_superoffload.recipes import report, run
from hf_superoffload.recipes.arguments import KINDS, checkpointing_name
from hf_superoffload.toy import build_tiny_llama, tiny_llama_config
from hf_superoffload.zero3.activation_memory import (
    layer_input_bytes,
    layer_inputs_gpu_bytes,
    layer_inputs_host_bytes,
    pinned_block_bytes,
)
from hf_superoffload.zero3.memory_plan import Zero3Run, zero3_memory_plan

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

VOCAB, BATCH, SEQ = 40, 3, 24
CHECKPOINTING = checkpointing_name(KINDS["sft"])  # the name this transformers gives it


def _checkpointed(model, use_reentrant: bool):
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers after the rename
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()
    return model


def _grads(model, ids) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_gradients_are_bit_identical_and_exactly_the_layer_inputs_move(use_reentrant):
    config = tiny_llama_config(vocab_size=VOCAB, num_layers=3, attn_implementation="sdpa")
    model = _checkpointed(build_tiny_llama(config), use_reentrant)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    reference = _grads(model, ids)

    offload = CheckpointInputOffload()
    assert offload.install(model) == config.num_hidden_layers
    CheckpointInputOffload().install(model)  # another's wrapper: replaced, not wrapped
    assert offload.install(model) == config.num_hidden_layers
    offloaded = _grads(model, ids)
    for name, grad in reference.items():
        assert torch.equal(offloaded[name], grad), name

    tally = offload.tally
    each = layer_input_bytes(BATCH * SEQ, config.hidden_size, 4)  # fp32 activations
    assert tally.packed == config.num_hidden_layers, "one tensor a layer: its input"
    assert tally.packed_bytes == config.num_hidden_layers * each
    assert tally.peak_live_bytes == config.num_hidden_layers * each, "all held at once"
    # What the memory plan counts on the GPU without the offload for this model and batch.
    planned = zero3_memory_plan(config, Zero3Run(seq=SEQ, batch=BATCH, dtype_bytes=4))
    assert tally.peak_live_bytes == planned.gpu["layer_inputs"]
    assert tally.peak_held_bytes == tally.peak_live_bytes  # not pinned here: their own bytes
    assert tally.live_bytes == 0, "backward released every host copy"
    assert tally.sources == {"cpu"} and tally.pinned == 0  # pinned memory needs a GPU


def test_install_refuses_a_model_without_checkpointed_layers():
    model = build_tiny_llama(tiny_llama_config(vocab_size=VOCAB))  # checkpointing off
    with pytest.raises(ValueError, match="no layer of LlamaForCausalLM is checkpointed"):
        CheckpointInputOffload().install(model)


def test_the_callback_installs_when_training_begins():
    model = _checkpointed(build_tiny_llama(tiny_llama_config(vocab_size=VOCAB)), False)
    callback = ActivationOffloadCallback()
    callback.on_train_begin(None, None, None, model=model)
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert callback.offload.layers == len(layers) == 2
    assert all(
        type(m._gradient_checkpointing_func).__name__ == "_OffloadedCheckpoint" for m in layers
    )


def _training_args(name: str, on: bool, kwargs=None) -> SimpleNamespace:
    return SimpleNamespace(**{name: on, f"{name}_kwargs": kwargs})


@pytest.mark.parametrize("name", ["activation_checkpointing", "gradient_checkpointing"])
def test_refuses_without_checkpointing_or_with_transformers_own_offload(name):
    with pytest.raises(ValueError, match=f"--{name} is off: pass --{name} true"):
        check_arguments(_training_args(name, False))
    with pytest.raises(ValueError, match="both move the checkpointed inputs to the host"):
        check_arguments(_training_args(name, True, {"offload": True}))
    check_arguments(_training_args(name, True, {"use_reentrant": True}))


def test_recipe_refuses_before_building_the_model(tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(run, "build_model", lambda *a, **k: built.append(a))
    argv = ["--output_dir", str(tmp_path), "--activation_checkpoint_offload", "true"]
    # The demo turns checkpointing off (its model is tiny).
    with pytest.raises(ValueError, match="checkpointing is off"):
        run.build_trainer("sft", argv)
    assert not built


def test_recipe_run_installs_the_offload_and_trains(tmp_path):
    """The demo with checkpointing on and the flag: the callback is the recipe's, the inputs of
    both layers moved each step."""
    argv = [
        "--output_dir", str(tmp_path), "--max_steps", "2", f"--{CHECKPOINTING}", "true",
        "--activation_checkpoint_offload", "true", "--save_model", "false", "--loss_plot",
        "false", "--require_loss_decrease", "false", "--disable_tqdm", "true",
    ]  # fmt: skip
    _, trainer, model = run.build_trainer("sft", argv)
    (callback,) = [
        c for c in trainer.callback_handler.callbacks if isinstance(c, ActivationOffloadCallback)
    ]
    trainer.train()
    tally = callback.offload.tally
    assert callback.offload.layers == model.config.num_hidden_layers
    assert tally.packed == 2 * model.config.num_hidden_layers  # 2 steps, one micro batch each
    assert tally.live_bytes == 0 and tally.peak_live_bytes > 0
    summary = report.summarize(trainer, model, "sft", {})
    assert summary["activation_checkpoint_offload"] == {
        "layers": 2, "inputs_moved": 4, "host_peak_bytes": tally.peak_held_bytes, "pinned": False
    }  # fmt: skip
    assert "the inputs of 2 layers waited in host memory" in report.format_summary(summary)


# --- the memory plan ---

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
                num_kv_heads=8, intermediate_size=14336)  # fmt: skip


def test_pinned_blocks_are_powers_of_two():
    assert [pinned_block_bytes(n) for n in (0, 1, 2, 3, 4096, 4097)] == [0, 1, 2, 4, 4096, 8192]


@pytest.mark.parametrize("seq", [16384, 12000])  # a power of two, and one rounded up
def test_plan_moves_the_layer_inputs_from_the_gpu_to_the_host(seq):
    config = tiny_llama_config(**LLAMA_8B)
    run_off = Zero3Run(seq=seq, batch=1, ranks=2)
    off = zero3_memory_plan(config, run_off)
    on = zero3_memory_plan(config, dataclasses.replace(run_off, activation_checkpoint_offload=True))
    each = layer_input_bytes(seq, 4096, 2)
    assert off.gpu["layer_inputs"] == 32 * each and off.host["offloaded_layer_inputs"] == 0
    assert on.gpu["layer_inputs"] == each, "the one layer being recomputed"
    assert on.host["offloaded_layer_inputs"] == 32 * pinned_block_bytes(each) >= 32 * each
    assert on.gpu_bytes == off.gpu_bytes - 31 * each
    assert on.host_training == off.host_training + 32 * pinned_block_bytes(each)
    # Loaded before the first forward: a resume holds no layer input yet; a save does.
    assert on.host_resume == off.host_resume
    assert on.host_save == off.host_save + 32 * pinned_block_bytes(each)
    assert on.gpu["layer_inputs"] == layer_inputs_gpu_bytes(32, seq, 4096, 2, True)
    assert on.host["offloaded_layer_inputs"] == layer_inputs_host_bytes(32, seq, 4096, 2, True)
    if seq == 16384:  # Llama-3.1-8B at 32K under SP 2: 4 GiB a rank
        assert off.gpu["layer_inputs"] == 4 * 2**30


def _plan(capsys, *argv: str) -> dict:
    cli_main(["plan", *argv, "--json"])
    return json.loads(capsys.readouterr().out)


def test_plan_flag_reaches_the_run_and_is_suggested_when_the_gpu_is_short(capsys):
    base = ("llama-3.1-8b", "--gpus", "2", "--seq", "262144", "--batch", "1", "--loss", "trl",
            "--gpu-mem", "79", "--cpu-mem", "500")  # fmt: skip
    short = _plan(capsys, *base)
    assert not short["fits"]
    assert any(s.startswith("--activation-checkpoint-offload fits") for s in short["suggestions"])
    fits = _plan(capsys, *base, "--activation-checkpoint-offload")
    assert fits["run"]["activation_checkpoint_offload"] and fits["fits"]
    assert fits["host_bytes_per_rank"]["offloaded_layer_inputs"] == 32 * 262144 * 4096 * 2


@pytest.mark.gpu
def test_gpu_memory_drops_by_the_layer_inputs_and_gradients_stay_bit_identical():
    """On a GPU, bf16: the allocator's peak over forward and backward drops by the plan's
    figure (all layer inputs but the one recomputed), the host copies are pinned, and the
    gradients are bit-identical (eager attention: deterministic kernels). The layer inputs
    (96 MiB) outweigh the params' gradients (5 MiB), as in the runs the offload is for:
    otherwise the peak is at the end of backward, when the gradients are all there and the
    inputs are gone with or without the offload."""
    layers, hidden, batch, seq = 12, 128, 8, 4096
    config = tiny_llama_config(
        vocab_size=256, hidden_size=hidden, num_layers=layers, num_heads=2,
        intermediate_size=352, max_position_embeddings=seq, attn_implementation="eager",
    )  # fmt: skip
    model = _checkpointed(build_tiny_llama(config, dtype=torch.bfloat16).cuda(), False)
    ids = torch.randint(0, 256, (batch, seq), device="cuda")

    def peak_and_grads():
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        model(input_ids=ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        return torch.cuda.max_memory_allocated() - start, grads

    _, first = peak_and_grads()  # warm-up: the allocator's and cuBLAS's first allocations
    on_gpu, reference = peak_and_grads()
    for name, grad in reference.items():  # else bit-identity could not be asked of the offload
        assert torch.equal(first[name], grad), (
            f"the run without offload is not deterministic: {name}"
        )
    offload = CheckpointInputOffload()
    offload.install(model)
    peak_and_grads()  # the pinned blocks' first allocation
    tally = offload.tally  # counts over both passes: the measured one's is the difference
    packed, pinned = tally.packed, tally.pinned
    packs, add = [], tally.add

    def add_and_describe(source, copy):  # what each pack was, for the failure message
        packs.append((str(source.device), tuple(source.shape), source.dtype, copy.is_pinned()))
        add(source, copy)

    tally.add = add_and_describe
    offloaded, grads = peak_and_grads()

    for name, grad in reference.items():
        assert torch.equal(grads[name], grad), name
    # A layer's input, pinned, and the empty placeholder torch's checkpoint also saves (an
    # empty copy has no pinned block).
    inputs = [p for p in packs if p[1] == (batch, seq, hidden)]
    assert len(packs) == 2 * layers and tally.packed - packed == len(packs), packs
    assert len(inputs) == layers and all(p[0] == "cuda:0" and p[3] for p in inputs), packs
    assert all(p[1] == (0,) for p in packs if p not in inputs), packs
    assert tally.pinned - pinned == layers and tally.live_bytes == 0
    # The pinned blocks the copies held at once: the plan's host figure.
    assert tally.peak_held_bytes == layer_inputs_host_bytes(layers, batch * seq, hidden, 2, True)
    planned_drop = layer_inputs_gpu_bytes(
        layers, batch * seq, hidden, 2, False
    ) - layer_inputs_gpu_bytes(layers, batch * seq, hidden, 2, True)
    drop = on_gpu - offloaded
    assert drop >= 0.9 * planned_drop, (drop / 2**20, planned_drop / 2**20)
    print(f"peak {on_gpu / 2**20:.0f} MiB -> {offloaded / 2**20:.0f} MiB, planned drop "
          f"{planned_drop / 2**20:.0f} MiB")  # fmt: skip


def test_the_launcher_plans_the_offload_the_script_is_given(capsys, tmp_path):
    """hf-superoffload finetune passes --activation_checkpoint_offload true to examples/sft.py
    and plans it: the layer inputs on the host, one left on the GPU."""
    args = ["llama-3.1-8b", "superoffload", "--dry-run", "--hardware", "h100", "--ratio", "auto"]
    for given, offload in ((["--", "--activation_checkpoint_offload", "true"], True), ([], False)):
        out_dir = tmp_path / str(offload)
        code = cli_main(["finetune", "--runs-dir", str(out_dir), *args, *given])
        assert code == 0, capsys.readouterr().err
        (run_dir,) = out_dir.iterdir()
        plan = json.loads((run_dir / "plan.json").read_text())
        assert plan["run"]["activation_checkpoint_offload"] is offload
        assert (plan["host_bytes_per_rank"]["offloaded_layer_inputs"] > 0) is offload


# --- transformers' own offload (activation_checkpointing_kwargs {"offload": true}, 5.17 on) ---

UPSTREAM = [
    ({}, ["--activation_checkpointing_kwargs", '{"offload": true}']),
    ({}, ["--gradient_checkpointing_kwargs", '{"offload": "true"}']),  # the name before the rename
    ({"activation_checkpointing_kwargs": {"offload": True}}, []),  # a recipe's
]


@pytest.mark.parametrize("settings, argv", UPSTREAM, ids=["new", "old", "recipe"])
def test_the_launcher_plans_transformers_own_offload_as_the_same_request(settings, argv):
    from hf_superoffload.cli.script_arguments import activation_checkpoint_offload

    assert activation_checkpoint_offload(settings, argv) is True
    off = ["--activation_checkpointing_kwargs", '{"offload": false, "use_reentrant": true}']
    assert activation_checkpoint_offload(settings, off) is False  # the new name wins


def test_the_launcher_refuses_both_offloads_before_writing_anything():
    from hf_superoffload.cli.errors import UsageError
    from hf_superoffload.cli.script_arguments import activation_checkpoint_offload

    both = ["--activation_checkpoint_offload", "--activation_checkpointing_kwargs", '{"offload":1}']
    with pytest.raises(UsageError, match="both move the checkpointed inputs to the host"):
        activation_checkpoint_offload({}, both)


def test_transformers_own_offload_is_refused_where_transformers_has_none(monkeypatch):
    """Before 5.17 the key goes on to torch's checkpoint, which does not offload anything."""
    from hf_superoffload.integrations import activation_offload

    monkeypatch.setattr(activation_offload, "upstream_offload_supported", lambda: False)
    asked = _training_args(CHECKPOINTING, True, {"offload": True})
    with pytest.raises(
        ValueError, match=r"transformers 5.17.*--activation_checkpoint_offload true"
    ):
        activation_offload.check_arguments(asked, flag=False)
    activation_offload.check_arguments(_training_args(CHECKPOINTING, True), flag=False)
    monkeypatch.undo()
    activation_offload.check_arguments(asked, flag=False)  # this transformers offloads it


def test_the_launcher_plans_transformers_own_offload(capsys, tmp_path):
    args = ["llama-3.1-8b", "superoffload", "--dry-run", "--hardware", "h100", "--ratio", "auto"]
    given = ["--", "--activation_checkpointing_kwargs", '{"offload": true}']
    assert cli_main(["finetune", "--runs-dir", str(tmp_path), *args, *given]) == 0
    (run_dir,) = tmp_path.iterdir()
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["run"]["activation_checkpoint_offload"] is True
    assert plan["host_bytes_per_rank"]["offloaded_layer_inputs"] > 0


def test_the_recipe_refuses_transformers_own_offload_where_it_has_none(tmp_path, monkeypatch):
    from hf_superoffload.integrations import activation_offload

    built = []
    monkeypatch.setattr(run, "build_model", lambda *a, **k: built.append(a))
    monkeypatch.setattr(activation_offload, "upstream_offload_supported", lambda: False)
    argv = ["--output_dir", str(tmp_path), f"--{CHECKPOINTING}", "true",
            f"--{CHECKPOINTING}_kwargs", '{"offload": true}']  # fmt: skip
    with pytest.raises(ValueError, match=r"offload needs transformers 5\.17\.0 or later"):
        run.build_trainer("sft", argv)
    assert not built


# --- every_n_layers: the plan counts every layer checkpointed and offloaded ---


def test_the_flag_refuses_every_n_layers_other_than_one():
    every_2 = _training_args(CHECKPOINTING, True, {"every_n_layers": 2})
    with pytest.raises(ValueError, match="every_n_layers 2: the layers left uncheckpointed"):
        check_arguments(every_2)
    check_arguments(every_2, flag=False)  # transformers' checkpointing alone: its own business
    check_arguments(_training_args(CHECKPOINTING, True, {"every_n_layers": 1}))


def test_the_recipe_refuses_every_n_layers_before_building_the_model(tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(run, "build_model", lambda *a, **k: built.append(a))
    argv = ["--output_dir", str(tmp_path), f"--{CHECKPOINTING}", "true",
            "--activation_checkpoint_offload", "true",
            f"--{CHECKPOINTING}_kwargs", '{"every_n_layers": "3"}']  # fmt: skip
    with pytest.raises(ValueError, match="every_n_layers 3"):
        run.build_trainer("sft", argv)
    assert not built


def test_the_launcher_refuses_every_n_layers_with_the_flag():
    from hf_superoffload.cli.errors import UsageError
    from hf_superoffload.cli.script_arguments import activation_checkpoint_offload

    argv = ["--activation_checkpoint_offload", "--gradient_checkpointing_kwargs",
            '{"every_n_layers": 2}']  # fmt: skip
    with pytest.raises(UsageError, match="Drop every_n_layers"):
        activation_checkpoint_offload({}, argv)


@pytest.mark.parametrize(
    "kwargs", ['{"every_n_layers": 2, "offload": true}', '{"every_n_layers": 2}']
)
def test_ratio_auto_refuses_every_n_layers_it_cannot_plan(kwargs):
    """The plan counts every layer checkpointed, transformers' offload or none."""
    from hf_superoffload.cli.errors import UsageError
    from hf_superoffload.cli.script_arguments import activation_checkpoint_offload

    with pytest.raises(UsageError, match=r"every_n_layers 2.*give --ratio"):
        activation_checkpoint_offload({}, ["--activation_checkpointing_kwargs", kwargs])
