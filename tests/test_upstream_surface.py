"""The upstream surface (hf_superoffload/upstream.py): every listed name exists in the installed
DeepSpeed, transformers, accelerate and TRL, the list misses none that the package uses, the
installed versions are within the tested range, and a missing name is refused with a message
that names it and the tested versions."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
from packaging.version import Version

from hf_superoffload import upstream
from hf_superoffload.upstream import UpstreamChangedError

PACKAGE = Path(upstream.__file__).parent


@pytest.mark.parametrize("library", upstream.LIBRARIES)
def test_every_listed_name_exists(library):
    assert [str(name) for name in upstream.missing(library)] == []


@pytest.mark.parametrize("library", [*upstream.LIBRARIES, "torch"])
def test_installed_version_is_within_the_tested_range(library):
    oldest, newest = upstream.TESTED[library]
    installed = Version(upstream.installed_version(library)).release
    assert Version(oldest).release <= installed <= Version(newest).release


def _names_we_use(files) -> set[str]:
    """Underscored attributes read or written, methods defined, and underscored strings (the
    targets of getattr/setattr), in ``files``."""
    used = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                used.add(node.attr)
            elif isinstance(node, ast.FunctionDef):
                used.add(node.name)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                used.add(node.value)
    return {name for name in used if not (name.startswith("__") and name.endswith("__"))}


def _defined_by(cls, library) -> set[str]:
    return set(dir(cls)) | set(upstream._assigned_in(cls, library))


def test_the_list_has_every_private_deepspeed_name_the_zero3_path_uses():
    """A new use of a private name of DeepSpeed's ZeRO-3 optimizer or engine must be listed."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    used = _names_we_use(sorted((PACKAGE / "zero3").glob("*.py")))
    listed = {entry.name for entry in upstream.SURFACE}
    for cls in (DeepSpeedZeroOptimizer_Stage3, DeepSpeedEngine):
        private = {n for n in _defined_by(cls, "deepspeed") if n.startswith("_")}
        assert sorted(used & private - listed) == [], cls.__name__


def test_the_list_has_every_private_trainer_method_the_mixin_overrides():
    from transformers import Trainer

    used = _names_we_use([PACKAGE / "integrations" / n for n in ("trainer.py", "trainer_saves.py")])
    private = {n for n in dir(Trainer) if n.startswith("_") and not n.endswith("__")}
    listed = {entry.name for entry in upstream.SURFACE if entry.owner.endswith(":Trainer")}
    assert sorted(used & private - listed) == []


def test_name_mangled_attributes_are_found_and_a_missing_one_is_not():
    stage3 = "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3"
    mangled = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"
    assert upstream.exists(upstream.Name(stage3, mangled, "reads", kind="attribute"))
    gone = upstream.Name(stage3, "_DeepSpeedZeroOptimizer_Stage3__gone", "reads", kind="attribute")
    assert not upstream.exists(gone)
    assert not upstream.exists(upstream.Name("deepspeed.no_such_module", "x", "reads"))


def test_a_missing_name_is_refused_naming_it_and_the_tested_versions(monkeypatch):
    from transformers import Trainer

    monkeypatch.delattr(Trainer, "_save_checkpoint")
    upstream._checked.cache_clear()
    oldest, newest = upstream.TESTED["transformers"]
    with pytest.raises(UpstreamChangedError) as refused:
        upstream.check("transformers")
    upstream._checked.cache_clear()
    message = str(refused.value)
    assert "transformers.trainer.Trainer._save_checkpoint" in message
    assert f"transformers {oldest} to {newest}" in message
    assert f'pip install "transformers{upstream.supported_range("transformers")}"' in message


def test_a_patch_refuses_a_wrap_target_that_is_gone():
    from hf_superoffload.zero3 import patches

    comm = types.ModuleType("deepspeed.comm.comm")  # a DeepSpeed without mpi_discovery
    with pytest.raises(UpstreamChangedError, match=r"deepspeed\.comm\.comm\.mpi_discovery"):
        patches.one_process_without_launcher(comm)


def test_the_trainer_mixin_checks_transformers_when_it_is_defined():
    """Activation of the Trainer mixin: defining it with a transformers that lacks an
    overridden method stops at once, naming the method (not inside a training step)."""
    code = (
        "import transformers.trainer as t\n"
        "del t.Trainer._load_optimizer_and_scheduler\n"
        "import hf_superoffload.integrations.trainer\n"
    )
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("hf_superoffload.upstream.UpstreamChangedError: transformers ")
    assert "Trainer._load_optimizer_and_scheduler" in last


def test_supported_range_is_the_tested_range():
    oldest, newest = upstream.TESTED["deepspeed"]
    major, minor = newest.split(".")[:2]
    assert upstream.supported_range("deepspeed") == f">={oldest},<{major}.{int(minor) + 1}"
