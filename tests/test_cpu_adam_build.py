"""The CPU Adam's build: prepare() announces a compile, and checkouts share one cached build.

Most tests stand in for the compiler (``_build._compile``) and the loader
(``_build._import_library``) with spies, in a cache under tmp_path, and leave the process's
loaded extension (``_build._module``) as it was. One test loads the real build from a second
copy of the package in a subprocess (no compile: it reuses the build the other tests load);
the slow one compiles for real into an empty cache.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from hf_superoffload import ops
from hf_superoffload.ops import _build

REPO = Path(_build.__file__).resolve().parents[2]


class FakeToolchain:
    """Spies standing in for the compile step and the library import."""

    def __init__(self, caplog):
        self.caplog = caplog
        self.compiles: list[tuple[str, list[Path], Path]] = []
        self.imports: list[Path] = []
        self.records_at_compile: list[logging.LogRecord] = []

    def compile(self, name, sources, folder):
        self.compiles.append((name, list(sources), folder))
        self.records_at_compile = list(self.caplog.records)
        library = folder / f"{name}.so"
        library.write_bytes(b"fake library")
        return SimpleNamespace(__name__=name, __file__=str(library))

    def import_library(self, name, library):
        self.imports.append(library)
        return SimpleNamespace(__name__=name, __file__=str(library))


@pytest.fixture
def fake(monkeypatch, tmp_path, caplog):
    """An empty cache under tmp_path, no extension loaded, spies for compile and import."""
    monkeypatch.setenv("HF_SUPEROFFLOAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(_build, "_module", None)  # restored afterwards for the other tests
    tools = FakeToolchain(caplog)
    monkeypatch.setattr(_build, "_compile", tools.compile)
    monkeypatch.setattr(_build, "_import_library", tools.import_library)
    caplog.set_level(logging.DEBUG, logger="hf_superoffload")
    return tools


def _checkout(root: Path, monkeypatch) -> None:
    """Point the build at a copy of the C++ sources in ``root``, as another checkout would."""
    shutil.copytree(_build.CSRC, root / "csrc")
    monkeypatch.setattr(_build, "CSRC", root / "csrc")


def _loud(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_prepare_is_exported():
    assert ops.prepare.__module__ == ops.__name__  # _build.prepare, then the ISA variable's check
    assert "prepare" in ops.__all__


def test_prepare_warns_before_compiling_and_logs_the_time(fake, caplog):
    module = ops.prepare()

    assert len(fake.compiles) == 1
    name, sources, folder = fake.compiles[0]
    assert folder == _build.build_dir()
    # The warning came before the compile and says what, how long, where and how to pre-build.
    [warning] = [r for r in fake.records_at_compile if r.levelno == logging.WARNING]
    text = warning.getMessage()
    assert "compiling its C++ CPU Adam" in text
    assert "1-2 minutes" in text
    assert str(folder) in text and "HF_SUPEROFFLOAD_CACHE" in text
    assert 'python -c "import hf_superoffload.ops as o; o.prepare()"' in text
    [done] = [r for r in caplog.records if "built the CPU Adam in" in r.getMessage()]
    assert done.levelno == logging.INFO
    # Built from the copy in the cache, not from the checkout.
    assert [p.parent for p in sources] == [folder / "csrc"] * len(_build.SOURCES)
    record = json.loads((folder / "build.json").read_text())
    assert record["module"] == name and record["library"] == f"{name}.so"
    assert ops.load_extension() is module  # kept for the rest of the process


def test_a_cached_build_loads_without_compiling_or_warning(fake, caplog, monkeypatch):
    ops.prepare()
    folder = _build.build_dir()
    monkeypatch.setattr(_build, "_module", None)  # as a new process would start
    caplog.clear()

    module = ops.prepare()

    assert len(fake.compiles) == 1  # only the first
    assert fake.imports == [folder / f"{fake.compiles[0][0]}.so"]
    assert module.__file__ == str(fake.imports[0])
    assert _loud(caplog) == []
    assert ops.prepare() is module and len(fake.imports) == 1  # no reload within the process


def test_two_checkouts_of_the_same_sources_share_one_build(fake, caplog, tmp_path, monkeypatch):
    _checkout(tmp_path / "a", monkeypatch)
    ops.prepare()
    folder = _build.build_dir()
    copied = {p.name: p.stat().st_mtime_ns for p in (folder / "csrc").iterdir()}

    _checkout(tmp_path / "b", monkeypatch)
    monkeypatch.setattr(_build, "_module", None)
    caplog.clear()
    ops.prepare()

    assert _build.build_dir() == folder
    assert len(fake.compiles) == 1 and len(fake.imports) == 1
    assert _loud(caplog) == []
    assert {p.name: p.stat().st_mtime_ns for p in (folder / "csrc").iterdir()} == copied

    # Other sources build into a folder of their own.
    with open(tmp_path / "b" / "csrc" / "dispatch.cpp", "a") as f:
        f.write("\n// changed\n")
    monkeypatch.setattr(_build, "_module", None)
    ops.prepare()
    assert len(fake.compiles) == 2
    assert fake.compiles[1][2] == _build.build_dir() != folder


def test_sources_are_copied_whole_and_once(tmp_path):
    folder = tmp_path / "tag"
    folder.mkdir()
    dest = _build._copy_sources(folder)
    assert dest == folder / "csrc"
    assert sorted(p.name for p in dest.iterdir()) == sorted(_build.SOURCES + _build.HEADERS)
    for p in dest.iterdir():
        assert p.read_bytes() == (_build.CSRC / p.name).read_bytes()
    assert [p.name for p in folder.iterdir()] == ["csrc"]  # no temporary folder left
    inode = dest.stat().st_ino

    assert _build._copy_sources(folder) == dest
    assert dest.stat().st_ino == inode  # kept, not rewritten

    (dest / "adam_math.h").write_text("// damaged\n")
    (dest / "binding.cpp").unlink()
    _build._copy_sources(folder)
    assert _build._sources_match(dest)
    assert [p.name for p in folder.iterdir()] == ["csrc"]


def test_missing_tools_stop_a_build_but_not_a_cached_load(fake, caplog, monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    with pytest.raises(_build.BuildToolMissingError, match=r"apt-get install g\+\+"):
        ops.prepare()
    assert fake.compiles == [] and _loud(caplog) == []

    monkeypatch.delenv("CXX")
    ops.prepare()
    monkeypatch.setattr(_build, "_module", None)
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    monkeypatch.setattr(_build.cpp_extension, "is_ninja_available", lambda: False)
    ops.prepare()  # a cached build needs neither compiler nor ninja
    assert len(fake.compiles) == 1 and len(fake.imports) == 1


def test_a_process_waiting_for_another_builder_says_so_and_loads_its_build(fake, caplog):
    folder = _build.build_dir()
    folder.mkdir(parents=True)
    result: dict[str, object] = {}
    with open(folder / ".build.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another builder at work

        def run():
            try:
                result["module"] = ops.prepare()
            except BaseException as error:  # reported below
                result["error"] = error

        thread = threading.Thread(target=run)
        thread.start()
        deadline = time.monotonic() + 30
        while not any("another process is building" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "no warning about waiting"
            time.sleep(0.01)
        # The other builder finishes: its library and record appear, then it lets go.
        (folder / "other.so").write_bytes(b"fake library")
        (folder / "build.json").write_text(json.dumps({"module": "other", "library": "other.so"}))
        fcntl.flock(held, fcntl.LOCK_UN)
    thread.join(30)

    assert "error" not in result, result.get("error")
    assert result["module"].__file__ == str(folder / "other.so")
    assert fake.compiles == []
    [waiting] = _loud(caplog)
    assert "o.prepare()" in waiting.getMessage()


def test_a_torch_lock_left_by_a_killed_builder_does_not_hang_the_build(fake, monkeypatch):
    folder = _build.build_dir()
    folder.mkdir(parents=True)
    (folder / "lock").touch()  # torch's baton; its builder died
    checked = []

    def compile_checking(name, sources, folder_):
        checked.append((folder_ / "lock").exists())
        return fake.compile(name, sources, folder_)

    monkeypatch.setattr(_build, "_compile", compile_checking)
    ops.prepare()
    assert checked == [False]


def test_a_broken_cached_library_says_how_to_rebuild(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_SUPEROFFLOAD_CACHE", str(tmp_path))
    monkeypatch.setattr(_build, "_module", None)
    folder = _build.build_dir()
    folder.mkdir(parents=True)
    (folder / "broken.so").write_bytes(b"not a shared object")
    (folder / "build.json").write_text(json.dumps({"module": "broken", "library": "broken.so"}))
    with pytest.raises(ImportError, match=re.escape(f"Delete {folder} to have it rebuilt")):
        ops.prepare()


def _copy_package(root: Path) -> Path:
    shutil.copytree(
        REPO / "hf_superoffload",
        root / "hf_superoffload",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    return root


PROBE = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
import torch
import hf_superoffload
from hf_superoffload.ops import _build
if sys.argv[1] == "no-compile":
    def refuse(*args):
        raise AssertionError("compiled again")
    _build._compile = refuse
import hf_superoffload.ops as ops
module = ops.prepare()
p, g, m, v = torch.ones(4), torch.ones(4), torch.zeros(4), torch.zeros(4)
ops.adam_step(p, g, m, v, step=1, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
print(json.dumps({"package": hf_superoffload.__file__, "library": module.__file__,
                  "folder": str(_build.build_dir()), "param": p.tolist()}))
"""


