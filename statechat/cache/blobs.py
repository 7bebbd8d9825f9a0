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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
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


_POOL = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="statechat-crc")
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8}


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().view(torch.uint8).reshape(-1).numpy().data)  # releases the GIL


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    """crc32 of each tensor's bytes (computed in parallel), folded in name order (hex)."""
    names = sorted(tensors)
    crcs = list(_POOL.map(lambda n: _crc(tensors[n]), names))
    return f"{zlib.crc32(','.join(f'{n}:{c:08x}' for n, c in zip(names, crcs)).encode()):08x}"


def _read_safetensors(path: Path, pin: bool) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read a safetensors file with large sequential reads into one (pinned) buffer.

    Returns (metadata, tensors viewing the buffer). Raises ValueError on a malformed file.
    """
    with open(path, "rb", buffering=0) as f:
        n = int.from_bytes(f.read(8), "little")
        size = os.fstat(f.fileno()).st_size - 8 - n
        if n <= 0 or size < 0:
            raise ValueError("bad header length")
        header = json.loads(f.read(n))
        buf = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        view, pos = memoryview(buf.numpy()), 0
        while pos < size:
            got = f.readinto(view[pos : pos + (64 << 20)])
            if not got:
                raise ValueError("file ends early")
            pos += got
    meta = header.pop("__metadata__", {}) or {}
    tensors = {}
    for name, info in header.items():
        start, end = info["data_offsets"]
        if end > size:
            raise ValueError(f"tensor {name} lies past the end of the file")
        tensors[name] = buf[start:end].view(_DTYPES[info["dtype"]]).reshape(info["shape"])
    return meta, tensors


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
    path: Path, fingerprint: str, expected: dict[str, tuple[int, ...]], checksum_in_index: str | None = None,
    pin: bool = False,
) -> dict[str, torch.Tensor]:
    """Load and verify a blob (into pinned memory if `pin`); raise BlobError saying what is wrong."""
    if not path.is_file():
        raise BlobError(f"blob {path.name} is missing")
    try:
        meta, tensors = _read_safetensors(path, pin)
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
