"""Blob files of the disk tier: safetensors with metadata, checksums and atomic writes.

A blob is written to a temporary name in the same folder, fsynced, renamed into place and the
folder fsynced: a reader sees a whole blob or none. Every blob carries in its metadata the
cache format version, the model fingerprint, its token count, the block hashes it covers and a
checksum of its tensor bytes; `read_blob` checks all of them, and the shapes the caller expects,
before anything is used.

Tensor bytes are checksummed in pieces of PIECE_BYTES, and read in runs of adjacent pieces
(up to RUN_BYTES) on a few threads (preadv and crc32 release the GIL), so a restore runs near
the page cache's bandwidth. For a CUDA device a run goes through one of a few pinned staging
buffers into one device buffer. The buffers are
pinned once, by `prepare_staging` when a store is attached (pinning 16 MiB costs milliseconds,
and the first restore after a start must not pay it), and shared by the reading threads.
"""

from __future__ import annotations

import ctypes
import functools
import json
import math
import os
import queue
import re
import threading
import uuid
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch

from statechat.cache.hashing import CACHE_FORMAT_VERSION

TMP_SUFFIX = ".tmp"
PIECE_BYTES = 16 << 20  # the unit of the checksum (part of the cache format)
RUN_BYTES = 4 << 20  # adjacent pieces read, checksummed and copied by one thread together
STAGING_BYTES = max(PIECE_BYTES, RUN_BYTES)  # a pinned staging buffer: a run, or one piece


class BlobError(Exception):
    """A blob that must not be used (missing, truncated, corrupt, another model's, wrong shape).

    `damaged` False: the file could not be read (permissions, an I/O error, no file handles
    left), which says nothing of its contents: it is kept, and only this use of it fails."""

    def __init__(self, message: str, damaged: bool = True) -> None:
        super().__init__(message)
        self.damaged = damaged


# the files a store writes under its blob directory (and their temps): nothing else is removed
BLOB_NAME = re.compile(r"(kv/[0-9a-f]{32}|ckpt/[0-9a-f]{2}/[0-9a-f]{64}-[0-9a-f]{8})\.safetensors"
                       r"(\.[0-9a-f]{32}\.tmp)?")


@dataclass(frozen=True)
class BlobMeta:
    fingerprint: str  # hex
    num_tokens: int
    hashes: list[str]  # hex block hashes the blob covers (a checkpoint: its boundary's hash)
    kind: str  # "ckpt" or "kv"


_THREADS = min(8, os.cpu_count() or 1)
_POOL = ThreadPoolExecutor(_THREADS, thread_name_prefix="statechat-blob")
_STAGING: dict[torch.device, queue.SimpleQueue] = {}  # device -> free (pinned buffer, stream)
_STAGING_LOCK = threading.Lock()
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}

Entries = dict[str, tuple[torch.dtype, list[int], int, int]]  # name -> dtype, shape, start, end


def _pieces(nbytes: int) -> list[tuple[int, int]]:
    """(offset, length) of each piece of a tensor's bytes; an empty tensor has one empty piece."""
    return [(o, min(PIECE_BYTES, nbytes - o)) for o in range(0, max(nbytes, 1), PIECE_BYTES)]


def _fold(pieces: list[tuple[str, int, int]], crcs) -> str:
    """The blob checksum from the crc of each (tensor, offset, length) piece: crc32 of the text
    "name:crc.crc...,name:crc..." (hex crcs in offset order, tensors in name order)."""
    by_name: dict[str, list[str]] = {}
    for (name, _, _), crc in sorted(zip(pieces, crcs)):
        by_name.setdefault(name, []).append(f"{crc:08x}")
    return f"{zlib.crc32(','.join(f'{n}:' + '.'.join(c) for n, c in by_name.items()).encode()):08x}"


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    """The checksum of host tensors: crc32 of every piece (in parallel), folded (hex)."""
    data = {n: memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())
            for n, t in tensors.items()}
    pieces = [(n, o, size) for n, d in data.items() for o, size in _pieces(len(d))]
    return _fold(pieces, _POOL.map(lambda p: zlib.crc32(data[p[0]][p[1] : p[1] + p[2]]), pieces))


