"""What a blob is, apart from any file: its names, metadata, header and checksum pieces.

A blob is a plain safetensors file whose `__metadata__` holds the cache format version, the
model fingerprint, its token count, the block hashes it covers and a checksum of its tensor
bytes. The checksum is the crc32 of each piece of PIECE_BYTES of every tensor, folded into one
(`fold_crcs`); the piece size is part of the cache format.
"""

from __future__ import annotations

import json
import os
import re
import uuid
import zlib
from dataclasses import dataclass

import torch

from statechat.cache.hashing import CACHE_FORMAT_VERSION

TMP_SUFFIX = ".tmp"
PIECE_BYTES = 16 << 20  # the unit of the checksum (part of the cache format)


class BlobError(Exception):
    """A blob that must not be used (missing, truncated, corrupt, another model's, wrong shape).

    `damaged` False: the file could not be read (permissions, an I/O error, no file handles
    left), which says nothing of its contents: it is kept, and only this use of it fails.
    `of_model` True: its header is sound but names another model, or other tensors or shapes,
    than the reader expected (the blob, or the `models` row the reader took them from, is
    wrong: `cache verify` tells them apart)."""

    def __init__(self, message: str, damaged: bool = True, of_model: bool = False) -> None:
        super().__init__(message)
        self.damaged = damaged
        self.of_model = of_model


# the files a store writes under its blob directory (and their temps, which carry the writer's
# pid; older versions' did not): nothing else is removed
BLOB_NAME = re.compile(r"(kv/[0-9a-f]{32}|ckpt/[0-9a-f]{2}/[0-9a-f]{64}-[0-9a-f]{8})\.safetensors"
                       r"(\.([0-9]+\.)?[0-9a-f]{32}" + re.escape(TMP_SUFFIX) + ")?")


def kv_blob_name() -> str:
    """A new segment blob's name under the blob directory (one of BLOB_NAME's)."""
    return f"kv/{uuid.uuid4().hex}.safetensors"


def ckpt_blob_name(ckpt_hash: str) -> str:
    """A new blob's name for checkpoint `ckpt_hash` (hex; one of BLOB_NAME's): under a folder
    of its first two digits, with a random suffix so a rewrite never replaces a file in use."""
    return f"ckpt/{ckpt_hash[:2]}/{ckpt_hash}-{uuid.uuid4().hex[:8]}.safetensors"


def temp_name(name: str) -> str:
    """The name a blob is written under before it is renamed to `name` (one of BLOB_NAME's):
    it carries this process's pid, so that another process's clean-up leaves it while this
    one lives (`temp_writer`)."""
    return f"{name}.{os.getpid()}.{uuid.uuid4().hex}{TMP_SUFFIX}"


def temp_writer(name: str) -> int | None:
    """The pid of the process that writes the temporary blob `name` (a temp_name), None where
    the name carries none (not a temp, or one of an older version's)."""
    found = BLOB_NAME.fullmatch(name)
    return int(found[3][:-1]) if found and found[3] else None


@dataclass(frozen=True)
class BlobMeta:
    """What a blob's metadata says of it, besides the format version and the checksum."""

    fingerprint: str  # hex
    num_tokens: int
    hashes: list[str]  # hex block hashes the blob covers (a checkpoint: its boundary's hash)
    kind: str  # "ckpt" or "kv"


DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

Entries = dict[str, tuple[torch.dtype, list[int], int, int]]  # name -> dtype, shape, start, end


def split_pieces(nbytes: int) -> list[tuple[int, int]]:
    """(offset, length) of each piece of a tensor's bytes; an empty tensor has one empty piece."""
    return [(o, min(PIECE_BYTES, nbytes - o)) for o in range(0, max(nbytes, 1), PIECE_BYTES)]


def fold_crcs(pieces: list[tuple[str, int, int]], crcs) -> str:
    """The blob checksum from the crc of each (tensor, offset, length) piece: crc32 of the text
    "name:crc.crc...,name:crc..." (hex crcs in offset order, tensors in name order)."""
    by_name: dict[str, list[str]] = {}
    for (name, _, _), crc in sorted(zip(pieces, crcs)):
        by_name.setdefault(name, []).append(f"{crc:08x}")
    return f"{zlib.crc32(','.join(f'{n}:' + '.'.join(c) for n, c in by_name.items()).encode()):08x}"


def encode_header(tensors: dict[str, torch.Tensor], order: list[str], meta: BlobMeta,
                  crc: str) -> bytes:
    """The safetensors prefix: 8-byte length, then the JSON header padded to 8 bytes."""
    header: dict = {"__metadata__": {
        "format_version": str(CACHE_FORMAT_VERSION),
        "fingerprint": meta.fingerprint,
        "num_tokens": str(meta.num_tokens),
        "hashes": json.dumps(meta.hashes),
        "kind": meta.kind,
        "checksum": crc,
    }}
    start = 0
    for name in order:
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [start, start + size]}
        start += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return len(text).to_bytes(8, "little") + text


def check_header(blob: str, meta: dict, entries: Entries, fingerprint: str,
                 expected: dict[str, tuple[int, ...]], hashes: dict[int, str] | None = None,
                 ) -> None:
    """Raise BlobError unless the header of `blob` is this cache format's, of the model
    `fingerprint`, holds exactly the `expected` tensors with their shapes, and, given `hashes`
    ({index in its metadata's `hashes`: hex hash}), covers those blocks at those places (an
    index row edited to name another blob, or another block of one, is a miss, not another
    prefix's state)."""
    if meta.get("format_version") != str(CACHE_FORMAT_VERSION):
        raise BlobError(f"blob {blob} has cache format {meta.get('format_version')}")
    if meta.get("fingerprint") != fingerprint:
        raise BlobError(f"blob {blob} belongs to another model", of_model=True)
    if set(entries) != set(expected):
        raise BlobError(f"blob {blob} holds other tensors than expected", of_model=True)
    for name, shape in expected.items():
        if tuple(entries[name][1]) != tuple(shape):
            raise BlobError(f"blob {blob} tensor {name} has shape {list(entries[name][1])}",
                            of_model=True)
    if hashes and not _covers(meta.get("hashes"), hashes):
        raise BlobError(f"blob {blob} is not what its index rows say (another prefix's data)")


def _covers(text: object, hashes: dict[int, str]) -> bool:
    """Whether the metadata's `hashes` (JSON text of a list of hex hashes) holds each of
    `hashes` at its index."""
    try:
        listed = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        return False
    return isinstance(listed, list) and all(
        isinstance(i, int) and 0 <= i < len(listed) and listed[i] == h for i, h in hashes.items())
