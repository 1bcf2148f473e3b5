"""Builds the C++ CPU Adam with ``torch.utils.cpp_extension`` and caches it.

Call :func:`prepare` before training (the optimizers do so in their constructors) so that a
first-time build happens there, announced, and not silently inside the first optimizer step.

The cache lives in ``$HF_SUPEROFFLOAD_CACHE`` (default ``$XDG_CACHE_HOME/hf_superoffload`` or
``~/.cache/hf_superoffload``), in ``ops/<tag>``, where the tag is a hash of the sources, the
compiler flags, the torch and Python versions and the platform, so any change to them builds
afresh while ranks and later runs reuse the same build. The sources are copied into that
folder (``csrc/``, written once, atomically) and compiled from there, so ninja's build file
names no path of the checkout or virtual environment the build came from: every checkout with
the same sources shares one build. A finished build is recorded in ``build.json``; later
processes import the library it names directly, without running ninja (whose build file holds
the absolute torch include paths of the environment that built it, so ninja itself would
rebuild for a second virtual environment).

Concurrent processes serialise on an ``flock`` of ``.build.lock`` in the folder: one builds,
the others wait and then load its build. torch's own file baton (``lock``) still guards the
ninja run; one left behind by a builder that was killed is removed, since under the flock no
live builder can hold it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch
from torch.utils import cpp_extension

from .. import env
from .build_progress import BuildProgress

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX; torch's file baton alone then
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger("hf_superoffload")

CSRC = Path(__file__).parent / "csrc"
SOURCES = (
    "isa_scalar.cpp",
    "isa_avx2.cpp",
    "isa_avx512.cpp",
    "isa_neon.cpp",
    "isa_sve.cpp",
    "dispatch.cpp",
    "compact_dispatch.cpp",
    "binding.cpp",
)
HEADERS = (
    "adam_types.h",
    "adam_math.h",
    "compact_types.h",
    "compact_math.h",
    "compact_fused_math.h",
)
# -ffp-contract=off: only the fused multiply-adds written in adam_math.h may fuse (none in
# compact_math.h, as its reference has none), so every instruction set rounds identically. No -march: each ISA file names its own target.
CFLAGS = ("-O3", "-std=c++17", "-fopenmp", "-ffp-contract=off", "-fno-math-errno")
LDFLAGS = ("-fopenmp",)
# Bumped when the layout of a cache folder changes, so no folder is shared across layouts.
_CACHE_LAYOUT = "2"
_MARKER = "build.json"
_PREBUILD_COMMAND = 'python -c "import hf_superoffload.ops as o; o.prepare()"'


class BuildToolMissingError(RuntimeError):
    """A compiler or ninja, needed to build the CPU Adam on first use, is not installed."""


_lock = threading.Lock()
_module: ModuleType | None = None


def cache_root() -> Path:
    explicit = env.read("HF_SUPEROFFLOAD_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "hf_superoffload"


def build_tag() -> str:
    digest = hashlib.sha256()
    digest.update(f"layout={_CACHE_LAYOUT}".encode())
    for name in SOURCES + HEADERS:
        digest.update(name.encode())
        digest.update((CSRC / name).read_bytes())
    digest.update(" ".join(CFLAGS + LDFLAGS).encode())
    digest.update(torch.__version__.encode())
    digest.update(sys.version.encode())
    # A cache on a shared home directory may be reached from machines of other kinds.
    digest.update(f"{sys.platform} {platform.machine()}".encode())
    return digest.hexdigest()[:16]


def build_dir() -> Path:
    """The cache folder of this build: ``<cache_root>/ops/<build_tag>``."""
    return cache_root() / "ops" / build_tag()


def check_build_tools() -> None:
    """Raise BuildToolMissingError naming what to install if the build cannot run."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise BuildToolMissingError(
            f"hf_superoffload builds its CPU Adam on first use and needs a C++17 compiler, but "
            f"'{compiler}' (from $CXX, default 'c++') was not found on PATH. Install one "
            f"(Debian/Ubuntu: apt-get install g++) or point CXX at it."
        )
    if not cpp_extension.is_ninja_available():
        raise BuildToolMissingError(
            "hf_superoffload builds its CPU Adam on first use and needs ninja, which was not "
            "found. Install it with `pip install ninja` (or apt-get install ninja-build)."
        )


def prepare() -> ModuleType:
    """Build the CPU Adam now if it is not in the cache yet, and load it; returns the module.

    Call it before training so that the one-time build (about 1-2 minutes) does not land in
    an optimizer step. A build is announced with a warning on the ``hf_superoffload`` logger
    before it starts and its duration logged (info) after; loading a cached build logs
    nothing above debug. Later calls in the process return the loaded module at once. To
    build ahead of time, e.g. in a container image:
    ``python -c "import hf_superoffload.ops as o; o.prepare()"``.
    """
    return load_extension()


