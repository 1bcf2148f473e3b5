"""Runs DeepSpeed's own unit tests against hf_superoffload's ZeRO-3 path (dev/deepspeed_peer_tests.sh).

Python imports ``sitecustomize`` at start-up in every interpreter that has this folder on
PYTHONPATH: the pytest process and the ranks DeepSpeed's test harness starts with forkserver or
spawn (which a conftest.py would not reach). It does nothing unless PEER_MODE is set:

- ``PEER_MODE=plain``: DeepSpeed as shipped (hf_superoffload is not imported).
- ``PEER_MODE=ours``: ``import hf_superoffload`` (activates the ZeRO-3 path) and every stage-3
  config with a CPU ``offload_optimizer`` gets ``"super_offload": true``.
- ``PEER_ADAPT`` (both modes alike, so the two runs stay comparable), comma separated:
  ``offload`` adds ``"offload_optimizer": {"device": "cpu"}`` to a stage-3 config without one
  (and ``"zero_force_ds_cpu_optimizer": false`` unless set, so a client optimizer is accepted);
  ``stage3`` turns a stage 1 or 2 config into stage 3 (then ``offload`` applies too).
- Both modes give ``DeepSpeedEngine`` the ``sparse_tensor_module_names`` attribute that DeepSpeed
  0.19.8 removed and the checkpoint tests of current checkouts still compare (an empty set).
- ``PEER_BUILT_LOG``: each ZeRO-3 optimizer DeepSpeed's engine builds appends one line
  ``<class name> rank=<RANK> pid=<pid> super_offload=<flag>`` to this file, which proves which
  optimizer ran.

The config is rewritten where DeepSpeed parses it (``DeepSpeedConfig``), whatever way the test
passes it (dict, json path, ``zero.Init``), so the engine and ``zero.Init`` see the same one.
"""

from __future__ import annotations

import importlib.abc
import json
import os
import sys

MODE = os.environ.get("PEER_MODE", "")
ADAPT = {a.strip() for a in os.environ.get("PEER_ADAPT", "").split(",") if a.strip()}
BUILT_LOG = os.environ.get("PEER_BUILT_LOG", "")


def rewrite_config(config: dict) -> dict:
    """The config this run gives DeepSpeed (changed in place: tests build several engines and a
    ``zero.Init`` from one dict, and each must see the same)."""
    zero = config.get("zero_optimization")
    if not isinstance(zero, dict):
        if "stage3" not in ADAPT:
            return config
        zero = config["zero_optimization"] = {}
    if "stage3" in ADAPT:
        zero["stage"] = 3
    if zero.get("stage") != 3:
        return config
    if zero.pop("cpu_offload", None):  # DeepSpeed's deprecated spelling of offload_optimizer cpu
        zero.setdefault("offload_optimizer", {"device": "cpu"})
    offload = zero.get("offload_optimizer")
    if offload is None and "offload" in ADAPT:
        offload = zero["offload_optimizer"] = {"device": "cpu"}
        # DeepSpeed refuses a client optimizer under offload unless told not to force its own.
        config.setdefault("zero_force_ds_cpu_optimizer", False)
    device = offload.get("device") if isinstance(offload, dict) else None
    if MODE == "ours" and getattr(device, "value", device) == "cpu":  # a str or DeepSpeed's enum
        offload["super_offload"] = True
    return config


def _patch_config(module) -> None:
    original = module.DeepSpeedConfig.__init__

    def init(self, config, *args, **kwargs):
        if isinstance(config, str) and os.path.exists(config):
            with open(config) as f:
                config = json.load(f)
        if isinstance(config, dict):
            rewrite_config(config)
        # deepspeed/__init__.py has imported the engine by now (hf_superoffload's activation
        # hooks that module's import; patching it here keeps the two hooks apart).
        _patch_engine(sys.modules["deepspeed.runtime.engine"])
        original(self, config, *args, **kwargs)

    module.DeepSpeedConfig.__init__ = init


def _patch_engine(module) -> None:
    original = module.DeepSpeedEngine._configure_zero_optimizer
    if getattr(original, "_peer_counts", False):
        return
    # DeepSpeed 0.19.8 dropped sparse gradients and this engine attribute with them; the
    # checkpoint tests of the checkouts at hand still compare it (unit/checkpoint/common.py).
    # Both runs get the empty set it held when nothing used sparse gradients.
    if not hasattr(module.DeepSpeedEngine, "sparse_tensor_module_names"):
        module.DeepSpeedEngine.sparse_tensor_module_names = frozenset()

    def configure(self, optimizer):
        built = original(self, optimizer)
        if BUILT_LOG:
            line = (
                f"{type(built).__name__} rank={os.environ.get('RANK', '?')} pid={os.getpid()} "
                f"super_offload={self.super_offload()}\n"
            )
            with open(BUILT_LOG, "a") as f:  # one short write per line: ranks may share it
                f.write(line)
        return built

    configure._peer_counts = True
    module.DeepSpeedEngine._configure_zero_optimizer = configure


_PATCHES = {"deepspeed.runtime.config": _patch_config}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of the modules in _PATCHES so that the
    patch runs right after the module's own code."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, _PATCHES[fullname])
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, loader, patch):
        self._loader = loader
        self._patch = patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._patch(module)


if MODE:
    if MODE not in ("plain", "ours"):
        raise SystemExit(f"PEER_MODE must be plain or ours, got {MODE!r}")
    unknown = ADAPT - {"offload", "stage3"}
    if unknown:
        raise SystemExit(f"PEER_ADAPT: unknown {sorted(unknown)} (known: offload, stage3)")
    sys.meta_path.insert(0, _PatchOnImport())
    if MODE == "ours":
        import hf_superoffload  # noqa: F401  (activates the ZeRO-3 path)
