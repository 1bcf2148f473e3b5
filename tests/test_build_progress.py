"""The compile's progress bar counts the object files ninja writes (ops/build_progress.py)."""

from __future__ import annotations

import os
import time

from hf_superoffload.ops.build_progress import BuildProgress


def test_the_bar_follows_new_object_files_and_ends_full(tmp_path):
    (tmp_path / "old.o").write_text("")  # from an earlier build: not counted
    past = time.time() - 60
    os.utime(tmp_path / "old.o", (past, past))
    with BuildProgress(tmp_path, sources=3, interval=0.01, disable=False) as progress:
        assert progress.compiled() == 0
        (tmp_path / "a.o").write_text("")
        (tmp_path / "b.o").write_text("")
        deadline = time.monotonic() + 5
        while progress._bar.n < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert progress._bar.n == 2 and progress.compiled() == 2
    assert progress._bar.n == progress._bar.total == 4  # 3 sources and the link, on success


def test_an_object_stamped_a_moment_before_the_start_counts(tmp_path):
    """File times come from the kernel's coarse clock, a few ms behind time.time(): an object
    written right after the build started can carry an earlier time. It is new all the same
    (this made the test above fail now and then on a busy machine)."""
    with BuildProgress(tmp_path, sources=1, interval=60, disable=True) as progress:
        started = time.time()
        (tmp_path / "a.o").write_text("")
        os.utime(tmp_path / "a.o", (started - 0.01, started - 0.01))
        assert progress.compiled() == 1
