"""The repository checkout a command needs (the benchmarks and the recipes live there, not in the
wheel): beside the package's source tree (an editable install), else the current directory or
one of its parents."""

from __future__ import annotations

from pathlib import Path

from .errors import UsageError


def find_checkout(*markers: Path) -> Path:
    """The first root holding every one of ``markers`` (paths relative to it)."""
    package_root = Path(__file__).resolve().parents[2]
    here = Path.cwd().resolve()
    for root in (package_root, here, *here.parents):
        if all((root / marker).exists() for marker in markers):
            return root
    raise UsageError(
        f"no {' or '.join(map(str, markers))} found beside the installed package "
        f"({package_root}) nor in {here} or its parents: they live in the repository, not the "
        "wheel. Run from a checkout (git clone ...; pip install -e .; cd into it)."
    )
