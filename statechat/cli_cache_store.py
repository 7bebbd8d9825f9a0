"""How the `cache` commands open the cache dir's store: read-only unless they delete, nothing
created, a damaged index one line; and how they write it on a full disk (blob files first)."""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path

import typer

from statechat.errors import StatechatError


def cache_root(cache_dir: Path | None) -> Path:
    """The cache dir the commands work on (--cache-dir, else the default); a one-line error
    where a file stands in its place or above it (no cache can ever be there), as an engine
    gives before its model loads."""
    from statechat.cli_setup import check_cache_dir
    from statechat.paths import cache_dir as resolve_cache_dir

    root = resolve_cache_dir(cache_dir)
    check_cache_dir(root)
    return root


def writable(root: Path) -> bool:
    """Whether the cache's folder and index may be changed (not on read-only media, say)."""
    index_db = root / "index.db"
    return os.access(root, os.W_OK) and (not index_db.exists() or os.access(index_db, os.W_OK))


def os_error_line(root: Path, e: OSError, verb: str) -> StatechatError:
    """An OSError of a cache command on a file of the cache dir `root` (a blob file another
    user made, by a run under sudo say, that this one may not `verb`), as one line."""
    where = f"{e.filename} ({e.strerror})" if e.filename else f"a file of {root} ({e})"
    return StatechatError(f"cannot {verb} {where}; check the permissions of the cache dir {root} "
                          "and of the files in it (those a run under sudo made there are "
                          "root's)")


@contextlib.contextmanager
def opened_store(root: Path, write: bool = False, deletes: bool | None = None):
    """The store of the cache dir `root`, or None where there is no cache dir yet (a note on
    stderr says so); its index is closed at the end. The cache commands only read or delete,
    so they create nothing: the index is opened read-only unless `write`, and a missing
    index.db is read as empty, not made (its blob files can still be deleted). An OSError
    (a file it may not delete, where `deletes`, which defaults to `write`) is one line."""
    if not root.exists():
        typer.echo(f"statechat: no cache at {root} yet", err=True)
        yield None
        return
    if not root.is_dir():
        raise StatechatError(f"{root} is a file; pass a folder")
    try:
        from statechat.cache.sqlite_files import open_error
        from statechat.cache.store import open_store
    except ImportError:
        raise StatechatError("this build has no persistent cache "
                             "(statechat.cache.store is missing)") from None
    store = open_store(root, read_only=not write or not (root / "index.db").exists())
    try:
        yield store
    except sqlite3.DatabaseError as e:  # (a damaged index.db: one line, no traceback)
        # (whole: read with its write-ahead log, which a reader on a full disk may not be)
        raise open_error(root / "index.db", e,
                         whole=getattr(store.db, "read_whole", True)) from None
    except OSError as e:
        raise os_error_line(root, e, "delete" if (write if deletes is None else deletes)
                            else "read") from None
    finally:
        store.close()


def has_cache(root: Path) -> bool:
    """Whether the cache dir `root` holds a cache: an index.db or a blobs/ folder."""
    if root.exists() and not root.is_dir():
        raise StatechatError(f"{root} is a file; pass a folder")
    return (root / "index.db").exists() or (root / "blobs").exists()


def check_writable(root: Path) -> None:
    """A one-line error, before `gc` or `clear` starts, for a cache that cannot be changed."""
    if root.is_dir() and not writable(root):
        raise StatechatError(f"the cache at {root} is read-only; nothing was deleted")


def writing(root: Path, then: str, change, blobs_first) -> int:
    """`change(store)` (bytes freed) on the cache at `root`, its index written. Where its disk
    is full (no room for the index's journal), `blobs_first()` deletes blob files first, the
    index not written (freeing.py), and gives (their names, bytes); then the rows naming them
    go, and `change` runs. If the disk is still full, one line says to run `then` once there
    is room. The chats are never touched."""
    from statechat.cache.sqlite_files import DiskFullError, size_text

    try:
        with opened_store(root, write=True) as store:
            return change(store) if store else 0
    except DiskFullError:
        names, freed = blobs_first()
    try:
        with opened_store(root, write=True) as store:
            store.forget_blobs(names)
            return freed + change(store)
    except DiskFullError:
        raise StatechatError(
            f"the disk of {root} is still full after deleting {size_text(freed)} of cache blobs; "
            f"free some space on it, then `statechat cache {then} --cache-dir {root}` deletes "
            "the index rows left naming them (the chats are kept)") from None
