"""The disk tier's SQLite index (`index.db`, WAL): schema, migrations and queries (opened to
read it alone, by the cache commands that report: index_read.py).

The schema is a public interface (docs/cache-schema.md): people read it with `sqlite3` or
`sqlite-utils`. Hashes are stored as lowercase hex text so they are readable and joinable.
A row is inserted only after its blob is completely on disk; deletions remove rows first and
then blobs, so no row ever points at a partial blob.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from pathlib import Path

import sqlite_utils

from statechat.cache.sqlite_files import lenient_text, open_sqlite
from statechat.errors import ConfigError

SCHEMA_VERSION = 1
OWN_TABLES = frozenset({"models", "segments", "blocks", "checkpoints"})  # (migrate's)
log = logging.getLogger("statechat.cache")

VIEWS = {
    "cache_checkpoints": """
        SELECT c.hash, m.name AS model, c.num_tokens, round(c.bytes / 1e6, 3) AS mb, c.hits,
               datetime(c.created, 'unixepoch') AS created, datetime(c.last_used, 'unixepoch') AS last_used,
               c.blob
        FROM checkpoints c JOIN models m ON m.id = c.model_id
        ORDER BY c.last_used DESC""",  # noqa: E501 - the view's text, as index.db stores it
    "cache_models": """
        SELECT m.id, m.name, m.dtype, m.block_size,
               (SELECT count(*) FROM checkpoints c WHERE c.model_id = m.id) AS checkpoints,
               (SELECT count(*) FROM blocks b WHERE b.model_id = m.id) AS blocks,
               round(((SELECT coalesce(sum(bytes), 0) FROM checkpoints c WHERE c.model_id = m.id)
                    + (SELECT coalesce(sum(bytes), 0) FROM segments s WHERE s.model_id = m.id)) / 1e6, 3) AS mb
        FROM models m""",  # noqa: E501 - the view's text, as index.db stores it
    "cache_top_checkpoints": """
        SELECT m.name AS model, c.num_tokens, c.hits, round(c.bytes / 1e6, 3) AS mb,
               datetime(c.last_used, 'unixepoch') AS last_used, c.hash
        FROM checkpoints c JOIN models m ON m.id = c.model_id
        WHERE c.hits > 0 ORDER BY c.hits DESC, c.last_used DESC LIMIT 100""",
}


# the budget the last engine wrote under (store/budget.py): made with the index, and by the
# first write of an engine in an index made before it (no migration: a start writes nothing)
DISK_BUDGET_TABLE = """CREATE TABLE IF NOT EXISTS disk_budget (
    id INTEGER PRIMARY KEY, bytes INTEGER, explicit INTEGER, set_at REAL, pid INTEGER,
    program TEXT)"""
BUSY_TIMEOUT_S = 30  # how long a statement waits for a lock that another process holds


def connect(path: Path) -> sqlite_utils.Database:
    """Open (and create or migrate) the index; safe to call from several processes at once."""

    def attempt() -> sqlite_utils.Database:
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(str(path), timeout=BUSY_TIMEOUT_S, isolation_level=None,
                               check_same_thread=False)
        conn.text_factory = lenient_text
        try:
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_S * 1000}")
            refuse_foreign(conn, path)
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = NORMAL")
            db = sqlite_utils.Database(conn)
            migrate(db)
        except BaseException:
            conn.close()
            raise
        return db

    return open_sqlite(path, attempt)


def refuse_foreign(conn: sqlite3.Connection, path: Path) -> bool:
    """A ConfigError for a SQLite file of another program at `path`, which is then left as it
    is (no tables added to it, its journal mode unchanged). statechat's are: a new or empty
    file; one of the chats' tables alone (`chat_*`, chat/storage.py: a run without the cache
    makes them alone); an index, whose tables `migrate` makes all at once (the schema version
    set with them, lost by a `sqlite3 .dump` reload) and which may hold a user's own tables too.
    Anything else is another program's: tables of its own, or a version of its own. Whether
    the file holds the index's tables."""
    tables, version, index_tables = _schema(conn)
    if index_tables or (not version and not tables & OWN_TABLES
                        and all(t.startswith("chat_") for t in tables)):
        return index_tables
    others = sorted(t for t in tables if not t.startswith("chat_") and t not in OWN_TABLES)
    why = (f"it holds other tables: {', '.join(others[:5])}" if others else
           f"it has a schema version of another program's, {version}" if version and not
           tables & OWN_TABLES else "its tables are not the index's")
    raise ConfigError(f"{path} is not a statechat cache index ({why}); pick another cache dir")


