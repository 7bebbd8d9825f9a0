"""Chained block hashes: the key of every cached KV block and GDN checkpoint.

block_hash[i] = sha256(block_hash[i-1] || int32 token ids of block i), block_hash[-1] being
the model fingerprint, so a hash names a whole prefix of one model, never just a block.
"""

from __future__ import annotations

import hashlib
import struct

CACHE_FORMAT_VERSION = 2


def model_fingerprint(
    config_digest: str, weights_digest: str, dtype: str, block_size: int,
) -> bytes:
    """sha256 of what changes the cached numbers: config, weights, dtype, format, block size."""
    h = hashlib.sha256()
    for part in (config_digest, weights_digest, dtype, str(CACHE_FORMAT_VERSION), str(block_size)):
        h.update(part.encode())
        h.update(b"\0")
    return h.digest()


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """Hash of one full block given its parent's hash."""
    return hashlib.sha256(parent + int32_bytes(token_ids)).digest()


def int32_bytes(token_ids: list[int]) -> bytes:
    """The ids as native int32s, the bytes of `array("i", token_ids)` (struct packs them faster:
    1.1x with Python 3.12 on an H100's host, 2x with 3.11 here); struct.error for an id that
    is not an int32 integer."""
    return struct.pack(f"{len(token_ids)}i", *token_ids)


def chain_hashes(
    root: bytes, token_ids: list[int], block_size: int, start: list[bytes] | None = None,
    packed: bytes | None = None,
) -> list[bytes]:
    """Hashes of every full block of `token_ids`; `start` holds hashes already known (a prefix),
    `packed` the ids' `int32_bytes` where the caller has them. The same values as `block_hash`
    block by block, from one conversion of the new blocks' tokens to bytes (an 8k-token prompt
    hashes in about 25% less time than block by block)."""
    hashes = list(start or [])
    first, end = len(hashes), len(token_ids) // block_size
    if first >= end:
        return hashes
    step = 4 * block_size
    if packed is not None and len(packed) == 4 * len(token_ids):
        data = memoryview(packed)[first * step : end * step]
    else:
        data = memoryview(int32_bytes(token_ids[first * block_size : end * block_size]))
    parent = hashes[-1] if hashes else root
    sha256 = hashlib.sha256
    for i in range(end - first):
        parent = sha256(parent + data[i * step : (i + 1) * step]).digest()
        hashes.append(parent)
    return hashes
