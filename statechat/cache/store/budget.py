"""The disk tier's byte budget: the default rule, and the record of the budget an engine writes
under, in index.db's `disk_budget` table (docs/cache-schema.md), which `statechat cache stats`
shows and a plain `statechat cache gc` keeps to.

An engine evicts down to its budget after each save: `--disk-cache-bytes` (`disk_cache_bytes`)
where given, else the default, 10% of the free space and of the cache's own blobs, taken as it
starts. The cache commands run apart from any engine, so every write transaction of an engine
(a save, the marks of reuses) records the budget it evicts down to (the last writer's row): gc
then evicts down to a budget a user set there, rather than to a default that a user who set
`20G` never asked for, and stats says which one it is.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import sqlite_utils

from statechat.cache import index

DEFAULT_SHARE = 0.10  # the default budget's share of the space the cache may count on
LOG_SHARE = 16  # the index's write-ahead log is folded into index.db past 1/16 of the budget
MAX_LOG_BYTES = 4 << 20  # (SQLite's own default: 1,000 pages of 4 KiB)


def default_budget(root: Path, own_bytes: int = 0) -> int:
    """10% of the space the cache may count on: the free space of the cache dir's file system
    (of its nearest existing folder: nothing is created) and `own_bytes`, the cache's own blobs.
    (Of the free space alone, a cache that filled its budget found a smaller one at each start,
    and evicted down to it; on a full disk, all of it.) On a full disk it is 10% of the cache's
    own: the cache gives back 90% of itself, a tenth of the space other files took from it."""
    root = Path(root).absolute()
    while not root.exists() and root != root.parent:
        root = root.parent
    return int((shutil.disk_usage(root).free + own_bytes) * DEFAULT_SHARE)


def program_name() -> str:
    """What this process is, for people: `statechat serve`, `statechat batch`, or the script
    that made an engine (`myscript.py`)."""
    argv = sys.argv or [""]
    name = Path(argv[0]).name
    if name in ("__main__.py", "-m", "statechat", ""):
        name = "statechat"
    if name == "statechat" and len(argv) > 1 and not argv[1].startswith("-"):
        name += f" {argv[1]}"
    return name


def record_budget(db: sqlite_utils.Database, budget: int, explicit: bool, now: float) -> None:
    """(In the caller's write transaction) Keep in `disk_budget` the budget this engine evicts
    down to: its bytes, whether it was set (`--disk-cache-bytes`) or is the default rule's,
    when it last wrote under it, and which process it is (pid, program). One row: the last
    writer's. The table is made here where the index was made before it."""
    db.execute(index.DISK_BUDGET_TABLE)
    db.execute("INSERT OR REPLACE INTO disk_budget (id, bytes, explicit, set_at, pid, program) "
               "VALUES (1, ?, ?, ?, ?, ?)",
               [budget, int(explicit), now, os.getpid(), program_name()])


def recorded_budget(db: sqlite_utils.Database) -> dict | None:
    """The budget the last engine wrote under (`record_budget`), as {"bytes", "explicit",
    "set_at", "pid", "program"}; None where none was recorded (or the index was made before
    the table, and no engine of this version has written to it since)."""
    if not db.execute("SELECT 1 FROM sqlite_master WHERE name = 'disk_budget'").fetchone():
        return None
    row = db.execute("SELECT bytes, explicit, set_at, pid, program FROM disk_budget "
                     "WHERE id = 1").fetchone()
    if row is None:
        return None
    return {"bytes": row[0], "explicit": bool(row[1]), "set_at": row[2], "pid": row[3],
            "program": row[4]}


def gc_budget(recorded: dict | None, default: int) -> int:
    """The budget a plain `cache gc` evicts down to: the one the last engine wrote under where
    a user set it (`recorded`, explicit), else the default rule's, `default`, as an engine
    started without --disk-cache-bytes would take it now."""
    return recorded["bytes"] if recorded and recorded["explicit"] else default


def bound_log(db: sqlite_utils.Database, budget: int) -> None:
    """Keep the index's write-ahead log (index.db-wal) small beside the budget: this connection
    folds it into index.db (a passive checkpoint, which waits for no one) at the commit that
    takes it past a sixteenth of the budget, at most MAX_LOG_BYTES, and cuts the file back to
    that size once it starts over. The budget counts the blobs, which eviction can free: a
    deletion adds to the log, and index.db (the chats in it too) does not shrink. SQLite's
    default, 4 MB, let the log grow by a save's pages (some 70 KB) with every save, past a
    small budget and, on a small disk, to its end."""
    limit = max(0, min(MAX_LOG_BYTES, budget // LOG_SHARE))
    page = db.execute("PRAGMA page_size").fetchone()[0] or 4096
    db.execute(f"PRAGMA wal_autocheckpoint = {max(1, limit // page)}")
    db.execute(f"PRAGMA journal_size_limit = {limit}")
