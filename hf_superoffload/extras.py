"""Optional dependencies: which extra of ``pip install "hf_superoffload[...]"`` brings each, and
the one error that says so.

The standalone optimizer, the Trainer mixin and ``plan`` need only the hard requirements
(torch, transformers, accelerate). The rest is optional and checked where it is first needed,
before anything runs: ``require("trl", "datasets", purpose="the recipes")``.
"""

from __future__ import annotations

import importlib.util
import sys

# Importable module -> the extra that installs it (setup.cfg's [options.extras_require]).
EXTRA_OF = {
    "deepspeed": "deepspeed",
    "trl": "trl",
    "datasets": "trl",
    "matplotlib": "trl",
    "wandb": "wandb",
    "psutil": "bench",
    "torchao": "bench",
    "liger_kernel": "liger",
}


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names the ``pip install``."""


def missing_extra(module: str, purpose: str) -> MissingExtraError:
    extra = EXTRA_OF[module]
    return MissingExtraError(
        f'{module} is not installed ({purpose} uses it): pip install "hf_superoffload[{extra}]"',
        name=module,
    )


def is_installed(module: str) -> bool:
    # A None entry in sys.modules is Python's own "blocked" mark; find_spec reports it as absent.
    if module in sys.modules and sys.modules[module] is None:
        return False
    return importlib.util.find_spec(module) is not None


def require(*modules: str, purpose: str) -> None:
    """Raise MissingExtraError for the first of ``modules`` that is not installed."""
    for module in modules:
        if not is_installed(module):
            raise missing_extra(module, purpose)
