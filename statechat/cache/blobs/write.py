"""Writing a blob atomically: a temporary name in the same folder, fsynced, renamed into place
and the folder fsynced, so a reader sees a whole blob or none; a write that fails (a full disk)
removes its temporary file."""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

from statechat.cache import hostcopy
from statechat.cache.blobs import encoding
from statechat.cache.blobs.encoding import (
    BlobMeta,
    encode_header,
    fold_crcs,
    split_pieces,
    temp_name,
)


def write_blob(path: Path, tensors: dict[str, torch.Tensor], meta: BlobMeta,
               pause: Callable[[], None] | None = None,
               temp: Path | None = None) -> tuple[int, str]:
    """Write atomically; return (bytes on disk, checksum). With `temp` (a temp_name beside
    `path`), the blob is written and fsynced there and not renamed: `publish(temp, path)`
    renames it once its row may follow at once (the store does it in the row's transaction).

    The file is a plain safetensors file, written in one pass straight from the tensors' memory
    (no serialised copy of the blob): each piece is checksummed and written at its offset, and
    the header, whose length does not depend on the checksum, goes in last. The writer thus
    makes few, long calls that release the GIL. `pause` runs before every PIECE_BYTES of data
    (the store's writer holds back there while the engine launches work)."""
    # widest dtypes first, then by name, as safetensors orders them: every tensor starts aligned
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    data = {n: memoryview(hostcopy.contiguous(tensors[n].detach().to("cpu")).view(torch.uint8)
                          .reshape(-1).numpy()) for n in order}
    header = encode_header(tensors, order, meta, crc="0" * 8)
    tmp = temp or path.with_name(temp_name(path.name))
    for attempt in range(3):  # (`cache clear` elsewhere removes empty folders: make it again)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            break
        except FileNotFoundError:
            if attempt == 2:
                raise
    try:  # (a failed write, a full disk say, leaves no partial temp to take more room)
        try:
            # (encoding.PIECE_BYTES read here, as split_pieces reads it: one piece size for both)
            pieces, crcs, offset, since_pause = [], [], len(header), encoding.PIECE_BYTES
            for name in order:
                for start, size in split_pieces(len(data[name])):
                    if pause is not None and since_pause >= encoding.PIECE_BYTES:
                        pause()
                        since_pause = 0
                    piece = data[name][start : start + size]
                    crcs.append(zlib.crc32(piece))
                    pieces.append((name, start, size))
                    _write_all(fd, piece, offset)
                    offset += size
                    since_pause += size
            crc = fold_crcs(pieces, crcs)
            _write_all(fd, memoryview(encode_header(tensors, order, meta, crc)), 0)
            os.fsync(fd)
        finally:
            os.close(fd)
        if temp is None:
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if temp is None:
        fsync_dir(path.parent)
    return offset, crc


def publish(temp: Path, path: Path) -> None:
    """Rename the blob written at `temp` (write_blob's) to `path`, durably (the folder
    fsynced)."""
    os.replace(temp, path)
    fsync_dir(path.parent)


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        done = os.pwrite(fd, data, offset)
        data, offset = data[done:], offset + done


def fsync_dir(folder: Path) -> None:
    """Make a rename in (or a file's creation in) `folder` durable: fsync the folder itself."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
