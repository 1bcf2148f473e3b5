"""The training arguments a save writes (``training_args.bin``), without their secrets.

The Trainer pickles its arguments whole into every model save and checkpoint (``_save``) and
into the output folder it uploads at each checkpoint with ``push_to_hub``
(``_push_from_checkpoint``); the upload then carries ``hub_token`` to the Hub. In the saved copy
each field whose name says it holds a secret (``is_secret_name``, as the model card's ``***``:
``hub_token`` in the Trainer's and TRL's arguments) is None; the arguments in memory keep it,
so the upload itself still authenticates with the user's token.
"""

from __future__ import annotations

import dataclasses
import functools
from contextlib import contextmanager

from .card_secrets import is_secret_name


def secret_fields(args) -> list[str]:
    """The fields of ``args`` (training arguments) that hold a secret, set to a value."""
    return [
        field.name
        for field in dataclasses.fields(args)
        if is_secret_name(field.name) and getattr(args, field.name, None) is not None
    ]


def check_saved_without_secrets(args) -> None:
    """Refuses, before anything is trained or written, training arguments holding a secret
    whose class pickles in its own way (``__reduce__``, ``__getstate__``, ``__slots__``, ...):
    training_args.bin could not be written without the secret."""
    if not secret_fields(args):
        return
    own_class = type(args)
    ours = {"__new__": object.__new__, "__reduce__": object.__reduce__,
            "__reduce_ex__": object.__reduce_ex__,
            "__getstate__": getattr(object, "__getstate__", None)}  # fmt: skip
    custom = [
        name for name, default in ours.items() if getattr(own_class, name, None) is not default
    ]
    custom += ["__slots__"] if any("__slots__" in vars(c) for c in own_class.__mro__) else []
    if custom:
        raise TypeError(
            f"{own_class.__qualname__} defines {', '.join(custom)}: hf_superoffload cannot "
            f"write training_args.bin without its {', '.join(secret_fields(args))}. Leave the "
            f"training arguments' pickling to the dataclass, or pass the Hub token through "
            f"HF_TOKEN or `hf auth login` instead of the arguments."
        )


@contextmanager
def pickled_without_secrets(args):
    """Within the block, ``args`` pickles (``torch.save``) as itself with its secret fields
    None; reading them, as the upload does, still gives their values, and ``args`` stays the
    same object, so what the Trainer or a callback sets on it meanwhile is kept.

    Setting the fields to None around the save would not do: ``_push_from_checkpoint`` writes
    the file and reads ``args.hub_token`` for the upload in the same call, with no hook between.
    So for the block ``args`` takes a subclass of its own class whose pickle is the original
    class's, less the secrets."""
    if not secret_fields(args):
        yield
        return
    check_saved_without_secrets(args)
    own_class = type(args)
    args.__class__ = _pickles_without_secrets(own_class)
    try:
        yield
    finally:
        args.__class__ = own_class


@functools.cache
def _pickles_without_secrets(own_class: type) -> type:
    def __reduce_ex__(self, protocol):
        # What pickle does for a plain class (check_saved_without_secrets: the arguments' is),
        # naming the original class: a load needs nothing of this package.
        return (object.__new__, (own_class,), {**vars(self), **dict.fromkeys(secret_fields(self))})

    return type(
        f"{own_class.__name__}WithoutSecretsInPickle",
        (own_class,),
        {"__reduce_ex__": __reduce_ex__, "__module__": own_class.__module__},
    )