def load_extension() -> ModuleType:
    """Return the compiled extension, building it on the first call of the process."""
    global _module
    with _lock:
        if _module is None:
            _module = _load_or_build(build_dir())
        return _module


def _load_or_build(folder: Path) -> ModuleType:
    module = _load_cached(folder)
    if module is not None:
        return module
    folder.mkdir(parents=True, exist_ok=True)
    with _build_lock(folder):
        module = _load_cached(folder)  # another process may have built it while we waited
        if module is not None:
            return module
        return _build(folder)


def _load_cached(folder: Path) -> ModuleType | None:
    try:
        record = json.loads((folder / _MARKER).read_text())
        name, library = record["module"], folder / record["library"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not library.is_file():
        return None
    try:
        module = _import_library(name, library)
    except ImportError as error:
        raise ImportError(
            f"hf_superoffload could not load its cached CPU Adam {library}: {error}. Delete "
            f"{folder} to have it rebuilt."
        ) from error
    logger.debug("hf_superoffload: loaded the cached CPU Adam from %s", library)
    return module


def _build(folder: Path) -> ModuleType:
    check_build_tools()
    logger.warning(
        "hf_superoffload: compiling its C++ CPU Adam (%d files, torch.utils.cpp_extension with "
        "ninja); this is done once per machine and source version and takes about 1-2 minutes "
        "(about 75 s on 2 cores). The build is cached in %s (set HF_SUPEROFFLOAD_CACHE to move "
        "the cache). To build ahead of time, run: %s",
        len(SOURCES),
        folder,
        _PREBUILD_COMMAND,
    )
    start = time.perf_counter()
    sources = _copy_sources(folder)
    stale = folder / "lock"
    # torch's baton left by a killed builder: under our flock (which a dead process cannot
    # hold) no live builder holds it, and the folder is this package's own.
    if fcntl is not None and stale.exists():
        logger.warning(
            "hf_superoffload: removing %s, the build lock of a CPU Adam build that was stopped "
            "part-way (no builder holds %s)",
            stale,
            folder / ".build.lock",
        )
        stale.unlink(missing_ok=True)
    with BuildProgress(folder, len(SOURCES)):
        module = _compile(
            f"hf_superoffload_cpu_adam_{folder.name}",
            [sources / name for name in SOURCES],
            folder,
        )
    library = Path(module.__file__).resolve()
    seconds = time.perf_counter() - start
    _write_atomically(
        folder / _MARKER,
        json.dumps(
            {
                "module": module.__name__,
                "library": library.name,
                "torch": torch.__version__,
                "python": sys.version,
                "seconds": round(seconds, 1),
            },
            indent=1,
        ),
    )
    logger.info("hf_superoffload: built the CPU Adam in %.0f s (%s)", seconds, library)
    return module


def _compile(name: str, sources: list[Path], folder: Path) -> ModuleType:
    return cpp_extension.load(
        name=name,
        sources=[str(path) for path in sources],
        extra_cflags=list(CFLAGS),
        extra_ldflags=list(LDFLAGS),
        build_directory=str(folder),
        verbose=env.read("HF_SUPEROFFLOAD_VERBOSE_BUILD") == "1",
    )


def _import_library(name: str, library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(
            f"cannot load the CPU Adam library {library}; delete its folder "
            f"({library.parent}) so that the next start builds it again."
        )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sources_match(folder: Path) -> bool:
    try:
        return all(
            (folder / name).read_bytes() == (CSRC / name).read_bytes() for name in SOURCES + HEADERS
        )
    except OSError:
        return False


def _copy_sources(folder: Path) -> Path:
    """``folder/csrc``: a copy of the sources, created whole by one rename, then kept."""
    dest = folder / "csrc"
    if _sources_match(dest):
        return dest
    tmp = Path(tempfile.mkdtemp(prefix=".csrc-", dir=folder))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the sources from a shared cache's users
        for name in SOURCES + HEADERS:
            shutil.copyfile(CSRC / name, tmp / name)  # fresh mtimes, so ninja sees them new
        try:
            os.rename(tmp, dest)
        except OSError:
            # dest exists but differs (edited or cut short by hand): swap the fresh copy in.
            aside = folder / f".csrc-stale-{uuid.uuid4().hex}"
            os.rename(dest, aside)
            os.rename(tmp, dest)
            shutil.rmtree(aside, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    tmp.write_text(text)
    os.replace(tmp, path)


@contextmanager
def _build_lock(folder: Path) -> Iterator[None]:
    if fcntl is None:  # pragma: no cover
        yield
        return
    with open(folder / ".build.lock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning(
                "hf_superoffload: another process is building the CPU Adam in %s; waiting for "
                "it (a build takes about 1-2 minutes). To build ahead of time, run: %s",
                folder,
                _PREBUILD_COMMAND,
            )
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
