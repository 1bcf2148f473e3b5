"""``--use_liger_kernel true`` in the recipes: the flag reaches TrainingArguments (the Trainer
applies Liger's kernels when training starts), and where Liger cannot run, the recipe refuses
before the model is built: no CUDA GPU (Liger's kernels are Triton), no liger-kernel package, a
model type Liger has no kernels for (transformers would only log that and train without them).
On a GPU with liger-kernel installed, the demo trains with Liger's RMSNorm patched in."""

from __future__ import annotations

import math
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from hf_superoffload.recipes import liger, run
from hf_superoffload.recipes.arguments import parse
from hf_superoffload.toy import tiny_llama_config

LIGER_MODULE = "liger_kernel.transformers.monkey_patch"


def test_flag_reaches_the_training_arguments(tmp_path):
    _, args = parse("sft", ["--output_dir", str(tmp_path), "--use_liger_kernel", "true"])
    assert args.use_liger_kernel is True
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("use_liger_kernel: true\n")
    _, args = parse("sft", ["--config", str(recipe), "--output_dir", str(tmp_path)])
    assert args.use_liger_kernel is True


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a GPU")
def test_without_a_gpu_the_recipe_refuses_before_building_the_model(tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(run, "build_model", lambda *a, **k: built.append(a))
    argv = ["--output_dir", str(tmp_path), "--use_liger_kernel", "true"]
    with pytest.raises(ValueError, match="need a CUDA GPU"):
        run.build_trainer("sft", argv)
    assert not built


def test_without_the_package_it_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, LIGER_MODULE, None)  # import fails as if not installed
    config = tiny_llama_config(vocab_size=32)
    with pytest.raises(ImportError, match=r'pip install "hf_superoffload\[liger\]"'):
        liger.check_model(SimpleNamespace(use_liger_kernel=True), config)
    liger.check_model(SimpleNamespace(use_liger_kernel=False), config)  # off: nothing needed


def test_a_model_type_liger_does_not_patch_is_refused(monkeypatch):
    patches = types.ModuleType(LIGER_MODULE)
    patches.MODEL_TYPE_TO_APPLY_LIGER_FN = {"llama": None, "qwen3": None}
    monkeypatch.setitem(sys.modules, LIGER_MODULE, patches)
    on = SimpleNamespace(use_liger_kernel=True)
    liger.check_model(on, tiny_llama_config(vocab_size=32))  # llama: patched
    seed_oss = SimpleNamespace(model_type="seed_oss")
    with pytest.raises(ValueError, match="no kernels for 'seed_oss'"):
        liger.check_model(on, seed_oss)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_demo_trains_with_liger_kernels_on_a_gpu(tmp_path):
    pytest.importorskip("liger_kernel")
    argv = [
        "--output_dir", str(tmp_path), "--use_liger_kernel", "true", "--max_steps", "5",
        "--save_model", "false", "--loss_plot", "false",
    ]  # fmt: skip
    _, trainer, model = run.build_trainer("sft", argv)
    trainer.train()
    # Liger patches the instances (forward, and the name the module reports), not the classes.
    assert model.model.norm._get_name() == "LigerRMSNorm"
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 5 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]
