"""Activation patches DeepSpeed's modules as they are imported, through a finder on
``sys.meta_path`` that asks the other finders for the real module. Another finder doing the same
(a sitecustomize, a profiler, a test harness) must not make the two ask each other forever."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import importlib.abc, os, sys
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

    class AsksTheOthers(importlib.abc.MetaPathFinder):
        # Wraps DeepSpeed's config module as ours does: asks every other finder for it.
        def find_spec(self, fullname, path, target=None):
            if fullname != "deepspeed.runtime.config":
                return None
            for finder in sys.meta_path:
                if finder is not self and hasattr(finder, "find_spec"):
                    spec = finder.find_spec(fullname, path, target)
                    if spec is not None:
                        return spec
            return None

    sys.meta_path.insert(0, AsksTheOthers())
    import hf_superoffload  # puts its own finder first
    import deepspeed.runtime.config as config
    # Our patch ran on the module: get_zero_config is our wrapper (patches.read_super_offload_config).
    from hf_superoffload.zero3.patches import _MARK
    print("patched" if getattr(config.get_zero_config, _MARK, False) else "not patched")
    """
)


@pytest.mark.slow
def test_a_second_finder_that_asks_the_others_does_not_recurse():
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RecursionError" not in done.stderr
    assert done.stdout.strip().endswith("patched")