def write_blob(path: Path, tensors: dict[str, torch.Tensor], meta: BlobMeta,
               pause: Callable[[], None] | None = None) -> tuple[int, str]:
    """Write atomically; return (bytes on disk, checksum).

    The file is a plain safetensors file, written in one pass straight from the tensors' memory
    (no serialised copy of the blob): each piece is checksummed and written at its offset, and
    the header, whose length does not depend on the checksum, goes in last. The writer thus
    makes few, long calls that release the GIL. `pause` runs before every PIECE_BYTES of data
    (the store's writer holds back there while the engine launches work)."""
    # widest dtypes first, then by name, as safetensors orders them: every tensor starts aligned
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    data = {n: memoryview(tensors[n].detach().to("cpu").contiguous().view(torch.uint8)
                          .reshape(-1).numpy()) for n in order}
    header = _header(tensors, order, meta, crc="0" * 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}{TMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        pieces, crcs, offset, since_pause = [], [], len(header), PIECE_BYTES
        for name in order:
            for start, size in _pieces(len(data[name])):
                if pause is not None and since_pause >= PIECE_BYTES:
                    pause()
                    since_pause = 0
                piece = data[name][start : start + size]
                crcs.append(zlib.crc32(piece))
                pieces.append((name, start, size))
                _write_all(fd, piece, offset)
                offset += size
                since_pause += size
        crc = _fold(pieces, crcs)
        _write_all(fd, memoryview(_header(tensors, order, meta, crc)), 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return offset, crc


def _header(tensors: dict[str, torch.Tensor], order: list[str], meta: BlobMeta, crc: str) -> bytes:
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
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [start, start + size]}
        start += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return len(text).to_bytes(8, "little") + text


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        done = os.pwrite(fd, data, offset)
        data, offset = data[done:], offset + done


def resident_fraction(path: Path) -> float:
    """The fraction of a file's pages in the page cache (mincore on a read-only mapping), so a
    plan can price a warm read apart from a cold one; 0.0 (cold, the cautious guess) where
    that cannot be told. A file of more than RESIDENT_SAMPLES windows of RESIDENT_WINDOW pages
    is sampled at that many evenly spaced windows (a whole-file mincore costs about 15 ns a
    page, and a plan may ask about dozens of blobs of tens of MB)."""
    try:
        st = path.stat()
        if st.st_uid != os.geteuid() and not os.access(path, os.W_OK):
            return 0.0  # since Linux 5.0, mincore says "all cached" for files one does not own
        size = st.st_size
        if size == 0:
            return 1.0
        libc = _libc()
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        finally:
            os.close(fd)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            return 0.0
        try:
            pages = (size + _PAGE - 1) // _PAGE
            if pages <= RESIDENT_SAMPLES * RESIDENT_WINDOW:
                windows = [(0, pages)]
            else:  # step >= RESIDENT_WINDOW, so the windows lie inside the file
                step = pages // RESIDENT_SAMPLES
                windows = [(i * step, RESIDENT_WINDOW) for i in range(RESIDENT_SAMPLES)]
            vec = (ctypes.c_ubyte * max(n for _, n in windows))()
            cached = 0
            for first, n in windows:
                length = min(n * _PAGE, size - first * _PAGE)
                if libc.mincore(ctypes.c_void_p(addr + first * _PAGE), ctypes.c_size_t(length), vec) != 0:
                    return 0.0
                cached += ctypes.string_at(vec, n).translate(_LOW_BIT).count(1)  # bit 0: resident
            return cached / sum(n for _, n in windows)
        finally:
            libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
    except (OSError, AttributeError, ValueError, TypeError):
        return 0.0


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
RESIDENT_SAMPLES, RESIDENT_WINDOW = 8, 32  # resident_fraction's sample of a large file
_LOW_BIT = bytes(b & 1 for b in range(256))


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_blob(
    path: Path, fingerprint: str, expected: dict[str, tuple[int, ...]],
    checksum_in_index: str | None = None, device: torch.device | str | None = None,
) -> dict[str, torch.Tensor]:
    """Load and verify a blob; raise BlobError saying what is wrong.

    The tensors are views of one buffer: on `device` if it is a CUDA device with room for it,
    else in host memory (pinned for another accelerator). The header is checked before the
    tensor bytes are read, and they are returned only once their checksum matches.
    """
    device = torch.device(device or "cpu")
    try:
        fd = os.open(path, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        raise BlobError(f"blob {path.name} is missing") from None
    except OSError as e:  # (permissions, I/O, no file handles left: nothing said of its contents)
        raise BlobError(f"blob {path.name} cannot be opened ({e.strerror})", damaged=False) from None
    try:
        try:
            meta, data_start, entries = _read_header(fd)
        except OSError as e:
            raise BlobError(f"blob {path.name} cannot be read ({e.strerror})", damaged=False) from None
        except Exception as e:  # noqa: BLE001 - any parse failure means a damaged file
            raise BlobError(f"blob {path.name} is unreadable ({_first_line(e)})") from None
        _check_header(path.name, meta, entries, fingerprint, expected)
        try:
            buf, crc = _read_data(fd, data_start, entries, device)
        except OSError as e:
            raise BlobError(f"blob {path.name} cannot be read ({_first_line(e)})", damaged=False) from None
        except ValueError as e:
            raise BlobError(f"blob {path.name} is unreadable ({_first_line(e)})") from None
    finally:
        os.close(fd)
    if crc != meta.get("checksum") or (checksum_in_index and crc != checksum_in_index):
        raise BlobError(f"blob {path.name} fails its checksum")
    return {n: buf[start:end].view(dtype).reshape(shape)
            for n, (dtype, shape, start, end) in entries.items()}


def _first_line(e: Exception) -> str:
    return (str(e) or type(e).__name__).splitlines()[0][:80]


def _read_header(fd: int) -> tuple[dict, int, Entries]:
    """A safetensors header: (metadata, file offset of the data, entries with offsets into the
    data). ValueError if it is malformed or a tensor lies past the end of the file."""
    file_size = os.fstat(fd).st_size
    n = int.from_bytes(os.pread(fd, 8, 0), "little")
    if n <= 0 or 8 + n > file_size:
        raise ValueError("bad header length")
    header = json.loads(os.pread(fd, n, 8))
    meta = header.pop("__metadata__", None) or {}
    entries = {}
    for name, info in header.items():
        dtype, shape, (start, end) = _DTYPES[info["dtype"]], info["shape"], info["data_offsets"]
        if end > file_size - 8 - n:
            raise ValueError(f"tensor {name} lies past the end of the file")
        if not 0 <= start <= end or end - start != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"tensor {name} has {end - start} bytes for shape {shape}")
        entries[name] = (dtype, shape, start, end)
    return meta, 8 + n, entries


def _check_header(blob: str, meta: dict, entries: Entries, fingerprint: str,
                  expected: dict[str, tuple[int, ...]]) -> None:
    if meta.get("format_version") != str(CACHE_FORMAT_VERSION):
        raise BlobError(f"blob {blob} has cache format {meta.get('format_version')}")
    if meta.get("fingerprint") != fingerprint:
        raise BlobError(f"blob {blob} belongs to another model")
    if set(entries) != set(expected):
        raise BlobError(f"blob {blob} holds other tensors than expected")
    for name, shape in expected.items():
        if tuple(entries[name][1]) != tuple(shape):
            raise BlobError(f"blob {blob} tensor {name} has shape {list(entries[name][1])}")


def _read_data(fd: int, data_start: int, entries: Entries, device: torch.device,
               pin: bool = False) -> tuple[torch.Tensor, str]:
    """The tensors' bytes, read run by run on the pool: (one uint8 buffer laid out like the
    file's data, their checksum). Returns or raises only when every piece is done, so no
    thread writes into the buffer after it."""
    size = max((end for *_, end in entries.values()), default=0)
    if device.type == "cuda":
        try:
            buf = torch.empty(size, dtype=torch.uint8, device=device)
        except torch.cuda.OutOfMemoryError:  # no room for the verified copy: pinned host memory
            return _read_data(fd, data_start, entries, torch.device("cpu"), pin=True)
        # the allocating stream may still use this memory for what it held before: the copies,
        # on other streams, wait for this point of it
        free = torch.cuda.Event()
        free.record(torch.cuda.current_stream(buf.device))

        def read(run: list[tuple[int, int]]) -> list[int]:
            return _read_run_to_cuda(fd, data_start, run, buf, free)
    else:
        buf = torch.empty(size, dtype=torch.uint8, pin_memory=pin or device.type != "cpu")
        view = memoryview(buf.numpy())

        def read(run: list[tuple[int, int]]) -> list[int]:
            start, end = run[0][0], run[-1][0] + run[-1][1]
            _read_into(fd, data_start + start, view[start:end])
            return [zlib.crc32(view[o : o + n]) for o, n in run]

    pieces = [(n, start + o, length) for n, (_, _, start, end) in entries.items()
              for o, length in _pieces(end - start)]
    order = sorted(range(len(pieces)), key=lambda i: pieces[i][1:])
    runs = _runs([pieces[i][1:] for i in order])
    futures = [_POOL.submit(read, run) for run in runs]
    wait(futures)
    crcs = [0] * len(pieces)
    for i, crc in zip(order, (crc for f in futures for crc in f.result())):
        crcs[i] = crc
    return buf, _fold(pieces, crcs)


def _runs(pieces: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Pieces (offset, length), in offset order, grouped into runs of adjacent ones of at most
    RUN_BYTES together (a larger piece is a run of its own): one read and one copy each, while
    each piece keeps its own checksum. Small tensors (a small model's) would otherwise cost a
    read, a copy and a wait each."""
    runs: list[list[tuple[int, int]]] = []
    for offset, length in pieces:
        last = runs[-1] if runs else None
        if (last is not None and last[-1][0] + last[-1][1] == offset
                and offset + length - last[0][0] <= RUN_BYTES):
            last.append((offset, length))
        else:
            runs.append([(offset, length)])
    return runs


def _read_into(fd: int, offset: int, out: memoryview) -> None:
    """Fill `out` from the file at `offset`."""
    done = 0
    while done < len(out):
        got = os.preadv(fd, [out[done:]], offset + done)
        if not got:
            raise ValueError("file ends early")
        done += got


def _read_run_to_cuda(fd: int, data_start: int, run: list[tuple[int, int]], buf: torch.Tensor,
                      free: torch.cuda.Event) -> list[int]:
    """Read a run of pieces into a free staging buffer and copy it into its place in `buf` (a
    device buffer) on the buffer's stream once `free` is reached; return each piece's crc32.
    The copy is waited for: when this returns the run is on the device and the buffer is free
    again."""
    start, end = run[0][0], run[-1][0] + run[-1][1]
    free_buffers = prepare_staging(buf.device)
    staging, stream = free_buffers.get()  # never waits long: as many buffers as pool threads
    try:
        view = memoryview(staging.numpy())
        _read_into(fd, data_start + start, view[: end - start])
        crcs = [zlib.crc32(view[o - start : o - start + n]) for o, n in run]
        stream.wait_event(free)
        with torch.cuda.stream(stream):
            buf[start:end].copy_(staging[: end - start], non_blocking=True)
        stream.synchronize()
    finally:
        free_buffers.put((staging, stream))
    return crcs


def prepare_staging(device: torch.device | str) -> queue.SimpleQueue:
    """The pinned staging buffers (one piece each, one per reading thread) and copy streams for
    restores onto the CUDA `device`: pinned on the first call and kept for the process."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    with _STAGING_LOCK:
        if device not in _STAGING:
            free: queue.SimpleQueue = queue.SimpleQueue()
            for _ in range(_THREADS):
                free.put((torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True),
                          torch.cuda.Stream(device)))
            _STAGING[device] = free
        return _STAGING[device]