def _probe(checkout: Path, mode: str, env: dict[str, str]) -> tuple[dict, str]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        cwd=checkout,
        env={**env, "PYTHONPATH": str(checkout)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(result["package"]).is_relative_to(checkout)  # really the other checkout
    assert result["param"] == pytest.approx([0.9] * 4)
    return result, done.stderr


def _mtimes(folder: Path) -> dict[str, int]:
    return {
        p.name: p.stat().st_mtime_ns
        for p in folder.iterdir()
        if p.suffix in (".so", ".o", ".ninja") or p.name == "build.json"
    }


def test_another_checkout_loads_the_real_build_without_compiling(tmp_path):
    module = ops.prepare()  # the build the CPU Adam tests use (compiled here if need be)
    folder = _build.build_dir()
    before = _mtimes(folder)
    checkout = _copy_package(tmp_path / "other-checkout")

    result, log = _probe(checkout, "no-compile", dict(os.environ))

    assert result["folder"] == str(folder)
    assert Path(result["library"]) == Path(module.__file__)
    assert "compiling" not in log and "WARNING" not in log
    assert _mtimes(folder) == before


@pytest.mark.slow
def test_a_real_build_is_shared_by_two_checkouts(tmp_path):
    """About a minute or two: compiles once into an empty cache from checkout a."""
    env = {**os.environ, "HF_SUPEROFFLOAD_CACHE": str(tmp_path / "cache")}
    env.pop("HF_SUPEROFFLOAD_VERBOSE_BUILD", None)
    a = _copy_package(tmp_path / "a")
    b = _copy_package(tmp_path / "b")

    first, log = _probe(a, "build", env)
    assert "WARNING hf_superoffload: compiling its C++ CPU Adam" in log
    assert "INFO hf_superoffload: built the CPU Adam in" in log
    assert log.index("compiling its C++") < log.index("built the CPU Adam in")
    folder = Path(first["folder"])
    assert str(a) not in (folder / "build.ninja").read_text()  # built from the cache's copy
    before = _mtimes(folder)

    second, log = _probe(b, "no-compile", env)
    assert second["library"] == first["library"]
    assert "WARNING" not in log
    assert _mtimes(folder) == before

    # Without the record (a builder killed after ninja finished) checkout b runs ninja over
    # the same copied sources: nothing is recompiled.
    (folder / "build.json").unlink()
    third, _ = _probe(b, "build", env)
    assert third["library"] == first["library"]
    after = _mtimes(folder)
    del after["build.json"], before["build.json"]  # written anew
    assert after == before  # objects, library and build.ninja untouched
