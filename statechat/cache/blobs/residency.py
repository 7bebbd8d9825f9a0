"""How much of a file the page cache holds (mincore), so a plan can price a warm read apart
from a cold one."""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
RESIDENT_SAMPLES, RESIDENT_WINDOW = 8, 32  # resident_fraction's sample of a large file
_LOW_BIT = bytes(b & 1 for b in range(256))


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
                start = ctypes.c_void_p(addr + first * _PAGE)
                if libc.mincore(start, ctypes.c_size_t(length), vec) != 0:
                    return 0.0
                cached += ctypes.string_at(vec, n).translate(_LOW_BIT).count(1)  # bit 0: resident
            return cached / sum(n for _, n in windows)
        finally:
            libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
    except (OSError, AttributeError, ValueError, TypeError):
        return 0.0


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc
