"""Reads the history of an offline wandb run back from its ``run-*.wandb`` file.

wandb >= 0.2x no longer ships a Python reader. The file is a LevelDB-style log: a 7-byte header
(":W&B", magic 0xBEE1, version 0), then 32 KiB blocks of records, each with a 7-byte header
(crc32, length, type: 1 full, 2 first, 3 middle, 4 last) and, where a block has fewer than 7
bytes left, zero padding. Each reassembled record is a wandb ``Record`` protobuf.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2

_BLOCK = 32 * 1024
_FILE_HEADER = struct.Struct("<4sHB")
_RECORD_HEADER = struct.Struct("<IHB")


def _records(data: bytes):
    ident, magic, _ = _FILE_HEADER.unpack_from(data, 0)
    assert ident == b":W&B" and magic == 0xBEE1, "not a wandb run file"
    offset, pending = _FILE_HEADER.size, b""
    while offset + _RECORD_HEADER.size <= len(data):
        left = _BLOCK - offset % _BLOCK
        if left < _RECORD_HEADER.size:
            offset += left  # block trailer padding
            continue
        _, length, kind = _RECORD_HEADER.unpack_from(data, offset)
        offset += _RECORD_HEADER.size
        chunk, offset = data[offset : offset + length], offset + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk
        else:  # zero-length padding at the end of the file
            break


def history(run_file: Path) -> list[dict]:
    """The logged rows (key -> value) of the run, in order."""
    rows = []
    for raw in _records(Path(run_file).read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return rows
