"""Opening the SQLite files (the cache index, the chats in it) and what their errors say of
the file: locked by another process, damaged, or out of reach (permissions, read-only media).
"""

from __future__ import annotations

import errno
import os
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from statechat.errors import ConfigError

FULL_BYTES = 1 << 20  # a disk with less room left than this is full (SQLite's files need more)
OPEN_ATTEMPTS = 20  # tries to open a SQLite file another process holds locked (about 10 s in all)
T = TypeVar("T")


class DiskFullError(ConfigError):
    """A SQLite file that cannot be opened or written: its disk is full (no room for its
    journal). `statechat cache clear` and `gc` free the cache's blob files first then."""


def lenient_text(data: bytes) -> str:
    """A text value as SQLite holds it, read as UTF-8 (a connection's text_factory); bytes
    that are not (a title, message or model name edited by hand with `sqlite3`, which stores
    what it is given) read as U+FFFD, where the default failed the whole read (no chat could
    be listed, no cache row shown)."""
    return data.decode("utf-8", errors="replace")


def open_sqlite(path: Path, attempt: Callable[[], T]) -> T:
    """`attempt()` (which opens the SQLite file `path`), again while another process holds it
    locked (creating it or switching it to WAL at the same moment, SQLite can answer "locked" at
    once, without waiting out the busy timeout); a one-line ConfigError if it cannot be opened."""
    for n in range(OPEN_ATTEMPTS):
        try:
            return attempt()
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or n == OPEN_ATTEMPTS - 1:
                raise open_error(path, e) from None
            time.sleep(0.05 * (n + 1))
        except (sqlite3.DatabaseError, OSError) as e:
            # a damaged file, a folder in its place, no access
            raise open_error(path, e) from None
    raise AssertionError("unreachable")


def open_error(path: Path, e: Exception, whole: bool = True) -> ConfigError:
    """The one-line error for a SQLite file (cache index, chats) that cannot be opened or read.
    On a full disk that is a DiskFullError, a damaged-looking file too where not `whole` (read
    as immutable, without its write-ahead log, the state a checkpoint cut short by that full
    disk left in the file reads as damaged); a file read whole that reads as damaged is."""
    if path.parent.exists() and not path.parent.is_dir():
        return ConfigError(f"{path.parent} is a file; pass a folder")
    if path.is_dir():  # (not a question of permissions)
        return ConfigError(f"{path} is a folder; move it away (statechat keeps a SQLite file "
                           "there)")
    why = (e.strerror if isinstance(e, OSError) and e.strerror
           else (str(e).splitlines() or [type(e).__name__])[0])
    if is_locked(e):  # (moving a sound index away would lose the cache and the chats)
        return ConfigError(f"{path} is locked by another process ({why}): a `sqlite3` shell "
                           "inside a transaction, say; try again once it is done")
    damaged = isinstance(e, sqlite3.DatabaseError) and not isinstance(e, sqlite3.OperationalError)
    if (on_full_disk(path.parent) and not (damaged and whole)) or (is_full(e) and not damaged):
        # (SQLite says "disk I/O error" for some; and where it cannot make the -shm file, the
        # index is read as immutable, its write-ahead log unread: a checkpoint that the full
        # disk cut short then reads as "malformed", which is not damage)
        seen = (f"{why}, as read without its write-ahead log, which SQLite has no room to read "
                "on a full disk: no sign of damage" if damaged else why)
        # (every SQLite file of statechat's is a cache dir's index.db: the chats are in it too)
        return DiskFullError(f"cannot open {path} ({seen}); its disk is full "
                             f"({size_text(free_bytes(path.parent))} free): `statechat cache "
                             f"clear --cache-dir {path.parent}` frees the cache's space (the "
                             "chats are kept), or free some space on it, or pick a cache dir on "
                             "another disk")
    if damaged:
        # (damaged, or not a database; it holds the chats too, which moving it away hides)
        advice = (f"`sqlite3 {path} .recover | sqlite3 {path}.recovered` copies what is left "
                  "of it (the chats in it too) into a file to put in its place, or move the "
                  "file away to start afresh")
    elif on_read_only_media(path.parent):
        advice = "its folder is on a read-only file system: pick a cache dir you can write to"
    else:
        advice = "check the folder's permissions"
    return ConfigError(f"cannot open {path} ({why}); {advice}")


