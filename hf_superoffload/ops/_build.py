"""Builds the C++ CPU Adam on first use with ``torch.utils.cpp_extension`` and caches it.

The cache lives in ``$HF_SUPEROFFLOAD_CACHE`` (default ``$XDG_CACHE_HOME/hf_superoffload`` or
``~/.cache/hf_superoffload``), in a folder named by a hash of the sources, the compiler flags,
the torch version and the Python version, so any change to them builds afresh while ranks
and later runs reuse the same build.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch
from torch.utils import cpp_extension

CSRC = Path(__file__).parent / "csrc"
SOURCES = (
    "isa_scalar.cpp",
    "isa_avx2.cpp",
    "isa_avx512.cpp",
    "isa_neon.cpp",
    "isa_sve.cpp",
    "dispatch.cpp",
    "binding.cpp",
)
HEADERS = ("adam_types.h", "adam_math.h")
# -ffp-contract=off: only the fused multiply-adds written in adam_math.h may fuse, so every
# instruction set rounds identically. No -march: each ISA file names its own target.
CFLAGS = ("-O3", "-std=c++17", "-fopenmp", "-ffp-contract=off", "-fno-math-errno")
LDFLAGS = ("-fopenmp",)


class BuildToolMissingError(RuntimeError):
    """A compiler or ninja, needed to build the CPU Adam on first use, is not installed."""


_lock = threading.Lock()
_module: ModuleType | None = None


def cache_root() -> Path:
    explicit = os.environ.get("HF_SUPEROFFLOAD_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "hf_superoffload"


def build_tag() -> str:
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update(name.encode())
        digest.update((CSRC / name).read_bytes())
    digest.update(" ".join(CFLAGS + LDFLAGS).encode())
    digest.update(torch.__version__.encode())
    digest.update(sys.version.encode())
    return digest.hexdigest()[:16]


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


def load_extension() -> ModuleType:
    """Return the compiled extension, building it on the first call of the process."""
    global _module
    with _lock:
        if _module is None:
            check_build_tools()
            tag = build_tag()
            build_dir = cache_root() / "ops" / tag
            build_dir.mkdir(parents=True, exist_ok=True)
            _module = cpp_extension.load(
                name=f"hf_superoffload_cpu_adam_{tag}",
                sources=[str(CSRC / name) for name in SOURCES],
                extra_cflags=list(CFLAGS),
                extra_ldflags=list(LDFLAGS),
                build_directory=str(build_dir),
                verbose=os.environ.get("HF_SUPEROFFLOAD_VERBOSE_BUILD") == "1",
            )
        return _module
