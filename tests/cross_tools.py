"""The aarch64 cross-compiler and qemu the ARM kernel checks run with (CI installs both:
apt-get install g++-aarch64-linux-gnu qemu-user); elsewhere those tests are skipped."""

from __future__ import annotations

import os
import shutil

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
