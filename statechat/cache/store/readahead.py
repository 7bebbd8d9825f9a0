"""The index's read-ahead: before a lookup, have the kernel read index.db (and its WAL) ahead,
whole, if it is small, advising through the descriptors SQLite itself holds open.

Never open and close a descriptor of one's own on these files: closing it drops every POSIX
lock this process has on the file, SQLite's too, and another process closing its connection
would then take the WAL for unused and delete it, with the writes this one goes on making in
it (sqlite.org, "How To Corrupt", 2.2).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

PREFETCH_INDEX_BYTES = 16 << 20  # an index up to this size is read ahead at each lookup


class IndexReadAhead:
    """Read-ahead advice for the SQLite file `name` in the folder `path` and its WAL."""

    def __init__(self, path: Path, name: str) -> None:
        self.path = path
        self.name = name
        self._fds: dict[str, tuple] = {}  # index file -> ((dev, inode), SQLite's descriptor)

    def prefetch(self) -> None:
        """Have the kernel read the index (and its WAL) ahead, whole, if it is small: a lookup
        in an index the page cache dropped reads B-tree pages one at a time (5-10 ms for a 32k
        prompt on the H100 machine's disk), where one sequential read-ahead of a few MB takes
        about a millisecond. Nothing happens to files the page cache holds. The advice goes
        through the descriptors SQLite holds: opening and closing one of our own would drop
        every POSIX lock this process has on the file, SQLite's too, and another process
        closing its connection would then take the WAL for unused and delete it, with the
        writes this one goes on making in it (sqlite.org, "How To Corrupt", 2.2)."""
        if not hasattr(os, "posix_fadvise"):
            return
        for name in (self.name, self.name + "-wal"):
            fd = self._sqlite_fd(name)
            try:
                if fd is not None and os.fstat(fd).st_size <= PREFETCH_INDEX_BYTES:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass

    def _sqlite_fd(self, name: str) -> int | None:
        """A descriptor this process holds open on the cache dir's file `name` (SQLite's), from
        /proc/self/fd, looked up again only when the file is another (a new WAL); None where
        there is none, or no /proc."""
        try:
            st = os.stat(self.path / name)
        except OSError:
            return None
        key = _file_key(st)
        known = self._fds.get(name)
        if known is not None and known[0] == key:
            fd = known[1]
            with contextlib.suppress(OSError):
                if fd is None or _file_key(os.fstat(fd)) == key:
                    return fd
        fd = None
        with contextlib.suppress(OSError):
            for entry in os.scandir("/proc/self/fd"):
                with contextlib.suppress(OSError, ValueError):
                    if _file_key(os.stat(entry.path)) == key:
                        fd = int(entry.name)
                        break
        self._fds[name] = (key, fd)
        return fd


def _file_key(st: os.stat_result) -> tuple[int, int]:
    """What names a file whatever its path: (device, inode)."""
    return st.st_dev, st.st_ino
