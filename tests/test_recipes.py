"""The recipes of issue 13: every examples/recipes/*.yaml parses with TRL's parser and trains 2
steps through SuperOffloadSFTTrainer on a shrunken copy of its architecture (MoE ones included,
with experts that get no token in a step); the DPO script trains; the launchers write the
configs they use; the bundled preference pairs are the generator's output."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import operator
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from engine_reference import PARAM_TOL
from launched import ONE_PROCESS, QUICK, run_launched
from zero3_reference import free_port

from hf_superoffload.cli import finetune, model_source
from hf_superoffload.engine import SuperOffloadOptimizer
from hf_superoffload.recipes import arguments, arithmetic, run
from hf_superoffload.recipes.model import MAX_EXPERTS, SHRUNK

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "examples" / "recipes").glob("*.yaml"))
SFT_DATA = REPO / "examples" / "data" / "arithmetic_sft.jsonl"
DPO_DATA = REPO / "examples" / "data" / "arithmetic_dpo.jsonl"
# The paper's examples (seed README) and the GPUs each recipe launches on.
GPUS = {"gpt-oss-20b": 1, "qwen3-14b": 1, "phi-4": 1, "llama-3.1-8b": 1,
        "seed-oss-36b": 2, "qwen3-30b-a3b": 2, "llama-3.3-70b": 4}  # fmt: skip
MOE = {"gpt-oss-20b", "qwen3-30b-a3b"}

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _cpu_overrides(tmp_path: Path, steps: int = 2) -> list[str]:
    """What a 2-step CPU smoke run changes in a GPU recipe: bf16 off (TRL refuses it on a CPU),
    local data, short rows, one sequence a step (few tokens: some experts get none)."""
    return [
        "--dataset_path", str(SFT_DATA), "--bf16", "false", "--max_steps", str(steps),
        "--per_device_train_batch_size", "1", "--max_length", "32", "--output_dir",
        str(tmp_path / "out"), "--loss_plot", "false", "--dataloader_pin_memory", "false",
    ]  # fmt: skip


def test_every_paper_model_has_a_recipe_a_launcher_and_a_shipped_config():
    assert sorted(p.stem for p in RECIPES) == sorted(GPUS)
    shipped = model_source.shipped_configs()
    for recipe in RECIPES:
        assert recipe.stem in shipped
        launcher = REPO / "examples" / f"finetune_{recipe.stem}.sh"
        text = launcher.read_text()
        assert f"MODEL_NAME={recipe.stem}\n" in text
        assert finetune.RECIPE_GPUS[recipe.stem] == GPUS[recipe.stem]
        # torchtune's convention: a config starts with the command that runs it.
        assert recipe.read_text().startswith(f"# Run: bash examples/finetune_{recipe.stem}.sh")


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_parses_with_trls_parser_and_the_command_line_wins(recipe, tmp_path):
    values = yaml.safe_load(recipe.read_text())
    script, training = arguments.parse(
        "sft",
        ["--config", str(recipe), "--bf16", "false", "--output_dir", str(tmp_path),
         "--superoffload_gpu_tail", "0", "--superoffload_speculate", "false"],
    )  # fmt: skip
    assert training.superoffload_gpu_tail == "0" and training.superoffload_speculate is False
    assert script.model_name_or_path == values["model_name_or_path"]
    assert script.dataset_name == values["dataset_name"]
    assert training.max_length == values["max_length"] == 4096
    assert training.per_device_train_batch_size == 4
    assert training.learning_rate == values["learning_rate"]
    assert getattr(training, arguments.checkpointing_name(type(training))) is True
    assert training.bf16 is False and training.output_dir == str(tmp_path)  # overridden
    assert type(training).__name__ == "SuperOffloadSFTConfig"


@dataclasses.dataclass
class _BeforeTheRename:  # transformers before 5.2x: gradient_checkpointing only
    gradient_checkpointing: bool = False
    learning_rate: float = 1.0


@dataclasses.dataclass
class _AfterTheRename:
    activation_checkpointing: bool = False
    learning_rate: float = 1.0


@pytest.mark.parametrize("config_cls", [_BeforeTheRename, _AfterTheRename])
@pytest.mark.parametrize("recipe_says", arguments.CHECKPOINTING_NAMES)
def test_either_checkpointing_name_works_on_either_transformers(config_cls, recipe_says, tmp_path):
    """The recipes say activation_checkpointing; on a transformers that only knows
    gradient_checkpointing (the device machine's 5.17) TRL's parser refused it."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"{recipe_says}: true\nlearning_rate: 0.5\n")
    parser = arguments.RecipeParser((config_cls,), config_cls)
    (config,) = parser.parse_args_and_config(["--config", str(recipe)])
    assert getattr(config, arguments.checkpointing_name(config_cls)) is True
    assert config.learning_rate == 0.5


def test_a_recipe_key_the_parser_does_not_know_is_refused(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model_name_or_path: x\nlearning_rat: 1.0e-5\n")
    with pytest.raises(ValueError, match="learning_rat"):
        arguments.parse("sft", ["--config", str(bad), "--bf16", "false"])


class _ExpertUse:
    """Which experts each router sent tokens to, per forward (GPT-OSS's and Qwen3-MoE's routers
    return (logits, scores, indices))."""

    def __init__(self, model):
        self.unused = []  # per router call: experts that got no token
        self.handles = [
            m.register_forward_hook(self._hook)
            for m in model.modules()
            if type(m).__name__.endswith("TopKRouter")
        ]

    def _hook(self, module, args, output):
        used = set(output[2].flatten().tolist())
        self.unused.append(sorted(set(range(module.num_experts)) - used))


def _trained(argv: list[str]):
    _, trainer, model = run.build_trainer("sft", argv)
    experts = _ExpertUse(model)
    trainer.train()
    return trainer, model, experts


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_trains_two_steps_on_its_shrunken_architecture(recipe, tmp_path):
    argv = [
        "--config", str(recipe), "--random_init_from_config", recipe.stem, "--shrink_model",
        *_cpu_overrides(tmp_path),
    ]  # fmt: skip
    trainer, model, experts = _trained(argv)
    assert isinstance(trainer.superoffload_optimizer, SuperOffloadOptimizer)
    assert type(trainer).__name__ == "SuperOffloadSFTTrainer"
    # The recipe's architecture, shrunken.
    shipped = model_source.resolve(recipe.stem).config
    assert model.config.model_type == shipped.model_type
    assert model.config.hidden_size == SHRUNK["hidden_size"]
    assert model.config.num_hidden_layers == SHRUNK["num_hidden_layers"]
    assert trainer.state.global_step == 2
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert trainer.superoffload_stats["steps"] == 2
    if recipe.stem in MOE:
        assert experts.handles, "no router found in an MoE model"
        # Some expert got no token in some step, and the run went on regardless.
        assert any(experts.unused), experts.unused
        count = getattr(model.config, "num_local_experts", None) or model.config.num_experts
        assert 2 < count <= MAX_EXPERTS


def test_the_cpu_smoke_path_needs_no_dataset_path(tmp_path, capsys):
    """docs/recipes.md's smoke run of a recipe: --shrink_model on a CPU (bf16 off) trains the
    bundled arithmetic data, not the recipe's Hub dataset, with no --dataset_path."""
    recipe = REPO / "examples" / "recipes" / "qwen3-14b.yaml"
    assert yaml.safe_load(recipe.read_text())["dataset_name"] == "trl-lib/Capybara"
    argv = [
        "--config", str(recipe), "--random_init_from_config", "qwen3-14b", "--shrink_model",
        "--bf16", "false", "--max_steps", "2", "--output_dir", str(tmp_path / "out"),
        "--dataloader_pin_memory", "false",
    ]  # fmt: skip
    trainer, _, _ = _trained(argv)
    assert trainer.state.global_step == 2
    assert len(trainer.train_dataset) == arithmetic.SFT_ROWS  # the bundled rows, tokenized
    out = capsys.readouterr().out
    assert "training on the bundled arithmetic data, not trl-lib/Capybara" in out


@pytest.mark.parametrize("name", sorted(MOE))
def test_moe_experts_without_tokens_step_as_adamw_steps_them(name, tmp_path):
    """The same 3 steps through SuperOffload and through TRL's trainer with torch's AdamW:
    equal params to fp32 rounding, including the rows of experts that got no token."""
    base = ["--config", str(REPO / "examples" / "recipes" / f"{name}.yaml"),
            "--random_init_from_config", name, "--shrink_model", "--optim", "adamw_torch",
            "--max_grad_norm", "0.5", "--learning_rate", "1e-3",
            # As in tests/test_trainer_dropin.py: with 1e-8, rows whose second moment is tiny
            # turn fp32 rounding of sqrt(v) into visible parameter differences.
            "--adam_epsilon", "1e-6"]  # fmt: skip
    ours, ours_model, experts = _trained([*base, *_cpu_overrides(tmp_path / "ours", 3)])
    assert any(experts.unused)
    plain, plain_model, _ = _trained(
        [*base, *_cpu_overrides(tmp_path / "plain", 3), "--optimizer", "adamw"]
    )
    assert type(plain.optimizer.optimizer).__name__ == "AdamW"
    ours_losses = [log["loss"] for log in ours.state.log_history if "loss" in log]
    plain_losses = [log["loss"] for log in plain.state.log_history if "loss" in log]
    assert ours_losses == pytest.approx(plain_losses, rel=1e-5)
    plain_params = dict(plain_model.named_parameters())
    for pname, param in ours_model.named_parameters():
        torch.testing.assert_close(param, plain_params[pname], **PARAM_TOL, msg=pname)


def test_dpo_script_trains_two_steps_through_superoffload(tmp_path):
    summary = run.train("dpo", ["--max_steps", "2", "--output_dir", str(tmp_path / "out")])
    assert summary["steps"] == 2 and summary["optimizer"] == "SuperOffloadOptimizer"
    assert summary["losses"][0] == pytest.approx(math.log(2), abs=1e-4)  # policy == reference
    assert (tmp_path / "out" / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "out" / "dpo_summary.json").read_text())["kind"] == "dpo"


def test_bundled_preference_pairs_are_the_generators_output(tmp_path):
    spec = importlib.util.spec_from_file_location("gen", DPO_DATA.parent / "make_arithmetic_dpo.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    out = tmp_path / "pairs.jsonl"
    gen.main(["--output", str(out)])
    assert out.read_bytes() == DPO_DATA.read_bytes()
    rows = [json.loads(line) for line in DPO_DATA.read_text().splitlines()]
    assert len(rows) == len({r["prompt"] for r in rows}) == 600
    apply = {"+": operator.add, "-": operator.sub, "*": operator.mul}
    for row in rows:
        a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)=", row["prompt"]).groups()
        assert apply[op](int(a), int(b)) == int(row["chosen"]) != int(row["rejected"])


def _launch(tmp_path: Path, name: str, *args: str, **variables: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DRY_RUN": "1", "RUNS_DIR": str(tmp_path), "PYTHON": "python"}
    env.pop("RATIO", None)
    env.update(variables)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    return run_launched(
        ["bash", str(REPO / "examples" / f"finetune_{name}.sh"), *args], timeout=QUICK, env=env
    )


@pytest.mark.parametrize("mode", ["superoffload", "zerooffload"])
def test_launcher_writes_the_configs_it_uses_and_a_command_that_parses(mode, tmp_path):
    proc = _launch(tmp_path, "qwen3-30b-a3b", mode, "2", "--max_steps", "5")
    assert proc.returncode == 0, proc.stderr
    (run_dir,) = tmp_path.iterdir()
    assert run_dir.name.startswith(f"qwen3-30b-a3b_{mode}_b2_")
    accelerate = yaml.safe_load((run_dir / "accelerate.yaml").read_text())
    assert accelerate["num_processes"] == 2 and accelerate["distributed_type"] == "DEEPSPEED"
    assert accelerate["deepspeed_config"]["deepspeed_config_file"] == str(
        run_dir / "deepspeed.json"
    )
    offload = json.loads((run_dir / "deepspeed.json").read_text())["zero_optimization"]
    assert offload["stage"] == 3 and offload["offload_optimizer"]["device"] == "cpu"
    flag = offload["offload_optimizer"].get("super_offload", False)
    assert flag == ("hf_superoffload" if mode == "superoffload" else False)
    assert (run_dir / "recipe.yaml").read_text() == (
        REPO / "examples" / "recipes" / "qwen3-30b-a3b.yaml"
    ).read_text()
    command = shlex.split((run_dir / "command.sh").read_text().splitlines()[-1])
    config_file = str(run_dir / "accelerate.yaml")
    assert command[:4] == ["accelerate", "launch", "--config_file", config_file]
    script_args = command[5:]
    assert ("--optimizer" in script_args) is (mode == "zerooffload")
    _, training = arguments.parse("sft", [*script_args, "--bf16", "false"])
    assert training.per_device_train_batch_size == 2 and training.max_steps == 5
    assert training.output_dir == str(run_dir / "output")


def _written_ratio(tmp_path: Path) -> float:
    (run_dir,) = tmp_path.iterdir()
    config = json.loads((run_dir / "deepspeed.json").read_text())
    return config["zero_optimization"]["offload_optimizer"]["ratio"]


@pytest.mark.slow
def test_launcher_sizes_the_gpu_tail_by_the_memory_plan(tmp_path):
    """RATIO=auto (the default) writes the plan's lowest fitting ratio into the run's
    DeepSpeed JSON and keeps the plan; a given RATIO is written as is."""
    # An H100 whose host also holds a resume (the plan counts DeepSpeed's checkpoint load).
    hardware = "--hardware h100 --cpu-mem 512"
    proc = _launch(tmp_path / "auto", "llama-3.1-8b", "superoffload", PLAN_HARDWARE=hardware)
    assert proc.returncode == 0, proc.stderr
    # (the plan counts TRL's fused LM head, which examples/sft.py computes the loss with)
    assert "RATIO=auto: ratio 0.7" in proc.stdout
    assert _written_ratio(tmp_path / "auto") == 0.7
    (run_dir,) = (tmp_path / "auto").iterdir()
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["run"]["ratio"] == 0.7 and plan["run"]["batch"] == 4
    proc = _launch(tmp_path / "fixed", "llama-3.1-8b", "superoffload", "2", RATIO="0.9")
    assert proc.returncode == 0, proc.stderr
    assert _written_ratio(tmp_path / "fixed") == 0.9


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="plans for this machine's GPU here")
def test_a_dry_run_without_a_gpu_says_which_ratio_it_wrote(tmp_path):
    proc = _launch(tmp_path, "phi-4", "superoffload")
    assert proc.returncode == 0, proc.stderr
    assert "no GPU here to plan for, so this dry run writes ratio 1.0" in proc.stderr
    assert _written_ratio(tmp_path) == 1.0


@pytest.mark.parametrize(
    ("mode", "variables", "code", "message"),
    [
        ("superoffload", {"RATIO": "1.5"}, 2, "RATIO must be 'auto' or a number in [0, 1]"),
        ("zerooffload", {"RATIO": "0.9"}, 2, "RATIO applies to superoffload mode"),
        pytest.param(
            "superoffload",
            {"PLAN_HARDWARE": "--hardware h100"},
            1,
            "host: needs",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_launcher_refuses_a_ratio_it_cannot_use(mode, variables, code, message, tmp_path):
    proc = _launch(tmp_path, "qwen3-14b", mode, **variables)
    assert proc.returncode == code and message in proc.stderr, proc.stderr
    assert not any(tmp_path.glob("*/command.sh"))


@pytest.mark.slow
def test_launcher_shows_the_plans_own_error_when_it_cannot_plan(tmp_path):
    """A model whose config the plan cannot read is a bad input (exit 2, the plan's message),
    not a model that fits at no ratio."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama", "hidden_size": "wide"}')
    proc = _launch(tmp_path / "runs", "llama-3.1-8b", "superoffload",
                   MODEL_PATH=str(model), PLAN_HARDWARE="--hardware h100")  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "RATIO=auto could not plan llama-3.1-8b" in proc.stderr
    assert "fits" not in proc.stderr
    assert not any((tmp_path / "runs").glob("*/command.sh"))


def test_launcher_refuses_an_unknown_mode_or_batch(tmp_path):
    assert _launch(tmp_path, "phi-4", "fastoffload").returncode == 2
    proc = _launch(tmp_path, "phi-4", "superoffload", "four")
    assert proc.returncode == 2 and "batch_size must be a positive integer" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "optimizer"),
    [
        ("superoffload", "SuperOffloadZero3Optimizer"),
        ("zerooffload", "DeepSpeedZeroOptimizer_Stage3"),
    ],
)
def test_two_gpu_moe_recipe_trains_on_the_zero3_path_of_its_mode(mode, optimizer, tmp_path):
    """The 2-GPU MoE recipe with the DeepSpeed JSON its launcher mode uses, on one CPU rank
    (DeepSpeed's CPU accelerator, gloo): ours steps it with super_offload, DeepSpeed's own
    CPU offload without."""
    config = "zero3_superoffload.json" if mode == "superoffload" else "zero3_offload.json"
    argv = [
        sys.executable, str(REPO / "examples" / "sft.py"),
        "--config", str(REPO / "examples" / "recipes" / "qwen3-30b-a3b.yaml"),
        "--random_init_from_config", "qwen3-30b-a3b", "--shrink_model",
        *_cpu_overrides(tmp_path), "--use_cpu", "true", "--require_loss_decrease", "false",
        "--deepspeed", str(REPO / "accelerate_configs" / "deepspeed" / config),
        *(["--optimizer", "adamw"] if mode == "zerooffload" else []),
    ]  # fmt: skip
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}  # fmt: skip
    proc = run_launched(argv, timeout=ONE_PROCESS, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "sft_summary.json").read_text())
    assert summary["steps"] == 2 and all(math.isfinite(x) for x in summary["losses"])
    assert summary["optimizer"] == optimizer
    assert (summary["superoffload_stats"] is not None) is (mode == "superoffload")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--shrink_model"], "--shrink_model shrinks the config of --random_init_from_config"),
        (["--dataset_path", "rows.txt"], "cannot tell the format from '.txt'"),
        (["--dataset_path", "missing.jsonl"], "missing.jsonl: no such file"),
        (["--random_init_from_config", "qwen9-1t", "--bf16", "false"], "shipped: gpt-oss-20b"),
    ],
)
def test_bad_script_arguments_say_what_to_change(argv, message, tmp_path):
    with pytest.raises(ValueError, match=re.escape(message)):
        run.build_trainer("sft", [*argv, "--output_dir", str(tmp_path)])


def test_zerooffload_json_is_the_superoffload_one_without_the_flag():
    """The two modes compare optimizers, not settings: the JSONs differ only in SuperOffload's
    own keys (and the comment)."""
    folder = REPO / "accelerate_configs" / "deepspeed"
    ours = json.loads((folder / "zero3_superoffload.json").read_text())
    baseline = json.loads((folder / "zero3_offload.json").read_text())
    for config in (ours, baseline):
        config.pop("_comment")
    offload = ours["zero_optimization"]["offload_optimizer"]
    assert offload.pop("super_offload") == "hf_superoffload"
    offload.pop("cpuadam_cores_perc")
    assert ours == baseline
