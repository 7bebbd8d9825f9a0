"""Reading a blob back, verified: the header is checked before the tensor bytes are read, and
the tensors are handed out only once their checksum matches.

Tensor bytes are checksummed in pieces of PIECE_BYTES, and read in runs of adjacent pieces
(up to RUN_BYTES) on a few threads (preadv and crc32 release the GIL), so a restore runs near
the page cache's bandwidth. For a CUDA device a run goes through one of a few pinned staging
buffers into one device buffer. The buffers are pinned once, by `prepare_staging` when a store
is attached (pinning 16 MiB costs milliseconds, and the first restore after a start must not
pay it), and shared by the reading threads.
"""

from __future__ import annotations

import json
import math
import os
import queue
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import torch

from statechat.cache.blobs.encoding import (
    DTYPES,
    PIECE_BYTES,
    BlobError,
    Entries,
    check_header,
    fold_crcs,
    split_pieces,
)

RUN_BYTES = 4 << 20  # adjacent pieces read, checksummed and copied by one thread together
STAGING_BYTES = max(PIECE_BYTES, RUN_BYTES)  # a pinned staging buffer: a run, or one piece

_THREADS = min(8, os.cpu_count() or 1)
_POOL = ThreadPoolExecutor(_THREADS, thread_name_prefix="statechat-blob")
_STAGING: dict[torch.device, queue.SimpleQueue] = {}  # device -> free (pinned buffer, stream)
_STAGING_LOCK = threading.Lock()


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    """The checksum of host tensors: crc32 of every piece (in parallel), folded (hex)."""
    data = {n: memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())
            for n, t in tensors.items()}
    pieces = [(n, o, size) for n, d in data.items() for o, size in split_pieces(len(d))]
    crcs = _POOL.map(lambda p: zlib.crc32(data[p[0]][p[1] : p[1] + p[2]]), pieces)
    return fold_crcs(pieces, crcs)


def read_blob(
    path: Path, fingerprint: str, expected: dict[str, tuple[int, ...]],
    checksum_in_index: str | None = None, device: torch.device | str | None = None,
    hashes: dict[int, str] | None = None,
) -> dict[str, torch.Tensor]:
    """Load and verify a blob; raise BlobError saying what is wrong. `hashes` ({index in the
    blob's metadata `hashes`: hex hash}): the blocks its index rows say it holds, and where.

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
        raise BlobError(f"blob {path.name} cannot be opened ({e.strerror})",
                        damaged=False) from None
    try:
        try:
            meta, data_start, entries = _read_header(fd)
        except OSError as e:
            raise BlobError(f"blob {path.name} cannot be read ({e.strerror})",
                            damaged=False) from None
        except Exception as e:  # noqa: BLE001 - any parse failure means a damaged file
            raise BlobError(f"blob {path.name} is unreadable ({_first_line(e)})") from None
        check_header(path.name, meta, entries, fingerprint, expected, hashes)
        try:
            buf, crc = _read_data(fd, data_start, entries, device)
        except OSError as e:
            raise BlobError(f"blob {path.name} cannot be read ({_first_line(e)})",
                            damaged=False) from None
        except ValueError as e:
            raise BlobError(f"blob {path.name} is unreadable ({_first_line(e)})") from None
    finally:
        os.close(fd)
    if crc != meta.get("checksum") or (checksum_in_index and crc != checksum_in_index):
        raise BlobError(f"blob {path.name} fails its checksum")
    return {n: buf[start:end].view(dtype).reshape(shape)
            for n, (dtype, shape, start, end) in entries.items()}


def own_identity(path: Path) -> tuple[str, dict[str, tuple[int, ...]]]:
    """The model fingerprint and the tensor shapes that the header of the blob at `path` gives
    (read_blob, given them, checks the rest of it: its checksum, its hashes); BlobError where
    the header cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise BlobError(f"blob {path.name} cannot be opened ({e.strerror})",
                        damaged=False) from None
    try:
        meta, _, entries = _read_header(fd)
    except Exception as e:  # noqa: BLE001 - any parse failure means a damaged file
        raise BlobError(f"blob {path.name} is unreadable ({_first_line(e)})") from None
    finally:
        os.close(fd)
    return str(meta.get("fingerprint")), {n: tuple(e[1]) for n, e in entries.items()}


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
    if not isinstance(meta, dict):  # (sound JSON of another shape: damaged all the same)
        raise ValueError("bad metadata")  # noqa: TRY004 - malformed, as this function says
    entries = {}
    for name, info in header.items():
        dtype, shape, (start, end) = DTYPES[info["dtype"]], info["shape"], info["data_offsets"]
        if end > file_size - 8 - n:
            raise ValueError(f"tensor {name} lies past the end of the file")
        if not 0 <= start <= end or end - start != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"tensor {name} has {end - start} bytes for shape {shape}")
        entries[name] = (dtype, shape, start, end)
    return meta, 8 + n, entries


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
              for o, length in split_pieces(end - start)]
    order = sorted(range(len(pieces)), key=lambda i: pieces[i][1:])
    runs = _runs([pieces[i][1:] for i in order])
    futures = [_POOL.submit(read, run) for run in runs]
    wait(futures)
    crcs = [0] * len(pieces)
    for i, crc in zip(order, (crc for f in futures for crc in f.result())):
        crcs[i] = crc
    return buf, fold_crcs(pieces, crcs)


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