def _schema(conn: sqlite3.Connection) -> tuple[set[str], int, bool]:
    """(the file's tables, its schema version, whether the tables are the index's), read in one
    transaction: another process's `migrate` that commits between two reads would otherwise
    show its version without its tables (a new cache dir opened by two processes at once was
    called another program's)."""
    began = not conn.in_transaction
    if began:
        conn.execute("BEGIN")
    try:
        tables = {r[0] for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")}
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        index_tables = OWN_TABLES <= tables and "fingerprint" in {
            r[1] for r in conn.execute("PRAGMA table_info(models)")}
    finally:
        if began and conn.in_transaction:  # (SQLite may have rolled it back on an error)
            conn.execute("COMMIT")
    return tables, version, index_tables


def check_integrity(db: sqlite_utils.Database) -> None:
    """sqlite3.DatabaseError if SQLite's quick_check finds the file damaged (a page that no
    query has read yet would otherwise fail the first lookup that reads it)."""
    found = [r[0] for r in db.execute("PRAGMA quick_check").fetchall()]
    if found != ["ok"]:
        raise sqlite3.DatabaseError("database disk image is malformed")


def touch_chain(db: sqlite_utils.Database, tail: str, now: float) -> None:
    """Mark as used at `now` the checkpoint at `tail` (a block hash) and the segments holding
    the blocks of its chain (it and every block before it); the caller holds the transaction
    that makes the two updates one. A prefix reused from device or host memory reads no disk
    row, yet it is what a conversation resumes from and what its new checkpoints stand on:
    without this, a conversation's first blocks (a shared system prompt's) and the checkpoint
    a regenerate resumes from kept the `last_used` of their first save and were evicted
    first."""
    db.execute("""WITH RECURSIVE up(hash) AS (
                    SELECT ? UNION SELECT b.parent FROM blocks b JOIN up ON b.hash = up.hash)
                  UPDATE segments SET last_used = max(last_used, ?) WHERE id IN
                    (SELECT segment_id FROM blocks WHERE hash IN (SELECT hash FROM up))""",
               [tail, now])
    db.execute("UPDATE checkpoints SET last_used = max(last_used, ?) WHERE hash = ?", [now, tail])


def migrate(db: sqlite_utils.Database) -> None:
    """Create the tables, indices and views of SCHEMA_VERSION if they are not there yet."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version >= SCHEMA_VERSION:
        return
    with db.conn:
        db.execute("BEGIN IMMEDIATE")
        if db.execute("PRAGMA user_version").fetchone()[0] >= SCHEMA_VERSION:
            return  # another process migrated while we waited for the lock
        db["models"].create(
            {"id": int, "fingerprint": str, "name": str, "path": str, "dtype": str,
             "block_size": int, "shapes": str, "created": float},
            pk="id", not_null={"fingerprint"}, if_not_exists=True,
        )
        db["models"].create_index(["fingerprint"], unique=True, if_not_exists=True)
        db["segments"].create(
            {"id": int, "model_id": int, "blob": str, "num_blocks": int, "bytes": int,
             "checksum": str, "created": float, "last_used": float},
            pk="id", foreign_keys=[("model_id", "models", "id")], if_not_exists=True,
        )
        db["segments"].create_index(["blob"], unique=True, if_not_exists=True)
        db["blocks"].create(
            {"hash": str, "model_id": int, "parent": str, "position": int, "segment_id": int,
             "seg_index": int},
            pk="hash",
            foreign_keys=[("model_id", "models", "id"), ("segment_id", "segments", "id")],
            if_not_exists=True,
        )
        db["blocks"].create_index(["segment_id"], if_not_exists=True)
        db["checkpoints"].create(
            {"hash": str, "model_id": int, "num_tokens": int, "blob": str, "bytes": int,
             "checksum": str, "created": float, "last_used": float, "hits": int},
            pk="hash", foreign_keys=[("model_id", "models", "id")], if_not_exists=True,
        )
        db["checkpoints"].create_index(["last_used"], if_not_exists=True)
        for name, sql in VIEWS.items():
            db.execute(f"DROP VIEW IF EXISTS {name}")
            db.execute(f"CREATE VIEW {name} AS {sql}")
        db.execute(DISK_BUDGET_TABLE)
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


def model_id(
    db: sqlite_utils.Database, fingerprint: str, name: str, path: str, dtype: str, block_size: int,
) -> int:
    """Id of the model row for `fingerprint`, inserting it if new."""
    row = db.execute("SELECT id FROM models WHERE fingerprint = ?", [fingerprint]).fetchone()
    if row:
        return row[0]
    with db.conn:
        db.execute(
            "INSERT OR IGNORE INTO models (fingerprint, name, path, dtype, block_size, created) "
            "VALUES (?,?,?,?,?,?)",
            [fingerprint, name, path, dtype, block_size, time.time()],
        )
    return db.execute("SELECT id FROM models WHERE fingerprint = ?", [fingerprint]).fetchone()[0]


def chunked(items: list, n: int = 500):
    for i in range(0, len(items), n):
        yield items[i : i + n]


def blocks_present(db: sqlite_utils.Database, hashes: list[str]) -> dict[str, tuple]:
    """hash -> (segment blob, seg_index, segment checksum, num_blocks) for hashes on disk."""
    found: dict[str, tuple] = {}
    for part in chunked(hashes):
        marks = ",".join("?" * len(part))
        rows = db.execute(
            f"SELECT b.hash, s.blob, b.seg_index, s.checksum, s.num_blocks, s.id FROM blocks b "
            f"JOIN segments s ON s.id = b.segment_id WHERE b.hash IN ({marks})",
            part,
        ).fetchall()
        found.update({r[0]: r[1:] for r in rows})
    return found


def checkpoints_present(db: sqlite_utils.Database, hashes: list[str]) -> dict[str, tuple]:
    """hash -> (blob, num_tokens, checksum) for checkpoints on disk."""
    found: dict[str, tuple] = {}
    for part in chunked(hashes):
        marks = ",".join("?" * len(part))
        rows = db.execute(
            f"SELECT hash, blob, num_tokens, checksum FROM checkpoints WHERE hash IN ({marks})",
            part,
        ).fetchall()
        found.update({r[0]: r[1:] for r in rows})
    return found
