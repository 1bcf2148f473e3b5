"""What activation (``activation.py``) changes in DeepSpeed and accelerate, one function per
module, each applied once when that module is (or has been) imported. Each wraps a function or
method by name and leaves it alone when it is already wrapped.

Engine patches (off with ``HF_SUPEROFFLOAD_DEEPSPEED=0``):
- ``rebind_superoffload``: DeepSpeed's SuperOffload class becomes SuperOffloadZero3Optimizer.
- ``guard_engine``: a ``super_offload`` config is refused below stage 3 and with an optimizer
  this path does not step, before DeepSpeed builds anything; DeepSpeed's CPU Adam (for an Adam
  "optimizer" in the config) becomes ``HostAdamState``, which builds no op.
- ``accept_host_adam_state``: DeepSpeed counts HostAdamState among ZeRO's optimizers.
- ``map_client_optimizer``: accelerate's swap of the Trainer's AdamW for DeepSpeed's CPU Adam
  gives HostAdamState instead when the config runs SuperOffload; otherwise the engine variables
  set, which DeepSpeed's CPU Adam does not read, are refused before it is built.
- ``log_zero3_metrics``: every Trainer gets ``Zero3MetricsCallback``, which logs tokens/s and
  the ``stv/`` counters when the optimizer that trains is ours (and does nothing otherwise).
- ``stream_zero3_saves``: ``Trainer.save_model`` streams the weights (integrations/zero3_save.py)
  when the optimizer that trains is ours, instead of gathering the whole 16-bit model.

Always:
- ``read_super_offload_config``: ``"super_offload": "hf_superoffload"`` (the shipped configs'
  value, which DeepSpeed alone rejects) reads as ``true``. Under ``HF_SUPEROFFLOAD_DEEPSPEED=0``
  a config asking for SuperOffload refuses the engine's ``HF_SUPEROFFLOAD_*`` variables set
  (DeepSpeed's own reads none of them), when DeepSpeed reads it: in ``deepspeed.initialize`` or
  ``zero.Init``, before anything is built, whatever the script (the trainers refuse earlier).
- ``check_accelerate_deepspeed_config``: the same refusal where accelerate reads the config
  (``HfDeepSpeedConfig``: transformers' training arguments, ``accelerate launch``'s plugin),
  before accelerate builds DeepSpeed's CPU Adam ahead of ``deepspeed.initialize``.
- ``check_engine_config``, ``check_trainer_config``: a config that asks for no SuperOffload
  builds DeepSpeed's own optimizer, which reads none of the engine variables: those set are
  refused under either switch when DeepSpeed's engine is about to build an optimizer from it,
  or a Trainer other than the SuperOffload ones is made with it (those turn it on), before
  anything is built. Reading such a config refuses nothing: it may be read for a model that
  trains nothing, or for a SuperOffload trainer.
- ``check_build_locks``: a DeepSpeed op build refuses to wait on a lock its builder left.
- ``one_process_without_launcher``: ``python train.py`` with a DeepSpeed config (no launcher,
  no MPI) runs as one process instead of failing on DeepSpeed's MPI discovery.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import socket
import sys

from .. import upstream
from ..extras import is_installed
from .config import (
    refuse_engine_variables_unread,
    refuse_engine_variables_without_super_offload,
    refuse_super_offload_below_stage3,
    super_offload_requested,
    with_flag_read,
)

logger = logging.getLogger("hf_superoffload")

_MARK = "_hf_superoffload_wrapped"
# Variables that MPI launchers (Open MPI, MPICH/Hydra, PMIx, MVAPICH) and Slurm set in each
# process they start: with one of them DeepSpeed's MPI discovery is what the user wants.
MPI_LAUNCHER_VARIABLES = (
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
    "PMIX_RANK",
    "MV2_COMM_WORLD_SIZE",
    "MPI_LOCALNRANKS",
    "SLURM_NTASKS",
)


def _wrap(owner, name: str, make) -> None:
    module = owner.__module__ if isinstance(owner, type) else owner.__name__
    upstream.require_member(owner, name, module.split(".")[0])  # named, with tested versions
    original = getattr(owner, name)
    if getattr(original, _MARK, False):
        return
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, _MARK, True)
    setattr(owner, name, wrapper)


def rebind_superoffload(module) -> None:
    from .activation import TARGET_NAME
    from .optimizer import SuperOffloadZero3Optimizer

    setattr(module, TARGET_NAME, SuperOffloadZero3Optimizer)


def guard_engine(module) -> None:
    engine_class = module.DeepSpeedEngine

    def make_configure(original):
        def configure_optimizer(self, client_optimizer, model_parameters):
            from .base_optimizer import HostAdamState
            from .options import check_deepspeed_optimizer

            refuse_super_offload_below_stage3(self.zero_optimization_stage(), self.super_offload())
            if not self.super_offload():
                return original(self, client_optimizer, model_parameters)
            upstream.check("deepspeed")  # every DeepSpeed name the ZeRO-3 optimizer relies on
            check_deepspeed_optimizer(self, client_optimizer)
            if not isinstance(client_optimizer, HostAdamState):
                return original(self, client_optimizer, model_parameters)
            # DeepSpeed refuses a client optimizer other than its CPU Adam under offload unless
            # told not to (its performance warning); HostAdamState stands in for that CPU Adam.
            with _not_forcing_deepspeed_cpu_adam(self._config):
                return original(self, client_optimizer, model_parameters)

        return configure_optimizer

    def make_get_configuration(original):
        def get_optimizer_configuration(self, *args, **kwargs):
            optimizer_class, options = original(self, *args, **kwargs)
            if self.super_offload() and getattr(optimizer_class, "__name__", "") == (
                "DeepSpeedCPUAdam"
            ):
                from .base_optimizer import HostAdamState

                return HostAdamState, options
            return optimizer_class, options

        return get_optimizer_configuration

    _wrap(engine_class, "_configure_optimizer", make_configure)
    _wrap(engine_class, "get_optimizer_configuration", make_get_configuration)


@contextlib.contextmanager
def _not_forcing_deepspeed_cpu_adam(config):
    saved = config.zero_force_ds_cpu_optimizer
    config.zero_force_ds_cpu_optimizer = False
    try:
        yield
    finally:
        config.zero_force_ds_cpu_optimizer = saved


def accept_host_adam_state(module) -> None:
    from .base_optimizer import HostAdamState

    if HostAdamState not in module.ZERO_SUPPORTED_OPTIMIZERS:
        module.ZERO_SUPPORTED_OPTIMIZERS.append(HostAdamState)


def map_client_optimizer(module) -> None:
    if not hasattr(module, "map_pytorch_optim_to_deepspeed") and not is_installed("deepspeed"):
        return  # accelerate defines it only with DeepSpeed installed, and maps nothing without

    def make(original):
        def map_pytorch_optim_to_deepspeed(optimizer):
            if not _accelerate_runs_super_offload():
                # It builds DeepSpeed's CPU Adam, which reads none of the engine variables.
                refuse_engine_variables_without_super_offload(_accelerate_config())
                return original(optimizer)
            from .base_optimizer import HostAdamState
            from .options import check_adamw

            check_adamw(optimizer)  # accelerate would make any optimizer a CPU Adam, silently
            return HostAdamState.in_place_of(optimizer)

        return map_pytorch_optim_to_deepspeed

    _wrap(module, "map_pytorch_optim_to_deepspeed", make)


def _accelerate_config() -> dict:
    from accelerate.state import AcceleratorState

    plugin = AcceleratorState().deepspeed_plugin
    return getattr(plugin, "deepspeed_config", None) or {}


def _accelerate_runs_super_offload() -> bool:
    offload = (_accelerate_config().get("zero_optimization") or {}).get("offload_optimizer") or {}
    return super_offload_requested(offload.get("super_offload"))


def log_zero3_metrics(module) -> None:
    from ..integrations.zero3_callback import Zero3MetricsCallback

    if Zero3MetricsCallback not in module.DEFAULT_CALLBACKS:
        module.DEFAULT_CALLBACKS.append(Zero3MetricsCallback)


def stream_zero3_saves(module) -> None:
    def make(original):
        def save_model(self, output_dir=None, _internal_call=False):
            from ..integrations.zero3_save import save_model_streamed, streamed_save_engine
            from .streaming_save import TRAINER_REMEDY

            engine = streamed_save_engine(self, only_ours=True)
            if engine is None:
                return original(self, output_dir, _internal_call)
            return save_model_streamed(self, engine, output_dir, _internal_call, TRAINER_REMEDY)

        return save_model

    _wrap(module.Trainer, "save_model", make)


def read_super_offload_config(module) -> None:
    def make(original):
        def get_zero_config(param_dict):
            refuse_engine_variables_unread(param_dict)  # before DeepSpeed builds anything
            return original(with_flag_read(param_dict))

        return get_zero_config

    _wrap(module, "get_zero_config", make)


def check_accelerate_deepspeed_config(module) -> None:
    """accelerate reads a DeepSpeed config into ``HfDeepSpeedConfig`` (transformers' training
    arguments, ``accelerate launch``'s plugin) long before DeepSpeed does, and builds DeepSpeed's
    CPU Adam from it ahead of ``deepspeed.initialize``: the config's refusals run there too."""

    def make(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            refuse_engine_variables_unread(self.config)

        return __init__

    _wrap(module.HfDeepSpeedConfig, "__init__", make)


def check_engine_config(module) -> None:
    """A DeepSpeed engine about to build an optimizer (one given, or the config's
    ``"optimizer"``) from a config that asks for no SuperOffload refuses the engine variables
    set, before it builds anything. An engine that trains nothing (``zero.Init``'s config, TRL's
    reference model, inference) reads none of them and is not refused: the trainer's does."""

    def make(original):
        signature = inspect.signature(original)
        missing = {"optimizer", "config_class"} - set(signature.parameters)
        if missing:  # the config would go unchecked
            name = (
                f"deepspeed.runtime.engine.DeepSpeedEngine.__init__({', '.join(sorted(missing))})"
            )
            raise upstream.error("deepspeed", [name])

        def __init__(self, *args, **kwargs):
            arguments = signature.bind_partial(self, *args, **kwargs).arguments
            param_dict = getattr(arguments.get("config_class"), "_param_dict", None)
            if isinstance(param_dict, dict) and (
                arguments.get("optimizer") is not None or param_dict.get("optimizer")
            ):
                refuse_engine_variables_without_super_offload(param_dict)
            return original(self, *args, **kwargs)

        return __init__

    _wrap(module.DeepSpeedEngine, "__init__", make)


def check_trainer_config(module) -> None:
    """A Trainer other than the SuperOffload ones (which turn ``super_offload`` on, or refuse,
    in their own ``__init__``) trains with the optimizer its DeepSpeed config builds: the
    engine variables that config leaves unread are refused when the Trainer is made, before
    accelerate builds DeepSpeed's CPU Adam and engine in ``train()``."""

    def make(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            # Not imported: no SuperOffload trainer exists (and a plain Trainer need not load it).
            ours = sys.modules.get("hf_superoffload.integrations.trainer")
            if ours is not None and isinstance(self, ours.SuperOffloadTrainerMixin):
                return
            plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
            config = getattr(plugin, "deepspeed_config", None)
            if isinstance(config, dict):
                refuse_engine_variables_without_super_offload(config)

        return __init__

    _wrap(module.Trainer, "__init__", make)


def check_build_locks(module) -> None:
    def make(original):
        def jit_load(self, *args, **kwargs):
            from ..ops.build_locks import check_torch_extension_lock

            check_torch_extension_lock(self.name, f"DeepSpeed's {self.name} op")
            return original(self, *args, **kwargs)

        return jit_load

    _wrap(module.OpBuilder, "jit_load", make)


def one_process_without_launcher(module) -> None:
    """DeepSpeed, started without the variables a launcher sets (RANK, WORLD_SIZE, ...), looks
    for an MPI launcher through mpi4py and fails without it (after the model has loaded). With
    no MPI launcher around either, this is ``python train.py``: one process."""

    def make(original):
        def mpi_discovery(*args, **kwargs):
            if any(name in os.environ for name in MPI_LAUNCHER_VARIABLES):
                return original(*args, **kwargs)
            _set_single_process_variables()
            return None

        return mpi_discovery

    _wrap(module, "mpi_discovery", make)


def _set_single_process_variables() -> None:
    world = os.environ.get("WORLD_SIZE", "1")
    if world != "1":
        raise RuntimeError(
            f"WORLD_SIZE={world} is set, but not RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT: "
            f"start the script with a launcher that sets them all: accelerate launch "
            f"--config_file <config>.yaml train.py, deepspeed train.py, or torchrun "
            f"--nproc_per_node N train.py."
        )
    defaults = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
    }
    for name, value in defaults.items():
        os.environ.setdefault(name, value)
    if "MASTER_PORT" not in os.environ:  # a free one: other single runs may share the host
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    logger.warning(
        "hf_superoffload: no launcher started this script (RANK, WORLD_SIZE, ... are unset, "
        "and no MPI launcher is around), so DeepSpeed runs it as one process: rank 0 of 1, "
        "one GPU. For several GPUs start it with accelerate launch --config_file "
        "<config>.yaml, deepspeed, or torchrun --nproc_per_node N."
    )
