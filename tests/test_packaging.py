"""The package metadata (setup.cfg): hard requirements are only what every path needs, the rest
are extras, every requirement has a tested lower and upper bound (the libraries of the upstream
surface: exactly its tested range), the running environment is within them, every library the
package imports is declared, and a missing extra is named with the pip install to run."""

from __future__ import annotations

import ast
import configparser
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from hf_superoffload import extras, upstream

REPO = Path(__file__).resolve().parents[1]
OPTIONAL = {
    "deepspeed", "trl", "wandb", "datasets", "matplotlib", "psutil", "torchao", "liger_kernel"
}  # fmt: skip
# Import name -> distribution name, where they differ.
# triton: torch's CUDA wheels for Linux bring it; only the GPU tail's compact update imports it
# (ops/compact_triton_kernel.py, on first use, with an error naming it where it is missing).
DISTRIBUTION_OF = {"yaml": "pyyaml", "triton": "torch"}


def _setup_cfg() -> configparser.ConfigParser:
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    return config


def _requirements(text: str) -> list[Requirement]:
    return [Requirement(line) for line in text.strip().splitlines() if line.strip()]


def _hard() -> list[Requirement]:
    return _requirements(_setup_cfg()["options"]["install_requires"])


def _extras() -> dict[str, list[Requirement]]:
    section = _setup_cfg()["options.extras_require"]
    return {name: _requirements(section[name]) for name in section}


def _external(requirements) -> list[Requirement]:
    return [r for r in requirements if r.name != "hf_superoffload"]


def test_hard_requirements_hold_no_optional_library():
    names = {r.name.lower() for r in _hard()}
    assert {"torch", "transformers", "accelerate"} <= names
    assert names.isdisjoint(OPTIONAL | {"evaluate"})


def test_the_extras():
    found = _extras()
    assert set(found) == {"deepspeed", "trl", "wandb", "bench", "liger", "all", "dev"}
    assert [r.name for r in found["deepspeed"]] == ["deepspeed"]
    assert {r.name for r in found["trl"]} == {"trl", "datasets", "matplotlib"}
    assert found["all"] == [Requirement("hf_superoffload[deepspeed,trl,wandb,bench,liger]")]
    assert [r.name for r in found["liger"]] == ["liger-kernel"]
    dev = {r.name for r in _external(found["dev"])}
    assert {"pytest", "ruff"} <= dev
    # dev installs what the CPU tests import: every extra but bench's GPU-only torchao.
    assert found["dev"][0] == Requirement("hf_superoffload[deepspeed,trl,wandb]")
    assert {r.name for r in found["bench"]} - {"torchao"} <= dev | {"matplotlib"}
    for name, requirements in found.items():
        for requirement in requirements:
            assert requirement.name != "evaluate", name


def _all_requirements() -> list[Requirement]:
    return _hard() + [r for rs in _extras().values() for r in _external(rs)]


@pytest.mark.parametrize("requirement", _all_requirements(), ids=str)
def test_each_requirement_has_a_lower_and_an_upper_bound(requirement):
    operators = sorted(spec.operator for spec in requirement.specifier)
    assert operators == ["<", ">="], requirement


def _bounds(specifier) -> dict[str, Version]:
    return {spec.operator: Version(spec.version) for spec in specifier}


@pytest.mark.parametrize("library", [*upstream.LIBRARIES, "torch"])
def test_the_bounds_of_the_upstream_libraries_are_their_tested_range(library):
    declared = {r.name: r for r in _all_requirements()}[library]
    tested = SpecifierSet(upstream.supported_range(library))
    assert _bounds(declared.specifier) == _bounds(tested)


@pytest.mark.parametrize(
    "requirement",
    # torchao and liger-kernel: GPU only, outside the CPU tier's [dev]
    [r for r in _all_requirements() if r.name not in ("torchao", "liger-kernel")],
    ids=str,
)
def test_the_installed_version_is_within_the_declared_bounds(requirement):
    installed = metadata.version(requirement.name)
    # A local build tag (torch's +cpu) is no other version.
    assert requirement.specifier.contains(installed.split("+")[0], prereleases=True), installed


def _imported_libraries() -> set[str]:
    found = set()
    for path in (REPO / "hf_superoffload").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"hf_superoffload"}


def test_every_imported_library_is_declared():
    declared = {r.name.lower().replace("-", "_") for r in _all_requirements()}
    imported = {DISTRIBUTION_OF.get(name, name) for name in _imported_libraries()}
    assert sorted(imported - declared) == []
    # ... and each optional one has its extra in extras.py, for the error that names it.
    assert sorted((imported & OPTIONAL) - set(extras.EXTRA_OF)) == []


def test_extras_of_extras_py_match_setup_cfg():
    found = _extras()
    for module, extra in extras.EXTRA_OF.items():
        assert module in {r.name.replace("-", "_") for r in found[extra]}, (module, extra)


def _run_without(module: str, code: str) -> subprocess.CompletedProcess:
    """Python with ``module`` absent (a None entry in sys.modules: Python's own mark for it)."""
    program = f"import sys\nsys.modules[{module!r}] = None\n{code}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.mark.parametrize(
    ("module", "extra", "code"),
    [
        ("trl", "trl", "from hf_superoffload import SuperOffloadSFTTrainer"),
        ("datasets", "trl", "import hf_superoffload.recipes.run"),
        ("matplotlib", "trl", "from hf_superoffload.recipes import report"),
        ("deepspeed", "deepspeed", "from hf_superoffload.zero3 import SuperOffloadZero3Optimizer"),
    ],
)
def test_a_missing_extra_names_its_pip_install(module, extra, code):
    done = _run_without(module, code)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last == (
        f"hf_superoffload.extras.MissingExtraError: {module} is not installed "
        f'({_purpose(code)} uses it): pip install "hf_superoffload[{extra}]"'
    )


def _purpose(code: str) -> str:
    if "recipes" in code:
        return "the recipes and the demo"
    if "zero3" in code:
        return "SuperOffload on DeepSpeed ZeRO-3"
    return "the SuperOffload TRL trainers"


def test_the_optimizer_and_the_trainer_mixin_need_no_extra():
    """The core ways in work with every optional library absent."""
    blocked = "".join(f"sys.modules[{m!r}] = None\n" for m in sorted(OPTIONAL))
    code = blocked + (
        "from hf_superoffload import SuperOffloadOptimizer, SuperOffloadTrainer\n"
        "from hf_superoffload import SuperOffloadTrainingArguments, SuperOffloadOptions\n"
        "print('ok')\n"
    )
    done = _run_without("wandb", code)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "ok"


def test_require_raises_for_the_first_missing_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    assert not extras.is_installed("wandb")
    with pytest.raises(extras.MissingExtraError) as missing:
        extras.require("torch", "wandb", purpose="logging to wandb")
    assert missing.value.name == "wandb"
    assert 'pip install "hf_superoffload[wandb]"' in str(missing.value)


def test_no_test_module_sets_the_deepspeed_accelerator_for_the_whole_session():
    """pytest imports every test module at collection, selected or not: a module-level
    DS_ACCELERATOR=cpu made the GPU tier's ZeRO-3 ranks run DeepSpeed's CPU accelerator over
    NCCL. conftest.py sets it for machines without a GPU; a module may only do so behind that
    same check."""
    for path in sorted((REPO / "tests").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level, outside any if/def
            call = isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
            if call and "DS_ACCELERATOR" in ast.unparse(node):
                raise AssertionError(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
