"""The aarch64 cross-compiler and qemu the ARM kernel checks run with (CI installs both:
apt-get install g++-aarch64-linux-gnu qemu-user); elsewhere those tests are skipped."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest


def tool(name: str) -> str:
    """The path of ``name``: a failure under CI, a skip elsewhere when it is missing."""
    path = shutil.which(name)
    if path is None:
        message = (
            f"{name} not found (CI installs it: apt-get install g++-aarch64-linux-gnu qemu-user)"
        )
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


def build_aarch64(check_source: Path, kernel_sources: list[Path], binary: Path) -> Path:
    """A static aarch64 build of a torch-free check program with the kernel sources, under the
    package's own compiler flags."""
    from hf_superoffload.ops._build import CFLAGS, CSRC

    flags = [f for f in CFLAGS if f != "-std=c++17"]
    cmd = [tool("aarch64-linux-gnu-g++"), "-std=c++17", *flags, "-static", f"-I{CSRC}"]
    subprocess.run([*cmd, str(check_source), *map(str, kernel_sources), "-o", str(binary)],
                   check=True)  # fmt: skip
    return binary


def run_aarch64(binary: Path, cpu: str, *args: str) -> subprocess.CompletedProcess:
    """``binary`` under qemu-aarch64 with CPU model ``cpu`` (e.g. "max,sve512=on")."""
    qemu = tool("qemu-aarch64")
    return subprocess.run(
        [qemu, "-cpu", cpu, str(binary), *args], capture_output=True, text=True, timeout=120
    )
