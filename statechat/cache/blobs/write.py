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
    fd = _open_temp(tmp, path.parent)
    try:  # (a failed write, a full disk say, leaves no partial temp to take more room)
        try:
            offset, crc = _write_data(fd, data, len(header), pause)
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


def _open_temp(tmp: Path, folder: Path) -> int:
    """A new (or emptied) file at `tmp`, open for writing; `folder` (its own) made where
    missing."""
    tries = 3  # (`cache clear` elsewhere removes empty folders: make it again)
    while True:
        folder.mkdir(parents=True, exist_ok=True)
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except FileNotFoundError:
            tries -= 1
            if not tries:
                raise


def _write_data(fd: int, data: dict[str, memoryview], offset: int,
                pause: Callable[[], None] | None) -> tuple[int, str]:
    """Write the tensors' bytes (`data`, in the header's order) from `offset` on, piece by
    piece; return (the offset past them, the blob's checksum folded from the pieces')."""
    # (encoding.PIECE_BYTES read here, as split_pieces reads it: one piece size for both)
    pieces, crcs, since_pause = [], [], encoding.PIECE_BYTES
    for name, view in data.items():
        for start, size in split_pieces(len(view)):
            if pause is not None and since_pause >= encoding.PIECE_BYTES:
                pause()
                since_pause = 0
            piece = view[start : start + size]
            crcs.append(zlib.crc32(piece))
            pieces.append((name, start, size))
            _write_all(fd, piece, offset)
            offset += size
            since_pause += size
    return offset, fold_crcs(pieces, crcs)


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
