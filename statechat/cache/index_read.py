"""Opening the disk tier's index (`index.db`) to read it alone, for the cache commands that only
report (`statechat cache stats`, `ls`, and `verify` on a read-only cache): nothing is created,
migrated or written, on read-only media and on a full disk too. (index.py opens it to write.)
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import sqlite_utils

from statechat.cache import index
from statechat.cache.sqlite_files import (
    free_bytes,
    is_full,
    lenient_text,
    on_full_disk,
    open_error,
    open_sqlite,
    size_text,
)

# the ways a file is opened, in turn: mode=rw (never creates the file) lets the last reader out
# remove the WAL files it made, as sqlite3's own shell does (query_only keeps it from writing
# anything else); mode=ro, then immutable=1 where no -shm file can be made
OPEN_MODES = ("mode=rw", "mode=ro", "immutable=1")


def connect_read_only(path: Path) -> sqlite_utils.Database:
    """Open the index to read it alone: nothing is created or migrated, and no row written
    (as the last connection to close, SQLite may still fold a write-ahead log left by a
    crashed writer into index.db, as its own shell does). No index.db yet, or one without the
    index's tables (an empty file, the chats' alone): an empty index in memory; another
    program's SQLite file is a ConfigError (index.refuse_foreign). On read-only media or a
    full disk, where SQLite cannot make the WAL's -wal and -shm files, the file is read as
    immutable, and a warning says if a WAL was left unread."""
    if not path.exists():
        if path.parent.exists() and not path.parent.is_dir():
            raise open_error(path, NotADirectoryError())
        return _empty_index()

    def attempt() -> sqlite_utils.Database:
        conn, whole = query_only(path, index.BUSY_TIMEOUT_S)
        return _opened(conn, path, whole)

    return open_sqlite(path, attempt)


def query_only(path: Path, timeout_s: float) -> tuple[sqlite3.Connection, bool]:
    """A connection that only reads the existing SQLite file `path` (OPEN_MODES in turn, its
    header read), and whether it reads it whole (with its write-ahead log; else as immutable:
    read-only media, a full disk): for the index, and for the chats' `statechat chats` reads.
    A damaged file is a one-line ConfigError; other OperationalErrors are open_sqlite's."""
    for query in OPEN_MODES:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?{query}", uri=True,
                               timeout=timeout_s, isolation_level=None,
                               check_same_thread=False)
        try:
            conn.text_factory = lenient_text
            conn.execute("PRAGMA query_only = 1")
            conn.execute(f"PRAGMA busy_timeout = {int(timeout_s * 1000)}")
            conn.execute("PRAGMA user_version").fetchone()  # (the file's header read)
        except sqlite3.OperationalError as e:
            conn.close()
            if query != "immutable=1" and ("unable to open" in str(e) or "readonly" in str(e)
                                           or is_full(e) or on_full_disk(path.parent)):
                continue  # (read-only media or files, a full disk: no -shm file can be made)
            raise
        except sqlite3.DatabaseError as e:  # (damaged, or as read without its WAL?)
            conn.close()
            raise open_error(path, e, whole=query != "immutable=1") from None
        except BaseException:
            conn.close()
            raise
        return conn, query != "immutable=1"
    raise AssertionError("unreachable")


def _opened(conn: sqlite3.Connection, path: Path, whole: bool) -> sqlite_utils.Database:
    """(connect_read_only) The index that `conn`, its header read, opened: read `whole` (with
    its write-ahead log), else as immutable. An empty index in memory for a file without the
    index's tables; `conn` closed where it gives none."""
    try:  # (another program's file: one line, as an engine's; not read as empty)
        has_index = index.refuse_foreign(conn, path)
    except sqlite3.DatabaseError as e:  # (as read without its WAL on a full disk?)
        conn.close()
        raise open_error(path, e, whole=whole) from None
    except BaseException:
        conn.close()
        raise
    if not has_index:  # (a new or empty file, or the chats' tables alone)
        conn.close()
        return _empty_index()
    wal = path.with_name(path.name + "-wal")
    if not whole and wal.exists() and wal.stat().st_size:
        where = (f"is on a full disk ({size_text(free_bytes(path.parent))} free)"
                 if on_full_disk(path.parent) else "is read-only")
        index.log.warning("statechat cache: %s %s and its write-ahead log was not read; the "
                          "latest writes may be missing", path, where)
    db = sqlite_utils.Database(conn)
    db.read_whole = whole  # (open_error's `whole`)
    return db


def _empty_index() -> sqlite_utils.Database:
    """An empty index in memory: the schema, no rows."""
    db = sqlite_utils.Database(sqlite3.connect(":memory:", isolation_level=None,
                                               check_same_thread=False))
    index.migrate(db)
    return db
