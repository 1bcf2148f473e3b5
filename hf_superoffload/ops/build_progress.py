"""A progress bar over the one-off compile of the CPU Adam (a minute or two): ninja writes one
object file per source as it finishes, so a thread counts the new ones in the build folder.
tqdm shows it on a terminal only (``disable=None``), so logs and CI output stay clean."""

from __future__ import annotations

import threading
from pathlib import Path

from tqdm import tqdm


class BuildProgress:
    def __init__(
        self, folder: Path, sources: int, interval: float = 0.5, disable: bool | None = None
    ):
        self.folder, self.sources, self.interval = folder, sources, interval
        self.disable = disable  # None: shown on a terminal only
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> BuildProgress:
        # NOTE: not a start time: file times come from the kernel's coarse clock, a few ms
        # behind time.time(), so an object written just after the start could look older.
        self._before = self._objects()
        self._bar = tqdm(
            total=self.sources + 1, desc="compiling the CPU Adam", unit="file", disable=self.disable
        )  # the last unit is the link
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if exc[0] is None:
            self._bar.update(self._bar.total - self._bar.n)
        self._bar.close()

    def compiled(self) -> int:
        """Object files written since the build started (new, or rewritten since)."""
        before = self._before
        return sum(1 for path, mtime in self._objects().items() if before.get(path) != mtime)

    def _objects(self) -> dict[Path, int]:
        objects = {}
        for path in self.folder.glob("*.o"):
            try:
                objects[path] = path.stat().st_mtime_ns
            except FileNotFoundError:  # replaced while listed
                continue
        return objects

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            done = min(self.compiled(), self.sources)
            if done > self._bar.n:
                self._bar.update(done - self._bar.n)
