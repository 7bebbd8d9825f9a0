"""Blob files of the disk tier: safetensors with metadata, checksums and atomic writes.

A blob is written to a temporary name in the same folder, fsynced, renamed into place and the
folder fsynced: a reader sees a whole blob or none. Every blob carries in its metadata the
cache format version, the model fingerprint, its token count, the block hashes it covers and a
checksum of its tensor bytes; `read_blob` checks all of them, and the shapes the caller expects,
before anything is used.
"""

from __future__ import annotations

import json
import os
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from statechat.cache.hashing import CACHE_FORMAT_VERSION

TMP_SUFFIX = ".tmp"


class BlobError(Exception):
    """A blob that must not be used (missing, truncated, corrupt, another model's, wrong shape)."""


@dataclass(frozen=True)
class BlobMeta:
    fingerprint: str  # hex
    num_tokens: int
    hashes: list[str]  # hex block hashes the blob covers (a checkpoint: its boundary's hash)
    kind: str  # "ckpt" or "kv"


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    """crc32 over the tensors' bytes in name order (hex)."""
    crc = 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        crc = zlib.crc32(t.view(torch.uint8).reshape(-1).numpy().data, crc)
    return f"{crc:08x}"


def write_blob(path: Path, tensors: dict[str, torch.Tensor], meta: BlobMeta) -> tuple[int, str]:
    """Write atomically; return (bytes on disk, checksum)."""
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    crc = checksum(tensors)
    metadata = {
        "format_version": str(CACHE_FORMAT_VERSION),
        "fingerprint": meta.fingerprint,
        "num_tokens": str(meta.num_tokens),
        "hashes": json.dumps(meta.hashes),
        "kind": meta.kind,
        "checksum": crc,
    }
    data = save(tensors, metadata=metadata)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}{TMP_SUFFIX}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return len(data), crc


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_blob(
    path: Path, fingerprint: str, expected: dict[str, tuple[int, ...]], checksum_in_index: str | None = None
) -> dict[str, torch.Tensor]:
    """Load and verify a blob; raise BlobError saying what is wrong."""
    if not path.is_file():
        raise BlobError(f"blob {path.name} is missing")
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as e:  # noqa: BLE001 - any parse failure means a damaged file
        raise BlobError(f"blob {path.name} is unreadable ({str(e).splitlines()[0][:80]})") from None
    if meta.get("format_version") != str(CACHE_FORMAT_VERSION):
        raise BlobError(f"blob {path.name} has cache format {meta.get('format_version')}")
    if meta.get("fingerprint") != fingerprint:
        raise BlobError(f"blob {path.name} belongs to another model")
    if set(tensors) != set(expected):
        raise BlobError(f"blob {path.name} holds other tensors than expected")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != tuple(shape):
            raise BlobError(f"blob {path.name} tensor {name} has shape {list(tensors[name].shape)}")
    crc = checksum(tensors)
    if crc != meta.get("checksum") or (checksum_in_index and crc != checksum_in_index):
        raise BlobError(f"blob {path.name} fails its checksum")
    return tensors
