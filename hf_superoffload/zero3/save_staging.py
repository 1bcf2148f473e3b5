"""Where the streamed ZeRO-3 save (``streaming_save.py``) writes, so that a save that fails part
way leaves the previous one in ``output_dir`` whole.

Everything the save writes (the weights and what the Trainer's ``_save`` writes beside them:
config, tokenizer, training arguments) goes to a staging folder inside ``output_dir``; only once
all of it is written are the files moved into place, the index (or the single
``model.safetensors``) last, and the weight files of the previous save that the new one does not
list removed. ``save_pretrained`` would delete the previous weights before writing any. A save
that starts removes what an interrupted one left (the staging folder, or the ``.partial`` shards
older versions wrote into ``output_dir``), which ``push_to_hub`` would otherwise upload.
"""

from __future__ import annotations

import glob
import os
import re
import shutil

from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

STAGING = ".streaming-save"
_OLD_PARTIALS = ".streaming-*.safetensors.partial"
# The weight files a save of ours (or save_pretrained's safetensors) leaves in a folder.
_WEIGHT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")


def staging_dir(output_dir: str) -> str:
    return os.path.join(output_dir, STAGING)


def start_staging(output_dir: str) -> str:
    """On the writing rank: an empty staging folder in ``output_dir``, with what an interrupted
    save left removed."""
    remove_staging(output_dir)
    for path in glob.glob(os.path.join(glob.escape(output_dir), _OLD_PARTIALS)):
        os.remove(path)
    os.makedirs(staging_dir(output_dir))
    return staging_dir(output_dir)


def remove_staging(output_dir: str) -> None:
    if os.path.isdir(staging_dir(output_dir)):
        shutil.rmtree(staging_dir(output_dir))


def publish(output_dir: str, shards: list[str]) -> None:
    """Move the staged save into ``output_dir``: the other files, then the ``shards`` (the
    ShardWriter's), then what names the model's weights to ``from_pretrained`` (the index, or
    the single ``model.safetensors``); then remove the previous save's weight files that these
    do not replace, and the staging folder. A weight file in staging that is not one of these
    (one ``_save`` might write) is not moved."""
    staging = staging_dir(output_dir)
    others = [name for name in os.listdir(staging) if not _WEIGHT_FILE.fullmatch(name)]
    last = SAFE_WEIGHTS_NAME if shards == [SAFE_WEIGHTS_NAME] else SAFE_WEIGHTS_INDEX_NAME
    weight_files = [*(name for name in shards if name != last), last]
    for name in others + weight_files:
        _move(os.path.join(staging, name), os.path.join(output_dir, name))
    for name in os.listdir(output_dir):
        if _WEIGHT_FILE.fullmatch(name) and name not in weight_files:
            os.remove(os.path.join(output_dir, name))
    shutil.rmtree(staging)


def _move(source: str, target: str) -> None:
    """``os.replace``, and for a folder that exists already, its entries one by one."""
    if os.path.isdir(source) and os.path.isdir(target):
        for name in os.listdir(source):
            _move(os.path.join(source, name), os.path.join(target, name))
        return
    os.replace(source, target)