def is_full(error: BaseException) -> bool:
    """Whether `error` says the disk is full (SQLITE_FULL, or an OSError of no space left)."""
    if isinstance(error, OSError):
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    return primary_code(error) == SQLITE_FULL or "database or disk is full" in str(error)


def is_too_large(error: BaseException) -> bool:
    """Whether `error` says a file may not grow that large (EFBIG: the process's file size
    limit, RLIMIT_FSIZE, or the file system's largest file)."""
    return isinstance(error, OSError) and error.errno == errno.EFBIG


def on_full_disk(folder: Path) -> bool:
    """Whether the file system of `folder` (or of the nearest folder above it that exists) has
    less than FULL_BYTES left for this user."""
    free = free_bytes(folder)
    return free is not None and free < FULL_BYTES


def free_bytes(folder: Path) -> int | None:
    """The bytes this user may still write on the file system of `folder` (or of the nearest
    folder above it that exists); None where it cannot be told."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        st = os.statvfs(folder)
    except (OSError, AttributeError):  # (Windows has no statvfs)
        return None
    return st.f_bavail * st.f_frsize


def size_text(n: float | None) -> str:
    """`n` bytes for people: `512 B`, `1.5 KiB`, ... `20.0 GiB` (powers of 1024); `-` for
    None."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)


def on_read_only_media(folder: Path) -> bool:
    """Whether `folder` (or the nearest folder above it that exists) is on a file system
    mounted read-only."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):  # (Windows has no statvfs)
        return False


# SQLite's primary result codes, as it defines them (the sqlite3 module names them, and gives
# an error its code, from Python 3.11 on; 3.10 has neither)
SQLITE_BUSY, SQLITE_LOCKED, SQLITE_READONLY, SQLITE_IOERR, SQLITE_CORRUPT = 5, 6, 8, 10, 11
SQLITE_FULL, SQLITE_CANTOPEN, SQLITE_NOTADB = 13, 14, 26
UNUSABLE_CODES = {SQLITE_CORRUPT, SQLITE_NOTADB, SQLITE_IOERR}


def primary_code(error: BaseException) -> int | None:
    """The primary result code of a SQLite error (SQLITE_IOERR for SQLITE_IOERR_READ, ...);
    None where the error carries none (Python 3.10, or an error statechat raised itself)."""
    code = getattr(error, "sqlite_errorcode", None)
    return None if code is None else code & 0xFF


def is_locked(error: BaseException) -> bool:
    """Whether `error` is SQLite's "database is locked" (SQLITE_BUSY or SQLITE_LOCKED): another
    process holds the file past the busy timeout, which says nothing of the file itself."""
    if not isinstance(error, sqlite3.OperationalError):
        return False
    code = primary_code(error)
    if code is not None:
        return code in (SQLITE_BUSY, SQLITE_LOCKED)
    return "locked" in str(error)


def is_unusable(error: BaseException) -> bool:
    """Whether `error` says the index file itself is unusable (damaged, not a database, a disk
    I/O error): the disk tier is turned off then. A transient one (another process holds a lock
    past the busy timeout, a full disk) is not: it costs the one save or lookup that met it.
    SQLite's extended codes (SQLITE_IOERR_READ, ...) count by their primary code; an error
    without a code (check_integrity's) counts unless it is an OperationalError, or a
    ProgrammingError (a closed connection, wrong bindings: the caller's, not the file's)."""
    if not isinstance(error, sqlite3.DatabaseError) or isinstance(error, sqlite3.ProgrammingError):
        return False
    code = primary_code(error)
    if code is not None:
        return code in UNUSABLE_CODES
    return not isinstance(error, sqlite3.OperationalError)
